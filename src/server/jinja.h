// A Jinja2 subset sufficient for Hugging Face chat templates (Llama 3, Qwen2.5, Gemma 3, Mistral,
// ChatML and the like). No Jinja library exists in Debian's or PyPI's C++ offerings, so this is our
// own: a lexer (with trim_blocks / lstrip_blocks, as transformers renders chat templates), a parser
// to a small AST, and a tree-walking evaluator over JSON-like values.
//
// Templates are untrusted (they come in HTTP requests and inside model files), so parsing and
// rendering are bounded by `Limits`: exceeding one throws serval::Error naming the limit, never a
// crash, a hang or a huge allocation. Integer arithmetic is checked (overflow is an error, not UB).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace serval::jinja {

struct Node;

// Hard bounds on one template: its parse, and each render of it.
struct Limits {
  // Nesting of the template (brackets, operators, statements), of values (lists in lists), and of
  // calls during a render (filters applying filters, ...). Guards the C++ stack.
  int max_depth = 100;
  // Loop iterations in one render, all loops together (including `for ... if` filtering).
  int64_t max_loop_iterations = 1'000'000;
  // Bytes one render may output (also bounds each `{% set %}...{% endset %}` capture).
  size_t max_output_bytes = size_t(16) << 20;
  // Bytes in any one string a render builds.
  size_t max_string_bytes = size_t(16) << 20;
  // Items in any one list or object (range(), list * n, split, ...).
  size_t max_list_items = 100'000;
  // Work in one render, in units of about one byte copied: every value built or copied is charged
  // its size (string bytes, plus 64 per element), every expression evaluated or statement run 16,
  // every substring search its worst case. Bounds both the render's time and its memory.
  uint64_t max_work = uint64_t(256) << 20;
};

class Template {
 public:
  // Parses `source`; throws serval::Error naming the construct it cannot handle, or the limit the
  // template exceeds (nesting depth).
  explicit Template(const std::string& source, const Limits& limits = Limits());
  ~Template();
  // Renders with the given variables (messages, add_generation_prompt, bos_token, ...); throws
  // serval::Error, including for raise_exception() in the template and for any exceeded limit.
  std::string render(const nlohmann::ordered_json& context) const;

  const Limits& limits() const { return limits_; }

 private:
  std::shared_ptr<Node> root_;
  Limits limits_;
};

}  // namespace serval::jinja
