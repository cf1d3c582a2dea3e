// The structured-output fields of a request, turned into one grammar: OpenAI's `response_format`,
// vLLM's `structured_outputs` and older `guided_json/regex/choice/grammar`, llama-server's
// `json_schema` and `grammar`, and the tool-call grammar of `tool_choice: "required"` or a named
// function. Compiled grammars are cached by their GBNF text, so a schema seen before reuses its
// parse states and token masks.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "grammar/matcher.h"
#include "server/tool_calls.h"

namespace serval {

using json = nlohmann::ordered_json;

// A request's constraint: the GBNF text and the field it came from (for error messages).
struct OutputConstraint {
  std::string gbnf;
  std::string field;
};

// The constraint the body asks for, if any. Throws ApiError (400, naming the field) for a malformed
// or unsupported value, or for two constraints at once.
std::optional<OutputConstraint> output_constraint(const json& body);

// How a chat request uses its `tools`.
struct ToolPlan {
  json tools = json::array();
  bool parse_calls = false;                // parse the output for calls (tool_choice other than "none")
  std::optional<OutputConstraint> forced;  // the grammar of tool_choice "required" or a named function
};

// Validates `tools`, `tool_choice` and `parallel_tool_calls`; throws ApiError naming the field.
ToolPlan tool_plan(const json& body, ToolFormat format);

// The compiled grammar for GBNF text (cached; at most 64 grammars are kept). Throws ApiError (400,
// naming `field`) when the text does not parse.
std::shared_ptr<grammar::CompiledGrammar> compile_grammar(const std::string& gbnf, const std::string& field);

}  // namespace serval
