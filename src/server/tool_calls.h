// Tool calls: the formats models write them in, parsed into OpenAI's `tool_calls`, and the grammar
// that forces a call when a request says `tool_choice: "required"` or names a function.
//
// Formats: Hermes (Qwen2.5's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
// of them), Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
// several separated by `;`), Mistral (`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`), OpenAI's
// harmony (gpt-oss: a message to a recipient, `<|start|>assistant to=functions.NAME<|channel|>commentary
// json<|message|>{...}<|call|>`, the recipient also after the channel), and DeepSeek's
// (`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>` as R1 and V3 write
// it, or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` as V3.1, inside
// `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`), and Qwen3-Coder's / Qwen3.5's XML
// (`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`, values
// typed by the function's schema as vLLM's qwen3_coder parser types them).
//
// What parsing accepts besides (recorded examples in tests/data/tool_calls/):
//  - Hermes: a block without `</tool_call>` (the model stopped after the JSON); several objects in
//    one block; objects with doubled braces `{{...}}` (Qwen2.5-Coder's own template shows the format
//    so); and with no `<tool_call>` at all, calls from some line to the end of the text, bare or in
//    one ```json fence (the lines before are content): Qwen2.5-Coder answers that way.
//  - Llama 3: "arguments" for "parameters"; a trailing <|eom_id|> or <|eot_id|>.
//  - Mistral: `[TOOL_CALLS]name[ARGS]{...}` (v13 templates) and `name[CALL_ID]id[ARGS]{...}` (v11),
//    each after its own marker; without any marker, a whole reply that is an array of calls.
// A unit (a block, a fence or bare run, a [TOOL_CALLS] segment, a Llama reply) gives calls only when
// every call in it names a known function with object arguments; otherwise all of it is content.
// `arguments` in a ToolCall is nlohmann's compact dump, keys in the model's order; extra keys in a
// call object ("type", "id") are ignored, and a missing or null "arguments" is {}.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace serval {

enum class ToolFormat { Hermes, Llama3Json, Mistral, Harmony, DeepSeekR1, DeepSeekV31, Qwen3Coder };

const char* to_string(ToolFormat f);

// The format a chat template asks for (from markers in its source); Hermes when nothing matches.
ToolFormat tool_format_for_template(std::string_view template_source);

struct ToolCall {
  std::string id;         // "call_" and 24 random alphanumerics, unique per call
  std::string name;
  std::string arguments;  // JSON text of an object, as OpenAI sends it
};

struct ParsedToolOutput {
  std::string content;          // the text outside the calls (trimmed; may be empty)
  std::vector<ToolCall> calls;  // in order of appearance; empty: no call found
};

// Parses a finished completion's text. Only calls naming a function in `tools` (OpenAI's list of
// {"type": "function", "function": {"name", "description", "parameters"}}) count; text that looks
// like a call but does not parse or names an unknown function stays in `content`.
ParsedToolOutput parse_tool_calls(std::string_view text, ToolFormat format, const nlohmann::ordered_json& tools);

// Where a call would begin in streamed text: the offset of the first call's start marker (or of a
// prefix of it at the end of `text`, which may still become one), or npos. Text before it can be
// streamed as content. Besides the markers: Hermes, the first line that is (or may still become)
// ```json / `{"name"` / `{{"name"` / `[{"name"`; Llama 3, offset 0 while the text (after spaces)
// is empty or opens with '{' or '[{'; Mistral, offset 0 while it is empty or opens with '[{'.
// Pass the whole text so far: as it grows the offset never moves before an earlier one, and once
// the text is complete, parse_tool_calls on all of it gives content that starts with what was
// streamed (trimmed) and any calls.
size_t tool_call_start(std::string_view text, ToolFormat format);

// GBNF (rule "root") for output that is one call (several when `parallel`) in `format`, to a function
// of `tools` (only `function_name` when not empty) with arguments valid under its `parameters`
// schema. Throws serval::Error for an unknown function name or an unsupported parameter schema.
// Shapes: Hermes `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` (several: whitespace
// between blocks); Llama 3 `{"name": "f", "parameters": {...}}` (several: `;` between); Mistral
// `[{"name": "f", "arguments": {...}}, ...]`; keys in that order, up to 8 spaces, tabs or newlines
// around each token. The control-token markers <|python_tag|> and [TOOL_CALLS] are optional: a
// grammar never allows a control token, so the model may leave them out (parsing accepts both).
// A function without `parameters` takes any object; a schema with no type is read as an object one.
std::string tool_call_gbnf(const nlohmann::ordered_json& tools, ToolFormat format, std::string_view function_name,
                           bool parallel);

// A fresh call id: "call_" and 24 random alphanumerics (thread-safe).
std::string new_tool_call_id();

// `gbnf` with `prefix` put before every rule name it defines or uses (not inside literals, character
// classes, repetition bounds or comments), so that several grammars' rules can share one text.
std::string prefix_gbnf_rules(std::string_view gbnf, std::string_view prefix);

}  // namespace serval
