// Parsing and validating OpenAI-style request bodies: everything a client sends is checked here,
// before it reaches the engine, and every refusal is an ApiError with the status and message the
// client gets. No I/O and no engine access, so it can be fuzzed on its own (fuzz_http_request).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/request.h"
#include "server/reasoning.h"
#include "server/tool_calls.h"

namespace serval {

class Tokenizer;
namespace jinja {
class Template;
}

using json = nlohmann::ordered_json;

// An error returned to the client in OpenAI's shape.
struct ApiError {
  int status;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
  std::string code;
};

[[noreturn]] void bad_request(std::string message, std::string param = "");
json error_json(const ApiError& e);
// JSON text; invalid UTF-8 in strings is replaced rather than thrown on.
std::string dump(const json& j);

// The LoRA adapters requests may choose, by name or by id (the index). An unloaded adapter keeps its
// id with an empty name, so an id never names two adapters. Thread-safe: readers take a snapshot, and
// the server replaces the whole list when it loads or unloads one.
class AdapterList {
 public:
  struct Adapter {
    std::string name;  // empty: unloaded
    std::string path;
    float scale = 1.0f;
    int64_t rank = 0;
  };
  using Snapshot = std::shared_ptr<const std::vector<Adapter>>;
  Snapshot get() const;
  void set(std::vector<Adapter> list);
  // The id of the loaded adapter named `name`, or -1.
  static int32_t find(const std::vector<Adapter>& list, const std::string& name);
  static size_t loaded(const std::vector<Adapter>& list);

 private:
  mutable std::mutex mu_;
  Snapshot list_ = std::make_shared<const std::vector<Adapter>>();
};

// What validation needs to know about the served model and the server's settings.
struct ApiContext {
  const Tokenizer* tokenizer = nullptr;
  int64_t max_model_len = 0;
  const jinja::Template* chat_template = nullptr;  // the model's (or --chat-template); may be null
  std::string chat_template_error;                 // why the model's template could not be used
  bool trust_request_chat_template = false;        // accept `chat_template` in a request body
  std::string model_name;
  ToolFormat tool_format = ToolFormat::Hermes;  // how the model writes tool calls (from its template)
  ReasoningFormat reasoning = ReasoningFormat::None;  // --reasoning-parser: chat replies split their thinking
  // LoRA adapters (--lora, or loaded at run time): a request's `model` may name one (vLLM), or its
  // `lora` field pick one by id with a scale (llama-server).
  AdapterList adapters;
};

// Everything one completion / chat request asks for, validated.
struct GenJob {
  bool chat = false;
  std::vector<int32_t> prompt;
  GenerationParams params;
  int n = 1;
  std::vector<std::string> stops;
  bool stream = false, include_usage = false;
  int logprobs = -1;  // -1: none; chat: top_logprobs count with logprobs=true
  std::string echo_text;  // completions with `echo`: the prompt, put before each choice's text
  // Chat with `tools` (tool_choice other than "none"): the output is parsed for calls in this format.
  bool parse_tool_calls = false;
  ToolFormat tool_format = ToolFormat::Hermes;
  json tools = json::array();
  // Chat with --reasoning-parser: the thinking goes to reasoning_content; `reasoning_open`: the rendered
  // prompt ended inside <think> (a template that pre-fills it), so the output starts in the thinking.
  ReasoningFormat reasoning = ReasoningFormat::None;
  bool reasoning_open = false;
  // The output's control tokens kept as text: the formats whose markers are control tokens (harmony's
  // <|channel|> ... <|call|>, DeepSeek's tool-call tags) when a parser reads them.
  bool render_special = false;
  bool messages_api = false;  // answer in the shape of Anthropic's Messages API (chat, one choice)
  // OpenAI's Responses API: the reply's shape, whether the response is stored, the request settings the
  // response object repeats, and the conversation (without instructions) a later request may continue.
  bool responses_api = false, store_response = false;
  json responses_echo, conversation;
};

// A request body: must be a JSON object.
json parse_json_body(std::string_view body);
// 404 unless `model` is absent, null, the served name or a LoRA adapter's name.
void check_model_name(const json& body, const ApiContext& ctx);
// The chat prompt text from `messages` (and `tools`) through the chat template.
std::string render_chat(const json& body, const ApiContext& ctx);
// A /v1/completions (chat = false) or /v1/chat/completions body to a job; throws ApiError.
GenJob parse_generation_request(const json& body, bool chat, const ApiContext& ctx);
// /tokenize and /detokenize bodies.
std::vector<int32_t> parse_tokenize_request(const json& body, const ApiContext& ctx);
std::vector<int32_t> parse_detokenize_request(const json& body, const ApiContext& ctx);

}  // namespace serval
