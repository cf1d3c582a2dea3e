#include "server/structured_output.h"

#include <list>
#include <mutex>
#include <unordered_map>

#include "base/error.h"
#include "grammar/json_schema.h"
#include "grammar/regex.h"
#include "server/api_request.h"

namespace serval {
namespace {

// Runs a converter and turns its serval::Error into a 400 naming the field.
template <typename F>
std::string converted(const std::string& field, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    bad_request(fmt::format("'{}': {}", field, e.what()), field);
  }
}

// A JSON schema given as an object, or as a string holding one (vLLM accepts both).
json schema_value(const json& v, const std::string& field) {
  if (v.is_object() || v.is_boolean()) return v;
  if (v.is_string()) {
    try {
      json s = json::parse(v.get<std::string>());
      if (s.is_object() || s.is_boolean()) return s;
    } catch (const json::exception&) {
    }
  }
  bad_request(fmt::format("'{}' must be a JSON schema (an object, or a string holding one)", field), field);
}

std::string string_value(const json& v, const std::string& field) {
  if (!v.is_string() || v.get<std::string>().empty()) bad_request(fmt::format("'{}' must be a non-empty string", field), field);
  return v.get<std::string>();
}

std::string schema_gbnf(const json& v, const std::string& field) {
  const json schema = schema_value(v, field);
  return converted(field, [&] { return grammar::json_schema_to_gbnf(schema); });
}

std::string regex_gbnf(const json& v, const std::string& field) {
  const std::string pattern = string_value(v, field);
  return converted(field, [&] { return grammar::regex_to_gbnf(pattern, "root"); });
}

std::string choice_gbnf(const json& v, const std::string& field) {
  if (!v.is_array() || v.empty() || v.size() > 1024)
    bad_request(fmt::format("'{}' must be a list of 1 to 1024 strings", field), field);
  std::string g = "root ::= ";
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string() || v[i].get<std::string>().empty())
      bad_request(fmt::format("'{}' must hold non-empty strings", field), field);
    g += (i ? " | " : "") + grammar::gbnf_literal(v[i].get<std::string>());
  }
  return g;
}

std::string grammar_text(const json& v, const std::string& field) {
  std::string g = string_value(v, field);
  compile_grammar(g, field);  // a syntax error is the client's, reported now
  return g;
}

std::string json_object_flag(const json& v, const std::string& field) {
  if (v != true) bad_request(fmt::format("'{}' must be true when given", field), field);
  return grammar::json_object_gbnf();
}

// response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema", ...}}.
std::optional<std::string> response_format_gbnf(const json& v) {
  if (!v.is_object() || !v.contains("type") || !v["type"].is_string())
    bad_request("'response_format' must be an object with a string 'type'", "response_format");
  const std::string type = v["type"].get<std::string>();
  if (type == "text") return std::nullopt;
  if (type == "json_object") return grammar::json_object_gbnf();
  if (type != "json_schema")
    bad_request(fmt::format("'response_format' type '{}' is not supported (text, json_object, json_schema)", type),
                "response_format");
  if (!v.contains("json_schema") || !v["json_schema"].is_object())
    bad_request("'response_format' of type json_schema needs a 'json_schema' object", "response_format");
  const json& js = v["json_schema"];
  for (const auto& [key, x] : js.items()) {
    const bool ok = key == "name" || key == "description" ? x.is_string()
                    : key == "strict"                     ? x.is_boolean() || x.is_null()
                    : key == "schema"                     ? x.is_object() || x.is_boolean() || x.is_null()
                                                          : false;
    if (!ok)
      bad_request(fmt::format("'response_format.json_schema.{}' is unknown or of the wrong type (name, description: "
                              "strings; schema: an object; strict: a boolean)", key), "response_format");
  }
  // Without a schema OpenAI's API accepts any JSON object.
  if (!js.contains("schema") || js["schema"].is_null()) return grammar::json_object_gbnf();
  return schema_gbnf(js["schema"], "response_format");
}

using Converter = std::string (*)(const json&, const std::string&);
struct SubField {
  const char* name;
  Converter convert;
};

// vLLM's structured_outputs object: exactly one of these keys.
constexpr SubField kStructuredOutputs[] = {{"json", schema_gbnf}, {"regex", regex_gbnf}, {"choice", choice_gbnf},
                                           {"grammar", grammar_text}, {"json_object", json_object_flag}};

std::string structured_outputs_gbnf(const json& v) {
  if (!v.is_object()) bad_request("'structured_outputs' must be an object", "structured_outputs");
  std::optional<std::string> out;
  for (const auto& [key, x] : v.items()) {
    const SubField* f = nullptr;
    for (const SubField& s : kStructuredOutputs)
      if (key == s.name) f = &s;
    if (!f)
      bad_request(fmt::format("'structured_outputs.{}' is not supported (json, regex, choice, grammar, json_object)", key),
                  "structured_outputs");
    if (x.is_null()) continue;
    if (out) bad_request("'structured_outputs' must hold exactly one constraint", "structured_outputs");
    out = f->convert(x, "structured_outputs." + key);
  }
  if (!out) bad_request("'structured_outputs' holds no constraint", "structured_outputs");
  return *out;
}

// Top-level fields that each ask for a constraint.
constexpr SubField kTopLevel[] = {
    {"guided_json", schema_gbnf}, {"guided_regex", regex_gbnf}, {"guided_choice", choice_gbnf},
    {"guided_grammar", grammar_text}, {"json_schema", schema_gbnf}, {"grammar", grammar_text},
    {"structured_outputs", [](const json& v, const std::string&) { return structured_outputs_gbnf(v); }},
};

}  // namespace

std::optional<OutputConstraint> output_constraint(const json& body) {
  std::optional<OutputConstraint> out;
  auto set = [&](std::string gbnf, const std::string& field) {
    if (out) bad_request(fmt::format("'{}' and '{}' both constrain the output; send one", out->field, field), field);
    out = OutputConstraint{std::move(gbnf), field};
  };
  if (body.contains("response_format") && !body["response_format"].is_null())
    if (auto g = response_format_gbnf(body["response_format"])) set(std::move(*g), "response_format");
  for (const SubField& f : kTopLevel)
    if (body.contains(f.name) && !body[f.name].is_null()) set(f.convert(body[f.name], f.name), f.name);
  return out;
}

namespace {

void check_tools(const json& tools) {
  if (!tools.is_array() || tools.size() > 128) bad_request("'tools' must be a list of at most 128 tools", "tools");
  for (const auto& t : tools) {
    if (!t.is_object() || t.value("type", json()) != "function" || !t.contains("function") || !t["function"].is_object())
      bad_request("each tool must be {\"type\": \"function\", \"function\": {...}}", "tools");
    const json& f = t["function"];
    if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty() ||
        f["name"].get<std::string>().size() > 64)
      bad_request("each tool function needs a 'name' of 1 to 64 characters", "tools");
    auto typed = [&](const char* key, bool (json::*is)() const noexcept) {
      return !f.contains(key) || f[key].is_null() || (f[key].*is)();
    };
    if (!typed("parameters", &json::is_object) || !typed("description", &json::is_string) ||
        !typed("strict", &json::is_boolean))
      bad_request("a tool function's 'parameters' must be a JSON schema object, 'description' a string and 'strict' "
                  "a boolean", "tools");
  }
}

// The function a tool_choice object names: {"type": "function", "function": {"name": ...}}.
std::string named_function(const json& choice) {
  if (!choice.is_object() || choice.value("type", json()) != "function" || !choice.contains("function") ||
      !choice["function"].is_object() || !choice["function"].contains("name") || !choice["function"]["name"].is_string())
    bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                "tool_choice");
  return choice["function"]["name"].get<std::string>();
}

}  // namespace

ToolPlan tool_plan(const json& body, ToolFormat format) {
  ToolPlan plan;
  const bool has_tools = body.contains("tools") && !body["tools"].is_null();
  if (has_tools) check_tools(body["tools"]), plan.tools = body["tools"];
  const json choice = body.contains("tool_choice") && !body["tool_choice"].is_null() ? body["tool_choice"]
                                                                                     : json(has_tools ? "auto" : "none");
  const bool parallel = !body.contains("parallel_tool_calls") || body["parallel_tool_calls"].is_null() ||
                        body["parallel_tool_calls"] == true;
  if (choice == "none") return plan;
  if (!has_tools || plan.tools.empty()) bad_request("'tool_choice' needs a non-empty 'tools' list", "tool_choice");
  plan.parse_calls = true;
  if (choice == "auto") return plan;
  const std::string name = choice == "required" ? "" : named_function(choice);
  const std::string gbnf = converted("tool_choice", [&] { return tool_call_gbnf(plan.tools, format, name, parallel && name.empty()); });
  plan.forced = OutputConstraint{gbnf, "tool_choice"};
  return plan;
}

std::shared_ptr<grammar::CompiledGrammar> compile_grammar(const std::string& gbnf, const std::string& field) {
  static std::mutex mu;
  static std::list<std::pair<std::string, std::shared_ptr<grammar::CompiledGrammar>>> lru;  // most recent first
  static std::unordered_map<std::string, decltype(lru)::iterator> index;
  {
    std::lock_guard lock(mu);
    if (auto it = index.find(gbnf); it != index.end()) {
      lru.splice(lru.begin(), lru, it->second);
      return it->second->second;
    }
  }
  std::shared_ptr<grammar::CompiledGrammar> g;
  try {
    g = std::make_shared<grammar::CompiledGrammar>(grammar::parse_gbnf(gbnf));
  } catch (const Error& e) {
    bad_request(fmt::format("'{}': {}", field, e.what()), field);
  }
  std::lock_guard lock(mu);
  if (index.count(gbnf)) return index[gbnf]->second;
  lru.emplace_front(gbnf, g);
  index[gbnf] = lru.begin();
  if (lru.size() > 64) index.erase(lru.back().first), lru.pop_back();
  return g;
}

}  // namespace serval
