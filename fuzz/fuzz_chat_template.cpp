// libFuzzer harness for the Jinja chat-template engine (src/server/jinja.h).
//
// Input: template source. It is parsed, and what parses is rendered once: with a full conversation
// (system, user, assistant with a tool call, tool result; a tools list; add_generation_prompt;
// BOS/EOS tokens), or, for one input length in four, with a single user message and no
// generation prompt. Parse and render must give text or serval::Error;
// any other exception, a crash, a sanitizer report, a hang (-timeout) or a huge allocation
// (-rss_limit_mb / -malloc_limit_mb) is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "server/jinja.h"

namespace {

using ojson = nlohmann::ordered_json;

const ojson& full_context() {
  static const ojson ctx = ojson::parse(R"({
    "messages": [
      {"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What is the weather in Paris? Answer in \"quotes\" & <b>tags</b>."},
      {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
      {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
      {"role": "assistant", "content": "It is 21 °C in Paris. 你好 😀"},
      {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]}
    ],
    "tools": [
      {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
    ],
    "add_generation_prompt": true,
    "bos_token": "<s>",
    "eos_token": "</s>"
  })");
  return ctx;
}

const ojson& small_context() {
  static const ojson ctx = ojson::parse(R"({
    "messages": [{"role": "user", "content": "hi"}],
    "add_generation_prompt": false,
    "bos_token": "",
    "eos_token": "<|endoftext|>"
  })");
  return ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  try {
    const serval::jinja::Template tmpl(source);
    // One render per input (the input's length picks the context) keeps each run within -timeout.
    try { (void)tmpl.render(size % 4 == 3 ? small_context() : full_context()); } catch (const serval::Error&) {}
  } catch (const serval::Error&) {
  }
  return 0;
}
