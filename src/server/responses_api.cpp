#include "server/responses_api.h"

#include <fmt/core.h>

#include <algorithm>
#include <set>
#include <utility>

namespace serval {

ResponseStore::ResponseStore(size_t capacity, size_t max_bytes) : capacity_(capacity), max_bytes_(max_bytes) {}

void ResponseStore::put(const std::string& id, json response, json conversation) {
  const size_t size = dump(response).size() + dump(conversation).size();
  std::lock_guard<std::mutex> lock(mu_);
  if (capacity_ == 0 || size > max_bytes_) return;
  while (!order_.empty() && (order_.size() >= capacity_ || bytes_ + size > max_bytes_)) {
    bytes_ -= items_.at(order_.front()).second;
    items_.erase(order_.front());
    order_.pop_front();
  }
  items_[id] = {Entry{std::move(response), std::move(conversation)}, size};
  order_.push_back(id);
  bytes_ += size;
}

std::optional<ResponseStore::Entry> ResponseStore::get(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = items_.find(id);
  if (it == items_.end()) return std::nullopt;
  return it->second.first;
}

namespace responses_impl {

[[noreturn]] void refuse(const std::string& message, const char* param) { bad_request(message, param); }

bool has_string(const json& j, const char* key) { return j.is_object() && j.contains(key) && j[key].is_string(); }

// A message item's content: a string, or parts input_text / output_text (joined by newlines).
std::string message_text(const json& content) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) refuse("a message's 'content' must be a string or a list of text parts", "input");
  std::string out;
  for (const json& part : content) {
    const json type = part.is_object() ? part.value("type", json()) : json();
    if ((type != "input_text" && type != "output_text") || !has_string(part, "text"))
      refuse("this server takes text content parts only (input_text, output_text)", "input");
    out += (out.empty() ? "" : "\n") + part["text"].get<std::string>();
  }
  return out;
}

// The conversation being built: chat messages, and the call ids a function_call_output may answer.
struct Conversation {
  json messages = json::array();
  std::set<std::string> call_ids;
};

void add_message(const json& item, Conversation& conv) {
  const json role = item.value("role", json());
  if (role != "user" && role != "assistant" && role != "system" && role != "developer")
    refuse("a message item's 'role' must be user, assistant, system or developer", "input");
  if (!item.contains("content")) refuse("a message item needs 'content'", "input");
  conv.messages.push_back({{"role", role == "developer" ? json("system") : role}, {"content", message_text(item["content"])}});
}

// Consecutive function_call items are one assistant turn with several calls.
void add_function_call(const json& item, Conversation& conv) {
  if (!has_string(item, "call_id") || !has_string(item, "name") || !has_string(item, "arguments"))
    refuse("a function_call item needs string 'call_id', 'name' and 'arguments'", "input");
  json call{{"id", item["call_id"]}, {"type", "function"}, {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}};
  conv.call_ids.insert(item["call_id"].get<std::string>());
  if (!conv.messages.empty() && conv.messages.back()["role"] == "assistant" && conv.messages.back().contains("tool_calls"))
    conv.messages.back()["tool_calls"].push_back(std::move(call));
  else
    conv.messages.push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array({call})}});
}

void add_function_output(const json& item, Conversation& conv) {
  if (!has_string(item, "call_id") || !item.contains("output"))
    refuse("a function_call_output item needs a string 'call_id' and an 'output'", "input");
  const std::string id = item["call_id"].get<std::string>();
  if (!conv.call_ids.count(id))
    refuse(fmt::format("function_call_output for call '{}', which no function_call before it made", id), "input");
  const json& out = item["output"];
  conv.messages.push_back({{"role", "tool"}, {"tool_call_id", id},
                           {"content", out.is_string() ? out.get<std::string>() : message_text(out)}});
}

// An input item by its type (a message when it has a role and no type). Reasoning items are left out
// of the prompt, as the chat path leaves out earlier thinking.
void add_item(const json& item, Conversation& conv) {
  if (!item.is_object()) refuse("each input item must be an object", "input");
  const json type = item.value("type", json());
  if (type == "message" || (type.is_null() && item.contains("role"))) add_message(item, conv);
  else if (type == "function_call") add_function_call(item, conv);
  else if (type == "function_call_output") add_function_output(item, conv);
  else if (type == "reasoning") return;
  else refuse(fmt::format("input items of type {} are not supported (message, function_call, function_call_output, "
                          "reasoning)", dump(type)), "input");
}

// The stored conversation of previous_response_id, then this request's input.
Conversation conversation(const json& b, const ResponseStore& store) {
  Conversation conv;
  if (b.contains("previous_response_id") && !b["previous_response_id"].is_null()) {
    if (!b["previous_response_id"].is_string()) refuse("'previous_response_id' must be a string", "previous_response_id");
    const std::string id = b["previous_response_id"].get<std::string>();
    const auto prev = store.get(id);
    if (!prev)
      refuse(fmt::format("previous response '{}' is not stored (the store keeps the newest {}; responses made with "
                         "store: false are not kept)", id, store.capacity()), "previous_response_id");
    conv.messages = prev->conversation;
    for (const json& m : conv.messages)
      if (m.contains("tool_calls"))
        for (const json& c : m["tool_calls"]) conv.call_ids.insert(c["id"].get<std::string>());
  }
  if (!b.contains("input")) refuse("'input' is required", "input");
  const json& input = b["input"];
  if (input.is_string()) conv.messages.push_back({{"role", "user"}, {"content", input}});
  else if (input.is_array() && !input.empty()) for (const json& item : input) add_item(item, conv);
  else refuse("'input' must be a string or a non-empty list of items", "input");
  return conv;
}

// Responses' function tools ({"type": "function", "name", "description", "parameters", "strict"}) in
// the chat form; built-in tools (web search, file search, ...) are refused.
json chat_tools(const json& tools) {
  if (!tools.is_array()) refuse("'tools' must be a list", "tools");
  json out = json::array();
  for (const json& t : tools) {
    if (!t.is_object() || t.value("type", json()) != "function" || !has_string(t, "name"))
      refuse("this server runs function tools only ({\"type\": \"function\", \"name\": ...})", "tools");
    json fn{{"name", t["name"]}};
    for (const char* key : {"description", "parameters", "strict"})
      if (t.contains(key) && !t[key].is_null()) fn[key] = t[key];
    out.push_back({{"type", "function"}, {"function", fn}});
  }
  return out;
}

json chat_tool_choice(const json& c) {
  if (c == "auto" || c == "none" || c == "required") return c;
  if (c.is_object() && c.value("type", json()) == "function" && has_string(c, "name"))
    return {{"type", "function"}, {"function", {{"name", c["name"]}}}};
  refuse("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}", "tool_choice");
}

// text.format: text, json_object, or json_schema (name, schema, strict) as chat's response_format.
json chat_response_format(const json& text) {
  if (!text.is_object()) refuse("'text' must be an object", "text");
  for (const auto& [key, value] : text.items())
    if (key != "format" && key != "verbosity") refuse(fmt::format("unknown field 'text.{}'", key), "text");
  if (text.contains("verbosity") && !text["verbosity"].is_null() && text["verbosity"] != "medium")
    refuse("'text.verbosity' other than medium is not supported", "text");
  if (!text.contains("format") || text["format"].is_null()) return nullptr;
  const json& f = text["format"];
  const json type = f.is_object() ? f.value("type", json()) : json();
  if (type == "text" || type == "json_object") return {{"type", type}};
  if (type != "json_schema" || !f.contains("schema"))
    refuse("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
           "\"name\", \"schema\"}", "text");
  json schema{{"name", f.value("name", json("output"))}, {"schema", f["schema"]}};
  if (f.contains("strict")) schema["strict"] = f["strict"];
  return {{"type", "json_schema"}, {"json_schema", schema}};
}

// reasoning {"effort", "summary"}: effort reaches the chat template; no summaries are written, so only
// summary "auto" (the model's choice) is taken.
void reasoning_from(const json& r, json& chat) {
  if (!r.is_object()) refuse("'reasoning' must be an object", "reasoning");
  for (const auto& [key, value] : r.items()) {
    if (key == "effort" && !value.is_null()) chat["reasoning_effort"] = value;
    else if (key == "summary" && !value.is_null() && value != "auto")
      refuse("'reasoning.summary' other than auto is not supported (this server writes no summaries)", "reasoning");
    else if (key != "effort" && key != "summary" && key != "generate_summary")
      refuse(fmt::format("unknown field 'reasoning.{}'", key), "reasoning");
  }
}

constexpr const char* kResponsesFields[] = {
    "model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature", "top_p",
    "stream", "store", "previous_response_id", "metadata", "parallel_tool_calls", "reasoning", "user", "truncation"};

void check_responses_fields(const json& b) {
  for (const auto& [key, value] : b.items())
    if (std::find(std::begin(kResponsesFields), std::end(kResponsesFields), key) == std::end(kResponsesFields))
      refuse(fmt::format("unknown field '{}' for /v1/responses", key), key.c_str());
  if (b.contains("truncation") && !b["truncation"].is_null() && b["truncation"] != "disabled")
    refuse("'truncation' must be 'disabled' (a prompt over the context is refused, never cut)", "truncation");
  if (b.contains("store") && !b["store"].is_null() && !b["store"].is_boolean()) refuse("'store' must be a boolean", "store");
  if (b.contains("instructions") && !b["instructions"].is_null() && !b["instructions"].is_string())
    refuse("'instructions' must be a string", "instructions");
}

// The settings a response object repeats, with Responses' defaults.
json echo_of(const json& b) {
  auto get = [&](const char* key, json fallback) { return b.contains(key) && !b[key].is_null() ? b[key] : fallback; };
  return json{{"instructions", get("instructions", nullptr)},
              {"max_output_tokens", get("max_output_tokens", nullptr)},
              {"metadata", get("metadata", json::object())},
              {"parallel_tool_calls", get("parallel_tool_calls", true)},
              {"previous_response_id", get("previous_response_id", nullptr)},
              {"reasoning", get("reasoning", json{{"effort", nullptr}, {"summary", nullptr}})},
              {"store", get("store", true)},
              {"temperature", get("temperature", 1.0)},
              {"text", get("text", json{{"format", {{"type", "text"}}}})},
              {"tool_choice", get("tool_choice", "auto")},
              {"tools", get("tools", json::array())},
              {"top_p", get("top_p", 1.0)},
              {"truncation", "disabled"},
              {"user", get("user", nullptr)}};
}

}  // namespace responses_impl

ResponsesJob responses_to_chat(const json& b, const ResponseStore& store) {
  namespace ri = responses_impl;
  ri::check_responses_fields(b);
  ResponsesJob job;
  job.conversation = ri::conversation(b, store).messages;
  json messages = json::array();
  if (b.contains("instructions") && b["instructions"].is_string())
    messages.push_back({{"role", "system"}, {"content", b["instructions"]}});
  for (const json& m : job.conversation) messages.push_back(m);
  job.chat = json{{"messages", std::move(messages)}};
  static constexpr std::pair<const char*, const char*> kSameMeaning[] = {
      {"model", "model"}, {"max_output_tokens", "max_tokens"}, {"temperature", "temperature"}, {"top_p", "top_p"},
      {"stream", "stream"}, {"metadata", "metadata"}, {"parallel_tool_calls", "parallel_tool_calls"}, {"user", "user"}};
  for (const auto& [from, to] : kSameMeaning)
    if (b.contains(from) && !b[from].is_null()) job.chat[to] = b[from];
  if (b.contains("tools") && !b["tools"].is_null()) job.chat["tools"] = ri::chat_tools(b["tools"]);
  if (b.contains("tool_choice") && !b["tool_choice"].is_null()) job.chat["tool_choice"] = ri::chat_tool_choice(b["tool_choice"]);
  if (b.contains("text") && !b["text"].is_null())
    if (json f = ri::chat_response_format(b["text"]); !f.is_null()) job.chat["response_format"] = std::move(f);
  if (b.contains("reasoning") && !b["reasoning"].is_null()) ri::reasoning_from(b["reasoning"], job.chat);
  job.store = !b.contains("store") || b["store"].is_null() || b["store"].get<bool>();
  job.echo = ri::echo_of(b);
  return job;
}

}  // namespace serval
