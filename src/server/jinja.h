// A Jinja2 subset sufficient for Hugging Face chat templates (Llama 3, Qwen2.5, Gemma 3, Mistral,
// ChatML and the like). No Jinja library exists in Debian's or PyPI's C++ offerings, so this is our
// own: a lexer (with trim_blocks / lstrip_blocks, as transformers renders chat templates), a parser
// to a small AST, and a tree-walking evaluator over JSON-like values.
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace serval::jinja {

struct Node;

class Template {
 public:
  // Parses `source`; throws serval::Error naming the construct it cannot handle.
  explicit Template(const std::string& source);
  ~Template();
  // Renders with the given variables (messages, add_generation_prompt, bos_token, ...); throws
  // serval::Error, including for raise_exception() in the template.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<Node> root_;
};

}  // namespace serval::jinja
