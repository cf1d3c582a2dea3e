// CompletionRun's answers in the shape of Anthropic's Messages API: a `message` object with content
// blocks (thinking, text, tool_use), and when streaming the named events message_start, ping,
// content_block_start / _delta / _stop per block, message_delta (stop_reason, usage) and message_stop.
#include "server/completion_run.h"
#include "server/messages_api.h"

namespace serval {

void CompletionRun::send_event(const json& payload) {
  ex_->write_chunk("event: " + payload["type"].get<std::string>() + "\ndata: " + dump(payload) + "\n\n");
}

// Anthropic counts prompt tokens read from the cache apart from the others.
json CompletionRun::messages_usage() const {
  const Choice& c = choices_.front();
  const int64_t prompt = int64_t(job_.prompt.size());
  return json{{"input_tokens", prompt - c.cached_tokens}, {"cache_creation_input_tokens", 0},
              {"cache_read_input_tokens", c.cached_tokens}, {"output_tokens", c.tokens}};
}

// One streamed piece of a block: a new block starts when the type changes (thinking, then text).
void CompletionRun::block_delta(const std::string& type, const std::string& text) {
  if (type != block_type_) {
    close_block();
    block_type_ = type;
    json start = type == "thinking" ? json{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                                    : json{{"type", "text"}, {"text", ""}};
    send_event({{"type", "content_block_start"}, {"index", ++block_}, {"content_block", start}});
  }
  json delta = type == "thinking" ? json{{"type", "thinking_delta"}, {"thinking", text}}
                                  : json{{"type", "text_delta"}, {"text", text}};
  send_event({{"type", "content_block_delta"}, {"index", block_}, {"delta", delta}});
}

void CompletionRun::close_block() {
  if (block_type_.empty()) return;
  send_event({{"type", "content_block_stop"}, {"index", block_}});
  block_type_.clear();
}

void CompletionRun::stream_messages_event(const std::string& delta, size_t index) {
  Choice& c = choices_[index];
  if (!message_started_) {  // at the first event, when the prefix cache's share of the prompt is known
    message_started_ = true;
    json usage = messages_usage();
    usage["output_tokens"] = 0;
    send_event({{"type", "message_start"},
                {"message", {{"id", id_}, {"type", "message"}, {"role", "assistant"}, {"model", ctx_.model_name},
                             {"content", json::array()}, {"stop_reason", nullptr}, {"stop_sequence", nullptr},
                             {"usage", usage}}}});
    send_event({{"type", "ping"}});
  }
  if (!c.reasoning_delta.empty()) block_delta("thinking", c.reasoning_delta);
  const std::string text = job_.parse_tool_calls ? tool_text_delta(c) : delta;
  if (!text.empty()) block_delta("text", text);
  if (!c.done) return;
  close_block();
  for (const ToolCall& call : c.parsed.calls) {  // each call whole, its input as one JSON delta
    send_event({{"type", "content_block_start"}, {"index", ++block_},
                {"content_block", {{"type", "tool_use"}, {"id", call.id}, {"name", call.name}, {"input", json::object()}}}});
    send_event({{"type", "content_block_delta"}, {"index", block_},
                {"delta", {{"type", "input_json_delta"}, {"partial_json", call.arguments}}}});
    send_event({{"type", "content_block_stop"}, {"index", block_}});
  }
}

void CompletionRun::finish_messages_stream() {
  const Choice& c = choices_.front();
  close_block();  // a client gone or a timeout can end the run with a block open
  const std::string& stop = c.text->stop_string();
  send_event({{"type", "message_delta"},
              {"delta", {{"stop_reason", anthropic_stop_reason(c.finish_reason, stop)},
                         {"stop_sequence", stop.empty() ? json(nullptr) : json(stop)}}},
              {"usage", messages_usage()}});
  send_event({{"type", "message_stop"}});
}

json CompletionRun::messages_json() const {
  const Choice& c = choices_.front();
  json content = json::array();
  if (!c.reasoning.empty()) content.push_back({{"type", "thinking"}, {"thinking", c.reasoning}, {"signature", ""}});
  const std::string& text = c.parsed.calls.empty() ? c.full_text : c.parsed.content;
  if (!text.empty()) content.push_back({{"type", "text"}, {"text", text}});
  for (const ToolCall& call : c.parsed.calls) {
    json input = json::parse(call.arguments, nullptr, /*allow_exceptions=*/false);
    content.push_back({{"type", "tool_use"}, {"id", call.id}, {"name", call.name},
                       {"input", input.is_object() ? input : json::object()}});
  }
  const std::string& stop = c.text->stop_string();
  return json{{"id", id_}, {"type", "message"}, {"role", "assistant"}, {"model", ctx_.model_name},
              {"content", content}, {"stop_reason", anthropic_stop_reason(c.finish_reason, stop)},
              {"stop_sequence", stop.empty() ? json(nullptr) : json(stop)}, {"usage", messages_usage()}};
}

}  // namespace serval
