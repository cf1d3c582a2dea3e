// CompletionRun's answers in the shape of OpenAI's Responses API: a `response` object whose output
// items are a reasoning item (with --reasoning-parser), a message, and function calls; when streaming,
// response.created / in_progress, per item output_item.added, content_part.added, the text or reasoning
// deltas and their .done events, content_part.done, output_item.done (function calls: their arguments as
// one delta), then response.completed (or response.incomplete). Stored responses go to the ResponseStore.
#include "server/completion_run.h"

namespace serval {

void CompletionRun::send_response_event(json payload) {
  payload["sequence_number"] = sequence_++;
  ex_->write_chunk("event: " + payload["type"].get<std::string>() + "\ndata: " + dump(payload) + "\n\n");
}

// rs_…, msg_…, fc_… from the response's own id: one reasoning and one message item per response.
std::string CompletionRun::item_id(const char* prefix) const {
  return std::string(prefix) + "_" + id_.substr(id_.find('-') + 1);
}

std::string CompletionRun::response_status() const {
  const std::string& r = choices_.front().finish_reason;
  return r == "length" ? "incomplete" : r == "abort" ? "cancelled" : r == "error" ? "failed" : "completed";
}

json CompletionRun::response_object(const std::string& status, json output) const {
  const Choice& c = choices_.front();
  json usage = nullptr;
  if (status != "in_progress") {
    const int64_t prompt = int64_t(job_.prompt.size());
    usage = {{"input_tokens", prompt}, {"input_tokens_details", {{"cached_tokens", c.cached_tokens}, {"cache_write_tokens", 0}}},
             {"output_tokens", c.tokens}, {"output_tokens_details", {{"reasoning_tokens", c.reasoning_tokens}}},
             {"total_tokens", prompt + c.tokens}};
  }
  json r{{"id", id_}, {"object", "response"}, {"created_at", created_}, {"status", status}, {"model", ctx_.model_name},
         {"output", std::move(output)}, {"usage", usage}, {"error", nullptr},
         {"incomplete_details", status == "incomplete" ? json{{"reason", "max_output_tokens"}} : json(nullptr)}};
  r.update(job_.responses_echo);
  return r;
}

json CompletionRun::output_items() const {
  const Choice& c = choices_.front();
  json out = json::array();
  if (!c.reasoning.empty())
    out.push_back({{"id", item_id("rs")}, {"type", "reasoning"}, {"summary", json::array()},
                   {"content", json::array({{{"type", "reasoning_text"}, {"text", c.reasoning}}})}});
  const std::string& text = c.parsed.calls.empty() ? c.full_text : c.parsed.content;
  if (!text.empty())
    out.push_back({{"id", item_id("msg")}, {"type", "message"}, {"status", "completed"}, {"role", "assistant"},
                   {"content", json::array({{{"type", "output_text"}, {"text", text}, {"annotations", json::array()},
                                             {"logprobs", json::array()}}})}});
  for (size_t k = 0; k < c.parsed.calls.size(); ++k) {
    const ToolCall& call = c.parsed.calls[k];
    out.push_back({{"id", item_id("fc") + "_" + std::to_string(k)}, {"type", "function_call"}, {"call_id", call.id},
                   {"name", call.name}, {"arguments", call.arguments}, {"status", "completed"}});
  }
  return out;
}

json CompletionRun::responses_json() const { return response_object(response_status(), output_items()); }

// The conversation a later previous_response_id continues: this request's, then the answer (its text
// and calls; the thinking is not kept, as the chat path leaves earlier thinking out).
void CompletionRun::store_response() const {
  if (!job_.store_response || !ctx_.responses) return;
  const Choice& c = choices_.front();
  json conversation = job_.conversation;
  json answer{{"role", "assistant"}, {"content", c.parsed.calls.empty() ? c.full_text : c.parsed.content}};
  if (!c.parsed.calls.empty()) answer["tool_calls"] = tool_calls_json(c, false);
  conversation.push_back(std::move(answer));
  ctx_.responses->put(id_, responses_json(), std::move(conversation));
}

// One streamed piece of the reasoning item or the message item; a new item starts when the type changes.
void CompletionRun::item_delta(const std::string& type, const std::string& text) {
  const bool reasoning = type == "reasoning";
  const std::string id = item_id(reasoning ? "rs" : "msg");
  if (type != item_type_) {
    close_item();
    item_type_ = type;
    item_text_.clear();
    json item = reasoning ? json{{"id", id}, {"type", "reasoning"}, {"summary", json::array()}, {"content", json::array()}}
                          : json{{"id", id}, {"type", "message"}, {"status", "in_progress"}, {"role", "assistant"},
                                 {"content", json::array()}};
    send_response_event({{"type", "response.output_item.added"}, {"output_index", ++item_}, {"item", item}});
    json part = reasoning ? json{{"type", "reasoning_text"}, {"text", ""}}
                          : json{{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}};
    send_response_event({{"type", "response.content_part.added"}, {"item_id", id}, {"output_index", item_},
                         {"content_index", 0}, {"part", part}});
  }
  item_text_ += text;
  json ev{{"type", reasoning ? "response.reasoning_text.delta" : "response.output_text.delta"}, {"item_id", id},
          {"output_index", item_}, {"content_index", 0}, {"delta", text}};
  if (!reasoning) ev["logprobs"] = json::array();
  send_response_event(std::move(ev));
}

void CompletionRun::close_item() {
  if (item_type_.empty()) return;
  const bool reasoning = item_type_ == "reasoning";
  const std::string id = item_id(reasoning ? "rs" : "msg");
  json done{{"type", reasoning ? "response.reasoning_text.done" : "response.output_text.done"}, {"item_id", id},
            {"output_index", item_}, {"content_index", 0}, {"text", item_text_}};
  if (!reasoning) done["logprobs"] = json::array();
  send_response_event(std::move(done));
  json part = reasoning ? json{{"type", "reasoning_text"}, {"text", item_text_}}
                        : json{{"type", "output_text"}, {"text", item_text_}, {"annotations", json::array()}};
  send_response_event({{"type", "response.content_part.done"}, {"item_id", id}, {"output_index", item_},
                       {"content_index", 0}, {"part", part}});
  json item = reasoning ? json{{"id", id}, {"type", "reasoning"}, {"summary", json::array()}, {"content", json::array({part})}}
                        : json{{"id", id}, {"type", "message"}, {"status", "completed"}, {"role", "assistant"},
                               {"content", json::array({part})}};
  send_response_event({{"type", "response.output_item.done"}, {"output_index", item_}, {"item", item}});
  item_type_.clear();
}

void CompletionRun::stream_responses_event(const std::string& delta, size_t index) {
  Choice& c = choices_[index];
  if (!response_started_) {
    response_started_ = true;
    const json r = response_object("in_progress", json::array());
    send_response_event({{"type", "response.created"}, {"response", r}});
    send_response_event({{"type", "response.in_progress"}, {"response", r}});
  }
  if (!c.reasoning_delta.empty()) item_delta("reasoning", c.reasoning_delta);
  const std::string text = job_.parse_tool_calls ? tool_text_delta(c) : delta;
  if (!text.empty()) item_delta("message", text);
  if (!c.done) return;
  close_item();
  for (size_t k = 0; k < c.parsed.calls.size(); ++k) {  // each call whole: its arguments as one delta
    const ToolCall& call = c.parsed.calls[k];
    const std::string id = item_id("fc") + "_" + std::to_string(k);
    json item{{"id", id}, {"type", "function_call"}, {"call_id", call.id}, {"name", call.name}, {"arguments", ""},
              {"status", "in_progress"}};
    send_response_event({{"type", "response.output_item.added"}, {"output_index", ++item_}, {"item", item}});
    send_response_event({{"type", "response.function_call_arguments.delta"}, {"item_id", id}, {"output_index", item_},
                         {"delta", call.arguments}});
    send_response_event({{"type", "response.function_call_arguments.done"}, {"item_id", id}, {"output_index", item_},
                         {"name", call.name}, {"arguments", call.arguments}});
    item["arguments"] = call.arguments;
    item["status"] = "completed";
    send_response_event({{"type", "response.output_item.done"}, {"output_index", item_}, {"item", item}});
  }
}

void CompletionRun::finish_responses_stream() {
  close_item();  // a client gone or a timeout can end the run with an item open
  const std::string status = response_status();
  send_response_event({{"type", status == "incomplete" ? "response.incomplete" : "response.completed"},
                       {"response", responses_json()}});
}

}  // namespace serval
