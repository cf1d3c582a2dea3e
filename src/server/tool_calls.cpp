#include "server/tool_calls.h"

#include <algorithm>
#include <cctype>
#include <atomic>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <unordered_set>

#include "base/error.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"

namespace serval {

namespace {

using ojson = nlohmann::ordered_json;
constexpr size_t npos = std::string_view::npos;

constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";
constexpr std::string_view kMistralCalls = "[TOOL_CALLS]";
constexpr std::string_view kMistralArgs = "[ARGS]";
constexpr std::string_view kMistralCallId = "[CALL_ID]";
constexpr std::string_view kHarmonyTo = "to=functions.", kHarmonyMessage = "<|message|>";
constexpr std::string_view kHarmonyEnds[] = {"<|call|>", "<|end|>", "<|return|>"};
constexpr std::string_view kHarmonyMarkers[] = {"<|start|>", "<|channel|>"};
constexpr std::string_view kDsCallsBegin = "<｜tool▁calls▁begin｜>", kDsCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDsCallBegin = "<｜tool▁call▁begin｜>", kDsCallEnd = "<｜tool▁call▁end｜>", kDsSep = "<｜tool▁sep｜>";
constexpr std::string_view kQcFunction = "<function=", kQcFunctionEnd = "</function>";
constexpr std::string_view kQcParam = "<parameter=", kQcParamEnd = "</parameter>";

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

bool is_word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_'; }

size_t skip_ws(std::string_view s, size_t i) {
  while (i < s.size() && is_space(s[i])) ++i;
  return i;
}

std::string_view trim(std::string_view s) {
  size_t b = skip_ws(s, 0), e = s.size();
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// One past the bracket closing the JSON object or array that opens at s[i], found by counting
// brackets outside strings; npos when it is not closed. The text is not validated.
size_t json_extent(std::string_view s, size_t i) {
  int depth = 0;
  bool in_string = false;
  for (size_t k = i; k < s.size(); ++k) {
    const char c = s[k];
    if (in_string) {
      if (c == '\\') ++k;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if ((c == '}' || c == ']') && --depth == 0) {
      return k + 1;
    }
  }
  return npos;
}

std::optional<ojson> parse_json(std::string_view s) {
  ojson j = ojson::parse(s, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// The names of the functions in an OpenAI `tools` list ({"type": "function", "function": {...}};
// a bare {"name": ...} is accepted too).
std::unordered_set<std::string> function_names(const ojson& tools) {
  std::unordered_set<std::string> names;
  if (!tools.is_array()) return names;
  for (const auto& t : tools) {
    if (!t.is_object()) continue;
    const ojson& f = t.contains("function") && t["function"].is_object() ? t["function"] : t;
    if (f.contains("name") && f["name"].is_string()) names.insert(f["name"].get<std::string>());
  }
  return names;
}

// A call object {"name": <known function>, <args key>: {...} or "{...}"} as a ToolCall (id left
// empty). Other keys ("type", "id") are ignored; missing or null arguments are {}.
std::optional<ToolCall> to_call(const ojson& obj, std::string_view args_key, const std::unordered_set<std::string>& names) {
  if (!obj.is_object()) return std::nullopt;
  auto name = obj.find("name");
  if (name == obj.end() || !name->is_string() || !names.count(name->get<std::string>())) return std::nullopt;
  const std::string other_key = args_key == "arguments" ? "parameters" : "arguments";
  auto args = obj.find(std::string(args_key));
  if (args == obj.end()) args = obj.find(other_key);
  ojson value = args == obj.end() || args->is_null() ? ojson::object() : *args;
  if (value.is_string()) {
    auto parsed = parse_json(value.get<std::string>());
    if (!parsed) return std::nullopt;
    value = std::move(*parsed);
  }
  if (!value.is_object()) return std::nullopt;
  return ToolCall{"", name->get<std::string>(), value.dump()};
}

// The JSON object opening at s[i] (s[i] == '{'), also when the model doubled its braces
// ({{"name": ...}}, as Qwen2.5-Coder's own template shows the format); sets `end` past it.
std::optional<ojson> object_at(std::string_view s, size_t i, size_t& end) {
  const size_t e = json_extent(s, i);
  if (e == npos) return std::nullopt;
  if (auto j = parse_json(s.substr(i, e - i))) {
    end = e;
    return j;
  }
  const size_t inner = skip_ws(s, i + 1);
  if (inner >= e || s[inner] != '{') return std::nullopt;
  const size_t inner_end = json_extent(s, inner);
  if (inner_end == npos || skip_ws(s, inner_end) != e - 1) return std::nullopt;
  auto j = parse_json(s.substr(inner, inner_end - inner));
  if (j) end = e;
  return j;
}

struct CallRun {
  std::vector<ToolCall> calls;
  size_t end = 0;  // past the last call
};

// The calls written from s[i] on: one JSON array of call objects, or call objects separated by
// whitespace or one of `separators`. All of them must be valid calls, or there is no run.
std::optional<CallRun> call_run(std::string_view s, size_t i, std::string_view args_key, std::string_view separators,
                                const std::unordered_set<std::string>& names) {
  CallRun run;
  i = skip_ws(s, i);
  if (i < s.size() && s[i] == '[') {
    const size_t e = json_extent(s, i);
    auto arr = e == npos ? std::nullopt : parse_json(s.substr(i, e - i));
    if (!arr || !arr->is_array() || arr->empty()) return std::nullopt;
    for (const auto& obj : *arr) {
      auto call = to_call(obj, args_key, names);
      if (!call) return std::nullopt;
      run.calls.push_back(std::move(*call));
    }
    run.end = e;
    return run;
  }
  while (i < s.size() && s[i] == '{') {
    size_t end = 0;
    auto obj = object_at(s, i, end);
    auto call = obj ? to_call(*obj, args_key, names) : std::nullopt;
    if (!call) return std::nullopt;
    run.calls.push_back(std::move(*call));
    run.end = end;
    i = skip_ws(s, end);
    if (i < s.size() && separators.find(s[i]) != npos) i = skip_ws(s, i + 1);
  }
  if (run.calls.empty()) return std::nullopt;
  return run;
}

// A run that covers all of s[i..] (trailing whitespace and separators allowed).
std::optional<CallRun> whole_run(std::string_view s, size_t i, std::string_view args_key, std::string_view separators,
                                 const std::unordered_set<std::string>& names) {
  auto run = call_run(s, i, args_key, separators, names);
  if (!run) return std::nullopt;
  for (size_t k = run->end; k < s.size(); ++k) {
    if (!is_space(s[k]) && separators.find(s[k]) == npos) return std::nullopt;
  }
  return run;
}

bool starts_with_ci(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t k = 0; k < prefix.size(); ++k) {
    if (std::tolower(static_cast<unsigned char>(s[k])) != prefix[k]) return false;
  }
  return true;
}

// Hermes without <tool_call> tags, as Qwen2.5-Coder answers: from some line on, the rest of the
// text is a Markdown fence (```json or ```) holding only calls, or only calls. The lines before
// are content.
std::optional<ParsedToolOutput> hermes_untagged(std::string_view text, const std::unordered_set<std::string>& names) {
  for (size_t p = 0, nl = 0; nl != npos && p < text.size(); p = nl + 1) {
    nl = text.find('\n', p);
    size_t q = p;
    while (q < text.size() && (text[q] == ' ' || text[q] == '\t')) ++q;
    if (q >= text.size()) break;
    std::optional<CallRun> run;
    if (text.substr(q).starts_with("```")) {
      size_t b = q + 3;
      if (starts_with_ci(text.substr(b), "json")) b += 4;
      const size_t eol = text.find('\n', b);
      const std::string_view rest = trim(text.substr(q));
      const size_t body_end = size_t(rest.data() - text.data()) + rest.size() - 3;  // the closing fence
      if (eol == npos || !trim(text.substr(b, eol - b)).empty() || !rest.ends_with("```") || body_end < eol + 1) continue;
      run = whole_run(text.substr(eol + 1, body_end - (eol + 1)), 0, "arguments", ",", names);
    } else if (text[q] == '{' || text[q] == '[') {
      run = whole_run(text, q, "arguments", ",", names);
    }
    if (run) return ParsedToolOutput{std::string(trim(text.substr(0, p))), std::move(run->calls)};
  }
  return std::nullopt;
}

ParsedToolOutput parse_hermes(std::string_view text, const std::unordered_set<std::string>& names) {
  ParsedToolOutput out;
  std::string content;
  size_t pos = 0;
  bool tagged = false;
  for (size_t open; (open = text.find(kHermesOpen, pos)) != npos;) {
    tagged = true;
    content += text.substr(pos, open - pos);
    const size_t body = open + kHermesOpen.size();
    const size_t close = text.find(kHermesClose, body);
    const size_t next_open = text.find(kHermesOpen, body);
    if (close != npos && close < next_open) {  // <tool_call> calls </tool_call>
      auto run = whole_run(text.substr(body, close - body), 0, "arguments", ",", names);
      if (run) {
        std::move(run->calls.begin(), run->calls.end(), std::back_inserter(out.calls));
      } else {
        content += text.substr(open, close + kHermesClose.size() - open);
      }
      pos = close + kHermesClose.size();
    } else {  // no closing tag (the model stopped right after the JSON): the calls, then content
      const size_t limit = next_open == npos ? text.size() : next_open;
      const std::string_view block = text.substr(0, limit);
      auto run = call_run(block, body, "arguments", ",", names);
      if (run) {
        std::move(run->calls.begin(), run->calls.end(), std::back_inserter(out.calls));
        content += block.substr(run->end);
      } else {
        content += block.substr(open);
      }
      pos = limit;
    }
  }
  content += text.substr(pos);
  if (!tagged) {
    if (auto untagged = hermes_untagged(text, names)) return std::move(*untagged);
  }
  out.content = std::string(trim(content));
  return out;
}

ParsedToolOutput parse_llama3(std::string_view text, const std::unordered_set<std::string>& names) {
  const size_t tag = text.find(kPythonTag);
  const std::string_view head = tag == npos ? std::string_view() : text.substr(0, tag);
  std::string_view body = trim(tag == npos ? text : text.substr(tag + kPythonTag.size()));
  for (std::string_view end : {"<|eom_id|>", "<|eot_id|>"}) {
    if (body.ends_with(end)) body = trim(body.substr(0, body.size() - end.size()));
  }
  if (auto run = whole_run(body, 0, "parameters", ";", names)) return {std::string(trim(head)), std::move(run->calls)};
  return {std::string(trim(text)), {}};
}

// After [TOOL_CALLS] (at s[i]): a JSON array of calls (Mistral's v3 tokenizer), or
// name[ARGS]{...} (v13) or name[CALL_ID]id[ARGS]{...} (v11).
std::optional<CallRun> mistral_segment(std::string_view s, size_t i, const std::unordered_set<std::string>& names) {
  const size_t j = skip_ws(s, i);
  if (j < s.size() && s[j] == '[') return call_run(s, j, "arguments", ",", names);
  const size_t args = s.find(kMistralArgs, j);
  if (args == npos) return std::nullopt;
  const size_t name_end = std::min(args, s.find(kMistralCallId, j));
  const std::string name(trim(s.substr(j, name_end - j)));
  if (name.empty() || std::any_of(name.begin(), name.end(), [](char c) { return is_space(c) || c == '{' || c == '['; })) {
    return std::nullopt;
  }
  const size_t obj = skip_ws(s, args + kMistralArgs.size());
  if (obj >= s.size() || s[obj] != '{') return std::nullopt;
  const size_t end = json_extent(s, obj);
  auto value = end == npos ? std::nullopt : parse_json(s.substr(obj, end - obj));
  if (!value) return std::nullopt;
  auto call = to_call(ojson{{"name", name}, {"arguments", *value}}, "arguments", names);
  if (!call) return std::nullopt;
  return CallRun{{std::move(*call)}, end};
}

ParsedToolOutput parse_mistral(std::string_view text, const std::unordered_set<std::string>& names) {
  size_t pos = text.find(kMistralCalls);
  if (pos == npos) {  // the marker is a control token: without it, a bare array of calls
    const size_t b = skip_ws(text, 0);
    if (b < text.size() && text[b] == '[') {
      if (auto run = whole_run(text, b, "arguments", ",", names)) return {"", std::move(run->calls)};
    }
    return {std::string(trim(text)), {}};
  }
  ParsedToolOutput out;
  std::string content(text.substr(0, pos));
  while (pos < text.size()) {  // text[pos..] starts with [TOOL_CALLS]
    const size_t after = pos + kMistralCalls.size();
    auto run = mistral_segment(text, after, names);
    const size_t next = text.find(kMistralCalls, run ? run->end : after);
    const size_t stop = next == npos ? text.size() : next;
    if (run) {
      std::move(run->calls.begin(), run->calls.end(), std::back_inserter(out.calls));
      content += text.substr(run->end, stop - run->end);
    } else {
      content += text.substr(pos, stop - pos);
    }
    pos = stop;
  }
  out.content = std::string(trim(content));
  return out;
}

// Harmony: every message addressed to `functions.NAME` is a call (its body the arguments, up to <|call|>,
// <|end|> or the end of the text). A call's span starts at the header's first marker (<|start|> or
// <|channel|>) after the previous span; a message that does not parse stays content.
ParsedToolOutput parse_harmony(std::string_view text, const std::unordered_set<std::string>& names) {
  ParsedToolOutput out;
  std::string content;
  size_t done = 0;
  for (size_t to = text.find(kHarmonyTo); to != npos; to = text.find(kHarmonyTo, to + 1)) {
    if (to < done) continue;
    size_t name_end = to + kHarmonyTo.size();
    while (name_end < text.size() && (is_word_char(text[name_end]) || text[name_end] == '.')) ++name_end;
    const std::string name(text.substr(to + kHarmonyTo.size(), name_end - to - kHarmonyTo.size()));
    const size_t message = text.find(kHarmonyMessage, name_end);
    if (message == npos) break;
    const size_t body = message + kHarmonyMessage.size();
    size_t end = text.size(), end_size = 0;
    for (std::string_view m : kHarmonyEnds)
      if (const size_t at = text.find(m, body); at < end) end = at, end_size = m.size();
    size_t start = to;
    for (std::string_view m : kHarmonyMarkers)
      if (const size_t at = text.rfind(m, to); at != npos && at >= done && at < start) start = at;
    const auto args = parse_json(trim(text.substr(body, end - body)));
    if (!names.count(name) || !args || !args->is_object()) continue;
    content += text.substr(done, start - done);
    out.calls.push_back(ToolCall{"", name, args->dump()});
    done = end + end_size;
  }
  content += text.substr(std::min(done, text.size()));
  out.content = std::string(trim(content));
  return out;
}

// The text before a run of calls [start, end) and after it, joined and trimmed.
std::string content_around(std::string_view text, size_t start, size_t end) {
  return std::string(trim(std::string(text.substr(0, start)) + std::string(text.substr(std::min(end, text.size())))));
}

// DeepSeek: calls between <｜tool▁call▁begin｜> and <｜tool▁call▁end｜>, each "TYPE<sep>NAME\n```json\n{...}\n```"
// (R1, V3) or "NAME<sep>{...}" (V3.1). The calls block (from <｜tool▁calls▁begin｜>, or the first call, to
// <｜tool▁calls▁end｜> or the last call's end) gives calls only when all of them parse.
std::optional<ToolCall> deepseek_call(std::string_view inner, const std::unordered_set<std::string>& names) {
  const size_t sep = inner.find(kDsSep);
  if (sep == npos) return std::nullopt;
  std::string_view head = trim(inner.substr(0, sep)), rest = inner.substr(sep + kDsSep.size());
  std::string name(head);
  if (head == "function") {  // R1 / V3: the name on the rest's first line, the arguments fenced
    const size_t nl = rest.find('\n');
    name = std::string(trim(rest.substr(0, nl)));
    rest = nl == npos ? std::string_view() : rest.substr(nl + 1);
  }
  rest = trim(rest);
  if (rest.starts_with("```json")) rest = rest.substr(7);
  else if (rest.starts_with("```")) rest = rest.substr(3);
  rest = trim(rest);
  if (rest.ends_with("```")) rest = trim(rest.substr(0, rest.size() - 3));
  const auto args = parse_json(rest);
  if (!names.count(name) || !args || !args->is_object()) return std::nullopt;
  return ToolCall{"", name, args->dump()};
}

ParsedToolOutput parse_deepseek(std::string_view text, const std::unordered_set<std::string>& names) {
  const size_t first = text.find(kDsCallBegin);
  if (first == npos) return {std::string(trim(text)), {}};
  const size_t block = text.rfind(kDsCallsBegin, first);
  const size_t start = block != npos && trim(text.substr(block + kDsCallsBegin.size(), first - block - kDsCallsBegin.size())).empty() ? block : first;
  ParsedToolOutput out;
  size_t pos = first, end = first;
  while (pos != npos && pos < text.size() && text.substr(pos).starts_with(kDsCallBegin)) {
    const size_t close = text.find(kDsCallEnd, pos);
    const size_t inner = pos + kDsCallBegin.size();
    auto call = deepseek_call(text.substr(inner, (close == npos ? text.size() : close) - inner), names);
    if (!call) return {std::string(trim(text)), {}};
    out.calls.push_back(std::move(*call));
    end = close == npos ? text.size() : close + kDsCallEnd.size();
    pos = skip_ws(text, end);
  }
  if (text.substr(pos).starts_with(kDsCallsEnd)) end = pos + kDsCallsEnd.size();
  out.content = content_around(text, start, end);
  return out;
}

// Where `marker` starts in `text`, or where a suffix of `text` is a proper prefix of it; npos if neither.
size_t marker_start(std::string_view text, std::string_view marker) {
  if (size_t i = text.find(marker); i != npos) return i;
  for (size_t k = std::min(marker.size() - 1, text.size()); k > 0; --k) {
    if (text.ends_with(marker.substr(0, k))) return text.size() - k;
  }
  return npos;
}

enum class Match { Full, Partial, Fail };

// Whether s[i..] begins with `lit` (Full, i moved past it), ends inside it (Partial), or differs.
Match match_literal(std::string_view s, size_t& i, std::string_view lit) {
  const size_t n = std::min(lit.size(), s.size() - i);
  if (s.substr(i, n) != lit.substr(0, n)) return Match::Fail;
  if (n < lit.size()) return Match::Partial;
  i += n;
  return Match::Full;
}

// Whether a line (s, from its start) may still become an untagged Hermes call: optional
// indentation, an optional ```json fence, an optional '[', '{' (or "{{"), then "name" first.
bool may_start_untagged_call(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  if (i == s.size()) return true;
  if (s[i] == '`') {
    if (auto m = match_literal(s, i, "```"); m != Match::Full) return m == Match::Partial;
    size_t w = i;
    while (w < s.size() && std::isalpha(static_cast<unsigned char>(s[w]))) ++w;
    const std::string_view word = s.substr(i, w - i);
    // The language is empty or "json"; at the end of the text, a prefix of it will do.
    const bool json_prefix = word.size() <= 4 && starts_with_ci(word, std::string_view("json").substr(0, word.size()));
    if (!json_prefix || (w < s.size() && word.size() != 0 && word.size() != 4)) return false;
    if (w == s.size()) return true;
    i = w;
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
    if (i == s.size()) return true;
    if (s[i] != '\n') return false;
    i = skip_ws(s, i);
    if (i == s.size()) return true;
  }
  if (s[i] == '[') {
    i = skip_ws(s, i + 1);
    if (i == s.size()) return true;
  }
  if (s[i] != '{') return false;
  i = skip_ws(s, i + 1);
  if (i < s.size() && s[i] == '{') i = skip_ws(s, i + 1);
  // Any key may come first ({"arguments": ..., "name": ...} parses too): hold back any object.
  return i == s.size() || s[i] == '"';
}

// The first line start from which the text may be an untagged Hermes call; npos if none.
size_t hermes_untagged_start(std::string_view text) {
  for (size_t p = 0;;) {
    if (may_start_untagged_call(text.substr(p))) return p;
    const size_t nl = text.find('\n', p);
    if (nl == npos) return npos;
    p = nl + 1;
  }
}

// s (after leading whitespace) is empty or begins with `open`, then optional whitespace and `next`.
bool leading_json(std::string_view s, char open, char next) {
  size_t i = skip_ws(s, 0);
  if (i == s.size()) return true;
  if (s[i] != open) return false;
  if (next == 0) return true;
  i = skip_ws(s, i + 1);
  return i == s.size() || s[i] == next;
}


struct Function {
  std::string name;
  const ojson* parameters = nullptr;  // null: any object
};

std::vector<Function> functions_of(const ojson& tools) {
  check(tools.is_array(), "tools must be an array of {{\"type\": \"function\", \"function\": {{...}}}}");
  std::vector<Function> fns;
  for (const auto& t : tools) {
    const ojson* f = t.is_object() && t.contains("function") && t["function"].is_object() ? &t["function"] : &t;
    check(f->is_object() && f->contains("name") && (*f)["name"].is_string(), "each tool needs a function name");
    const std::string name = (*f)["name"].get<std::string>();
    if (std::any_of(fns.begin(), fns.end(), [&](const Function& g) { return g.name == name; })) continue;
    auto p = f->find("parameters");
    fns.push_back({name, p != f->end() && !p->is_null() ? &*p : nullptr});
  }
  return fns;
}

// The GBNF of a function's arguments (rule "root"): its parameters schema, which must describe an
// object (a schema with no type and no combinator is read as an object one), or any object.
std::string arguments_gbnf(const Function& fn) {
  if (!fn.parameters) return grammar::json_object_gbnf();
  check(fn.parameters->is_object(), "the parameters of function '{}' must be a JSON Schema object", fn.name);
  ojson schema = *fn.parameters;
  // Arguments are an object: a schema without a type is read as an object one (combinators and all),
  // and any other type is refused rather than forced into a call that could not parse back.
  if (!schema.contains("type")) schema["type"] = "object";
  check(schema["type"] == "object", "the parameters of function '{}' must describe an object (\"type\": \"object\")",
        fn.name);
  try {
    return grammar::json_schema_to_gbnf(schema);
  } catch (const Error& e) {
    fail("the parameters of function '{}': {}", fn.name, e.what());
  }
}

// Qwen3-Coder / Qwen3.5: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
// </function>\n</tool_call>`. A value is text (one newline after the tag and before the closing one
// dropped), typed by its function's schema as vLLM's qwen3_coder parser does: "null" is null;
// string kept; integer and number parsed as numbers, boolean as true / false (any case), object and
// array as JSON, each falling back to the text when it does not parse; a parameter the schema does
// not name stays text.
ojson qwen3_coder_value(std::string_view raw, const ojson* schema) {
  if (raw.starts_with('\n')) raw.remove_prefix(1);
  if (raw.ends_with('\n')) raw.remove_suffix(1);
  const std::string text(raw);
  const std::string type = schema && schema->is_object() && schema->contains("type") && (*schema)["type"].is_string()
                               ? (*schema)["type"].get<std::string>() : "string";
  std::string lower = text;
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "null") return nullptr;
  if (type == "boolean" && (lower == "true" || lower == "false")) return lower == "true";
  if (type == "integer" || type == "number" || type == "object" || type == "array") {
    auto j = parse_json(trim(text));
    const bool fits = j && (type == "integer" ? j->is_number_integer() : type == "number" ? j->is_number()
                            : type == "object" ? j->is_object() : j->is_array());
    if (fits) return *j;
  }
  return text;
}

// One call: the text after "<function=" up to its "</function>" (or the end); nullopt when the
// function is unknown or the text is not NAME> followed by parameters and whitespace.
std::optional<ToolCall> qwen3_coder_call(std::string_view inner, const std::vector<Function>& fns) {
  const size_t gt = inner.find('>');
  if (gt == npos) return std::nullopt;
  const std::string name(trim(inner.substr(0, gt)));
  const auto fn = std::find_if(fns.begin(), fns.end(), [&](const Function& f) { return f.name == name; });
  if (fn == fns.end()) return std::nullopt;
  const ojson* props = fn->parameters && fn->parameters->is_object() && fn->parameters->contains("properties")
                           ? &(*fn->parameters)["properties"] : nullptr;
  ojson args = ojson::object();
  for (size_t i = skip_ws(inner, gt + 1); i < inner.size(); i = skip_ws(inner, i)) {
    if (!inner.substr(i).starts_with(kQcParam)) return std::nullopt;
    const size_t key_end = inner.find('>', i);
    if (key_end == npos) return std::nullopt;
    const std::string key(trim(inner.substr(i + kQcParam.size(), key_end - i - kQcParam.size())));
    size_t close = inner.find(kQcParamEnd, key_end);
    const size_t next = inner.find(kQcParam, key_end);  // a parameter left open ends at the next one
    if (close == npos || (next != npos && next < close)) close = std::min(next, inner.size());
    const ojson* schema = props && props->is_object() && props->contains(key) ? &(*props)[key] : nullptr;
    args[key] = qwen3_coder_value(inner.substr(key_end + 1, close - key_end - 1), schema);
    i = inner.substr(close).starts_with(kQcParamEnd) ? close + kQcParamEnd.size() : close;
  }
  return ToolCall{"", name, args.dump()};
}

// Calls from the first "<function=" (or the "<tool_call>" just before it) on, each optionally in
// <tool_call> ... </tool_call>, whitespace between; all of them must parse, or everything is content.
ParsedToolOutput parse_qwen3_coder(std::string_view text, const std::vector<Function>& fns) {
  const size_t first = text.find(kQcFunction);
  if (first == npos) return {std::string(trim(text)), {}};
  const size_t tag = text.rfind(kHermesOpen, first);
  const bool tagged = tag != npos && trim(text.substr(tag + kHermesOpen.size(), first - tag - kHermesOpen.size())).empty();
  const size_t start = tagged ? tag : first;
  ParsedToolOutput out;
  size_t pos = start, end = start;
  while (pos < text.size()) {
    const bool open = text.substr(pos).starts_with(kHermesOpen);
    const size_t fn = open ? skip_ws(text, pos + kHermesOpen.size()) : pos;
    if (!text.substr(fn).starts_with(kQcFunction)) break;
    const size_t close = text.find(kQcFunctionEnd, fn);
    const size_t body = fn + kQcFunction.size();
    auto call = qwen3_coder_call(text.substr(body, (close == npos ? text.size() : close) - body), fns);
    if (!call) return {std::string(trim(text)), {}};
    out.calls.push_back(std::move(*call));
    end = close == npos ? text.size() : close + kQcFunctionEnd.size();
    if (size_t after = skip_ws(text, end); open && text.substr(after).starts_with(kHermesClose)) end = after + kHermesClose.size();
    pos = skip_ws(text, end);
  }
  out.content = content_around(text, start, end);
  return out;
}

}  // namespace

const char* to_string(ToolFormat f) {
  switch (f) {
    case ToolFormat::Hermes: return "hermes";
    case ToolFormat::Llama3Json: return "llama3_json";
    case ToolFormat::Mistral: return "mistral";
    case ToolFormat::Harmony: return "openai";  // vLLM's name for gpt-oss's parser
    case ToolFormat::DeepSeekR1: return "deepseek_v3";
    case ToolFormat::DeepSeekV31: return "deepseek_v31";
    case ToolFormat::Qwen3Coder: return "qwen3_coder";
  }
  return "hermes";
}

ToolFormat tool_format_for_template(std::string_view src) {
  auto has = [&](std::string_view s) { return src.find(s) != npos; };
  if (has(kMistralCalls) || has("[AVAILABLE_TOOLS]")) return ToolFormat::Mistral;
  if (has(kHarmonyTo) || (has("<|channel|>") && (has("<|call|>") || has(" to=")))) return ToolFormat::Harmony;
  if (has(kDsCallBegin)) return has("```json") ? ToolFormat::DeepSeekR1 : ToolFormat::DeepSeekV31;
  if (has(kQcFunction) && has(kQcParam)) return ToolFormat::Qwen3Coder;
  if (has(kHermesOpen)) return ToolFormat::Hermes;
  if (has(kPythonTag) || (has("\"parameters\"") && (has("ipython") || has("<|eom_id|>")))) return ToolFormat::Llama3Json;
  return ToolFormat::Hermes;
}

std::string new_tool_call_id() {
  static constexpr std::string_view kAlnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  static std::atomic<uint64_t> streams{0};
  thread_local std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd(), static_cast<unsigned>(std::hash<std::thread::id>{}(std::this_thread::get_id())),
                      static_cast<unsigned>(streams.fetch_add(1))};
    return std::mt19937_64(seq);
  }();
  std::uniform_int_distribution<size_t> pick(0, kAlnum.size() - 1);
  std::string id = "call_";
  for (int k = 0; k < 24; ++k) id += kAlnum[pick(rng)];
  return id;
}

ParsedToolOutput parse_tool_calls(std::string_view text, ToolFormat format, const nlohmann::ordered_json& tools) {
  const auto names = function_names(tools);
  if (names.empty()) return {std::string(trim(text)), {}};
  ParsedToolOutput out;
  switch (format) {
    case ToolFormat::Hermes: out = parse_hermes(text, names); break;
    case ToolFormat::Llama3Json: out = parse_llama3(text, names); break;
    case ToolFormat::Mistral: out = parse_mistral(text, names); break;
    case ToolFormat::Harmony: out = parse_harmony(text, names); break;
    case ToolFormat::DeepSeekR1: case ToolFormat::DeepSeekV31: out = parse_deepseek(text, names); break;
    case ToolFormat::Qwen3Coder: out = parse_qwen3_coder(text, functions_of(tools)); break;
  }
  for (auto& call : out.calls) call.id = new_tool_call_id();
  return out;
}

size_t tool_call_start(std::string_view text, ToolFormat format) {
  switch (format) {
    case ToolFormat::Hermes:
      return std::min(marker_start(text, kHermesOpen), hermes_untagged_start(text));
    case ToolFormat::Llama3Json:
      return std::min(marker_start(text, kPythonTag),
                      leading_json(text, '{', 0) || leading_json(text, '[', '{') ? size_t(0) : npos);
    case ToolFormat::Mistral:
      return std::min(marker_start(text, kMistralCalls), leading_json(text, '[', '{') ? size_t(0) : npos);
    case ToolFormat::Harmony:  // any harmony marker: the reasoning parser leaves only call messages in content
      return std::min(marker_start(text, kHarmonyMarkers[0]), marker_start(text, kHarmonyMarkers[1]));
    case ToolFormat::DeepSeekR1: case ToolFormat::DeepSeekV31:
      return std::min(marker_start(text, kDsCallsBegin), marker_start(text, kDsCallBegin));
    case ToolFormat::Qwen3Coder:
      return std::min(marker_start(text, kHermesOpen), marker_start(text, kQcFunction));
  }
  return npos;
}

std::string prefix_gbnf_rules(std::string_view gbnf, std::string_view prefix) {
  std::string out;
  out.reserve(gbnf.size() * 5 / 4);
  for (size_t i = 0; i < gbnf.size();) {
    const char c = gbnf[i];
    size_t j = i + 1;
    if (c == '"' || c == '[') {  // a literal or a character class, with its escapes
      const char close = c == '"' ? '"' : ']';
      while (j < gbnf.size() && gbnf[j] != close) j += gbnf[j] == '\\' ? 2 : 1;
      j = std::min(j + 1, gbnf.size());
    } else if (c == '#') {
      while (j < gbnf.size() && gbnf[j] != '\n') ++j;
    } else if (c == '{') {  // repetition bounds
      while (j < gbnf.size() && gbnf[j - 1] != '}') ++j;
    } else if (is_word_char(c)) {
      while (j < gbnf.size() && is_word_char(gbnf[j])) ++j;
      out += prefix;
    }
    out += gbnf.substr(i, j - i);
    i = j;
  }
  return out;
}

namespace {
// The formats that write the name outside the arguments' JSON: harmony's header, DeepSeek's tags.
std::string named_call_gbnf(const std::vector<Function>& fns, ToolFormat format, bool parallel) {
  std::string g;
  if (format == ToolFormat::Harmony) {
    g += parallel ? "root ::= call (\"<|start|>assistant\" call)*\n" : "root ::= call\n";
  } else {
    g += "root ::= " + grammar::gbnf_literal(std::string(kDsCallsBegin)) + (parallel ? " call (tcws call)* " : " call ") +
         grammar::gbnf_literal(std::string(kDsCallsEnd)) + "\n";
  }
  g += "call ::= ";
  for (size_t k = 0; k < fns.size(); ++k) g += (k ? " | call-fn" : "call-fn") + std::to_string(k);
  g += "\ntcws ::= [ \\t\\n]{0,8}\n";
  for (size_t k = 0; k < fns.size(); ++k) {
    const std::string prefix = "fn" + std::to_string(k) + "-";
    std::string head, tail;
    switch (format) {
      case ToolFormat::Harmony:
        head = "<|channel|>commentary to=functions." + fns[k].name + " <|constrain|>json<|message|>", tail = "<|call|>";
        break;
      case ToolFormat::DeepSeekR1:
        head = std::string(kDsCallBegin) + "function" + std::string(kDsSep) + fns[k].name + "\n```json\n";
        tail = "\n```" + std::string(kDsCallEnd);
        break;
      default:
        head = std::string(kDsCallBegin) + fns[k].name + std::string(kDsSep), tail = std::string(kDsCallEnd);
    }
    g += "call-fn" + std::to_string(k) + " ::= " + grammar::gbnf_literal(head) + " " + prefix + "root " +
         grammar::gbnf_literal(tail) + "\n";
    g += prefix_gbnf_rules(arguments_gbnf(fns[k]), prefix);
    if (!g.ends_with('\n')) g += '\n';
  }
  return g;
}
}  // namespace

// Qwen3-Coder's XML calls: per function its schema's properties in order, each `<parameter=KEY>\n`
// VALUE `\n</parameter>\n`, the required ones always, the others optionally. A string value is text
// without "</" (one of its literals when the schema has an enum); any other value is JSON under the
// property's schema. A function without properties takes any text parameters.
std::string qwen3_coder_params_gbnf(const Function& fn, const std::string& prefix) {
  const ojson* params = fn.parameters;
  const ojson* props = params && params->is_object() && params->contains("properties") ? &(*params)["properties"] : nullptr;
  if (!props || !props->is_object() || props->empty())
    return prefix + "params ::= (\"<parameter=\" [a-zA-Z0-9_.-]+ \">\\n\" qc-text \"\\n</parameter>\\n\")*\n";
  std::set<std::string> required;
  if (params->contains("required") && (*params)["required"].is_array())
    for (const auto& r : (*params)["required"]) if (r.is_string()) required.insert(r.get<std::string>());
  std::string g = prefix + "params ::=", rules;
  size_t j = 0;
  for (const auto& [key, schema] : props->items()) {
    const std::string value = prefix + "p" + std::to_string(j++) + "-";
    const bool text = schema.is_object() && schema.value("type", "") == "string";
    if (text && schema.contains("enum") && schema["enum"].is_array() && !schema["enum"].empty()) {
      rules += value + "root ::= ";
      for (size_t e = 0; e < schema["enum"].size(); ++e)
        rules += (e ? " | " : "") + grammar::gbnf_literal(schema["enum"][e].is_string() ? schema["enum"][e].get<std::string>()
                                                                                      : schema["enum"][e].dump());
      rules += "\n";
    } else if (text || !schema.is_object() || !schema.contains("type")) {
      rules += value + "root ::= qc-text\n";
    } else {
      try {
        rules += prefix_gbnf_rules(grammar::json_schema_to_gbnf(schema), value);
      } catch (const Error& e) {
        fail("parameter '{}' of function '{}': {}", key, fn.name, e.what());
      }
      if (!rules.ends_with('\n')) rules += '\n';
    }
    g += " (" + grammar::gbnf_literal("<parameter=" + key + ">\n") + " " + value + "root " +
         grammar::gbnf_literal("\n</parameter>\n") + ")" + (required.count(key) ? "" : "?");
  }
  return g + "\n" + rules;
}

std::string qwen3_coder_gbnf(const std::vector<Function>& fns, bool parallel) {
  std::string g = parallel ? "root ::= call (tcws call)*\n" : "root ::= call\n";
  g += "call ::= \"<tool_call>\\n\" (";
  for (size_t k = 0; k < fns.size(); ++k) g += (k ? " | call-fn" : "call-fn") + std::to_string(k);
  g += ") \"\\n</tool_call>\"\ntcws ::= [ \\t\\n]{0,8}\nqc-text ::= ([^<] | \"<\" [^/])*\n";
  for (size_t k = 0; k < fns.size(); ++k) {
    const std::string prefix = "fn" + std::to_string(k) + "-";
    g += "call-fn" + std::to_string(k) + " ::= " + grammar::gbnf_literal("<function=" + fns[k].name + ">\n") + " " + prefix +
         "params \"</function>\"\n";
    g += qwen3_coder_params_gbnf(fns[k], prefix);
  }
  return g;
}

std::string tool_call_gbnf(const nlohmann::ordered_json& tools, ToolFormat format, std::string_view function_name,
                           bool parallel) {
  std::vector<Function> fns = functions_of(tools);
  if (!function_name.empty()) {
    auto it = std::find_if(fns.begin(), fns.end(), [&](const Function& f) { return f.name == function_name; });
    check(it != fns.end(), "tool_choice names function '{}', which is not in tools", function_name);
    fns = {*it};
  }
  check(!fns.empty(), "tool calls need at least one function in tools");
  if (format == ToolFormat::Harmony || format == ToolFormat::DeepSeekR1 || format == ToolFormat::DeepSeekV31)
    return named_call_gbnf(fns, format, parallel);
  if (format == ToolFormat::Qwen3Coder) return qwen3_coder_gbnf(fns, parallel);
  const std::string args_key = format == ToolFormat::Llama3Json ? "parameters" : "arguments";
  std::string g;
  switch (format) {
    case ToolFormat::Harmony: case ToolFormat::DeepSeekR1: case ToolFormat::DeepSeekV31: case ToolFormat::Qwen3Coder:
      break;  // above
    case ToolFormat::Hermes:
      g += parallel ? "root ::= call (tcws call)*\n" : "root ::= call\n";
      g += "call ::= \"<tool_call>\" tcws object tcws \"</tool_call>\"\n";
      break;
    case ToolFormat::Llama3Json:
      g += parallel ? "root ::= \"<|python_tag|>\"? tcws object (tcws \";\" tcws object)*\n"
                    : "root ::= \"<|python_tag|>\"? tcws object\n";
      break;
    case ToolFormat::Mistral:
      g += parallel ? "root ::= \"[TOOL_CALLS]\"? tcws \"[\" tcws object (tcws \",\" tcws object)* tcws \"]\"\n"
                    : "root ::= \"[TOOL_CALLS]\"? tcws \"[\" tcws object tcws \"]\"\n";
      break;
  }
  g += "object ::= \"{\" tcws \"\\\"name\\\"\" tcws \":\" tcws (";
  for (size_t k = 0; k < fns.size(); ++k) g += (k ? " | call-fn" : "call-fn") + std::to_string(k);
  g += ") tcws \"}\"\n";
  g += "tcws ::= [ \\t\\n]{0,8}\n";
  for (size_t k = 0; k < fns.size(); ++k) {
    const std::string prefix = "fn" + std::to_string(k) + "-";
    g += "call-fn" + std::to_string(k) + " ::= " + grammar::gbnf_literal(ojson(fns[k].name).dump()) +
         " tcws \",\" tcws " + grammar::gbnf_literal("\"" + args_key + "\"") + " tcws \":\" tcws " + prefix + "root\n";
    g += prefix_gbnf_rules(arguments_gbnf(fns[k]), prefix);
    if (!g.ends_with('\n')) g += '\n';
  }
  return g;
}

}  // namespace serval
