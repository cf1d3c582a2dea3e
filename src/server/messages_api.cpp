#include "server/messages_api.h"

#include <fmt/core.h>

#include <algorithm>
#include <set>
#include <string>

namespace serval {

namespace {

bool is_string(const json& b, const char* key) { return b.contains(key) && b[key].is_string(); }

// A text block's text; anything but {"type": "text", "text": "..."} is refused with `what`.
std::string block_text(const json& block, const char* what) {
  if (!block.is_object() || block.value("type", json()) != "text" || !is_string(block, "text"))
    bad_request(fmt::format("{} must be a string or a list of text blocks", what));
  return block["text"].get<std::string>();
}

// A string, or a list of text blocks joined by newlines (system prompts, tool results).
std::string text_of(const json& v, const char* what) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) bad_request(fmt::format("{} must be a string or a list of text blocks", what));
  std::string out;
  for (const json& block : v) out += (out.empty() ? "" : "\n") + block_text(block, what);
  return out;
}

// One turn's content blocks, sorted into what the chat messages need.
struct Turn {
  std::string text;
  json tool_calls = json::array();  // assistant: tool_use blocks as OpenAI tool calls
  json tool_results = json::array();  // user: tool_result blocks as "tool" messages
};

void add_tool_use(const json& block, Turn& turn, std::set<std::string>& ids) {
  if (!is_string(block, "id") || !is_string(block, "name") || !block.contains("input") || !block["input"].is_object())
    bad_request("a tool_use block needs a string 'id' and 'name' and an object 'input'");
  ids.insert(block["id"].get<std::string>());
  turn.tool_calls.push_back({{"id", block["id"]}, {"type", "function"},
                             {"function", {{"name", block["name"]}, {"arguments", dump(block["input"])}}}});
}

void add_tool_result(const json& block, Turn& turn, const std::set<std::string>& ids) {
  if (!is_string(block, "tool_use_id")) bad_request("a tool_result block needs a string 'tool_use_id'");
  const std::string id = block["tool_use_id"].get<std::string>();
  if (!ids.count(id)) bad_request(fmt::format("tool_result for '{}', which no earlier tool_use block has", id));
  if (block.contains("is_error") && !block["is_error"].is_boolean()) bad_request("'is_error' must be a boolean");
  std::string content = block.contains("content") ? text_of(block["content"], "a tool_result's content") : "";
  if (block.value("is_error", false)) content = "Error: " + content;
  turn.tool_results.push_back({{"role", "tool"}, {"tool_call_id", id}, {"content", content}});
}

// The content blocks of one message. Thinking blocks of earlier turns are left out of the prompt (as
// Anthropic's API leaves them out of the context); images and documents are refused.
Turn read_turn(const json& content, bool assistant, std::set<std::string>& ids) {
  Turn turn;
  if (content.is_string()) {
    turn.text = content.get<std::string>();
    return turn;
  }
  if (!content.is_array()) bad_request("a message's 'content' must be a string or a list of content blocks");
  for (const json& block : content) {
    const json type = block.is_object() ? block.value("type", json()) : json();
    if (type == "text") turn.text += (turn.text.empty() ? "" : "\n") + block_text(block, "a text block");
    else if (type == "tool_use" && assistant) add_tool_use(block, turn, ids);
    else if (type == "tool_result" && !assistant) add_tool_result(block, turn, ids);
    else if ((type == "thinking" || type == "redacted_thinking") && assistant) continue;
    else
      bad_request(fmt::format("a {} message cannot hold a '{}' block (this server takes text, tool_use in assistant "
                              "turns, tool_result in user turns, and thinking)",
                              assistant ? "assistant" : "user", type.is_string() ? type.get<std::string>() : "?"));
  }
  return turn;
}

json chat_messages(const json& body) {
  json out = json::array();
  if (body.contains("system") && !body["system"].is_null())
    out.push_back({{"role", "system"}, {"content", text_of(body["system"], "'system'")}});
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    bad_request("'messages' must be a non-empty list");
  std::set<std::string> tool_use_ids;
  for (const json& m : body["messages"]) {
    if (!m.is_object() || !m.contains("content") || (m.value("role", json()) != "user" && m.value("role", json()) != "assistant"))
      bad_request("each message needs a 'role' (user or assistant) and a 'content'");
    const bool assistant = m["role"] == "assistant";
    if (assistant && &m == &body["messages"].back())
      bad_request("a final assistant message (a prefill to continue) is not supported; end with a user message");
    Turn turn = read_turn(m["content"], assistant, tool_use_ids);
    for (json& r : turn.tool_results) out.push_back(std::move(r));  // the results answer the last turn's calls
    if (assistant) {
      json msg{{"role", "assistant"}, {"content", turn.text}};
      if (!turn.tool_calls.empty()) msg["tool_calls"] = std::move(turn.tool_calls);
      out.push_back(std::move(msg));
    } else if (!turn.text.empty() || turn.tool_results.empty()) {
      out.push_back({{"role", "user"}, {"content", turn.text}});
    }
  }
  return out;
}

// Anthropic's tools ({"name", "description", "input_schema"}) as OpenAI's function tools. Anthropic's
// own server tools (web search, code execution, ...) are refused.
json chat_tools(const json& tools) {
  if (!tools.is_array()) bad_request("'tools' must be a list");
  json out = json::array();
  for (const json& t : tools) {
    if (!t.is_object() || !is_string(t, "name")) bad_request("each tool needs a string 'name'");
    if (t.contains("type") && !t["type"].is_null() && t["type"] != "custom")
      bad_request(fmt::format("tool type '{}' is not supported (this server runs custom tools only)", dump(t["type"])));
    json fn{{"name", t["name"]}, {"parameters", t.value("input_schema", json::object())}};
    if (t.contains("description")) fn["description"] = t["description"];
    out.push_back({{"type", "function"}, {"function", fn}});
  }
  return out;
}

// {"type": "auto" | "any" | "tool" | "none", "name"} as OpenAI's tool_choice.
json chat_tool_choice(const json& c) {
  const json type = c.is_object() ? c.value("type", json()) : json();
  if (type == "auto") return "auto";
  if (type == "any") return "required";
  if (type == "none") return "none";
  if (type == "tool" && is_string(c, "name")) return json{{"type", "function"}, {"function", {{"name", c["name"]}}}};
  bad_request("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
              "{\"type\": \"tool\", \"name\": ...}");
}

// {"type": "enabled", "budget_tokens": N} / "adaptive" / "disabled": the chat template's enable_thinking.
// The budget is checked as Anthropic checks it (at least 1024, below max_tokens); max_tokens bounds the
// thinking and the answer together.
json thinking_kwargs(const json& t, const json& body) {
  const json type = t.is_object() ? t.value("type", json()) : json();
  if (type == "disabled") return {{"enable_thinking", false}};
  if (type == "adaptive") return {{"enable_thinking", true}};  // the model decides how long it thinks
  if (type != "enabled" || !t.contains("budget_tokens") || !t["budget_tokens"].is_number_integer())
    bad_request("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} or "
                "{\"type\": \"disabled\"}");
  const int64_t budget = t["budget_tokens"].get<int64_t>();
  const json& max = body.contains("max_tokens") ? body["max_tokens"] : json();
  if (budget < 1024 || (max.is_number_integer() && budget >= max.get<int64_t>()))
    bad_request("'thinking.budget_tokens' must be at least 1024 and less than max_tokens");
  return {{"enable_thinking", true}};
}

void copy_sampling(const json& b, json& chat) {
  for (const char* key : {"temperature", "top_p", "top_k", "max_tokens", "stream"})
    if (b.contains(key)) chat[key] = b[key];
  if (b.contains("stop_sequences") && !b["stop_sequences"].is_null()) {
    const json& s = b["stop_sequences"];
    if (!s.is_array() || s.size() > 16 || !std::all_of(s.begin(), s.end(), [](const json& x) { return x.is_string(); }))
      bad_request("'stop_sequences' must be a list of at most 16 strings");
    chat["stop"] = s;
  }
}

void copy_metadata(const json& b, json& chat) {
  if (!b.contains("metadata") || b["metadata"].is_null()) return;
  const json& m = b["metadata"];
  if (!m.is_object() || m.size() > 1 || (m.contains("user_id") && !m["user_id"].is_string() && !m["user_id"].is_null()))
    bad_request("'metadata' takes only 'user_id' (a string)");
  if (m.contains("user_id") && m["user_id"].is_string()) chat["user"] = m["user_id"];
}

// output_config: `format` (a JSON schema the output must follow) becomes response_format, enforced by the
// grammar engine; `effort` becomes reasoning_effort for the chat template (xhigh and max as high).
void copy_output_config(const json& b, json& chat) {
  if (!b.contains("output_config") || b["output_config"].is_null()) return;
  const json& oc = b["output_config"];
  if (!oc.is_object()) bad_request("'output_config' must be an object");
  for (const auto& [key, value] : oc.items())
    if (key != "format" && key != "effort") bad_request(fmt::format("unknown field 'output_config.{}'", key));
  if (oc.contains("format") && !oc["format"].is_null()) {
    const json& f = oc["format"];
    if (!f.is_object() || f.value("type", json()) != "json_schema" || !f.contains("schema") || !f["schema"].is_object())
      bad_request("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}");
    chat["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "output"}, {"schema", f["schema"]}}}};
  }
  if (oc.contains("effort") && !oc["effort"].is_null()) {
    static const json kEfforts = {"low", "medium", "high", "xhigh", "max"};
    const json& e = oc["effort"];
    if (std::find(kEfforts.begin(), kEfforts.end(), e) == kEfforts.end())
      bad_request("'output_config.effort' must be one of low, medium, high, xhigh, max");
    chat["reasoning_effort"] = e == "xhigh" || e == "max" ? json("high") : e;
  }
}

// cache_control (top level or on blocks) is accepted: the prefix cache is automatic.
constexpr const char* kMessagesFields[] = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
                                   "stop_sequences", "stream", "tools", "tool_choice", "metadata", "thinking",
                                   "service_tier", "output_config", "cache_control"};

void check_messages_fields(const json& b, bool count_only) {
  for (const auto& [key, value] : b.items())
    if (std::find(std::begin(kMessagesFields), std::end(kMessagesFields), key) == std::end(kMessagesFields))
      bad_request(fmt::format("unknown field '{}' for /v1/messages", key), key);
  if (b.contains("service_tier") && b["service_tier"] != "auto" && b["service_tier"] != "standard_only")
    bad_request("'service_tier' must be 'auto' or 'standard_only' (this server has one tier)", "service_tier");
  if (!count_only && (!b.contains("max_tokens") || !b["max_tokens"].is_number_integer()))
    bad_request("'max_tokens' is required (an integer)", "max_tokens");
}

}  // namespace

json messages_to_chat(const json& b, bool count_only) {
  check_messages_fields(b, count_only);
  json chat{{"messages", chat_messages(b)}};
  if (b.contains("model")) chat["model"] = b["model"];
  copy_sampling(b, chat);
  copy_metadata(b, chat);
  copy_output_config(b, chat);
  if (b.contains("tools") && !b["tools"].is_null()) chat["tools"] = chat_tools(b["tools"]);
  if (b.contains("tool_choice") && !b["tool_choice"].is_null()) {
    chat["tool_choice"] = chat_tool_choice(b["tool_choice"]);
    const json parallel = b["tool_choice"].value("disable_parallel_tool_use", json());
    if (!parallel.is_null() && !parallel.is_boolean()) bad_request("'disable_parallel_tool_use' must be a boolean");
    if (parallel == true) chat["parallel_tool_calls"] = false;
  }
  if (b.contains("thinking") && !b["thinking"].is_null()) chat["chat_template_kwargs"] = thinking_kwargs(b["thinking"], b);
  if (count_only) {
    chat.erase("max_tokens");
    chat.erase("stream");
  }
  return chat;
}

json anthropic_error_json(const ApiError& e) {
  const char* type = e.status == 401   ? "authentication_error"
                     : e.status == 403 ? "permission_error"
                     : e.status == 404 ? "not_found_error"
                     : e.status == 413 ? "request_too_large"
                     : e.status == 429 ? "rate_limit_error"
                     : e.status == 503 ? "overloaded_error"
                     : e.status >= 500 ? "api_error"
                                       : "invalid_request_error";
  return json{{"type", "error"}, {"error", {{"type", type}, {"message", e.message}}}};
}

json anthropic_stop_reason(const std::string& finish_reason, const std::string& stop_string) {
  if (finish_reason == "stop") return stop_string.empty() ? "end_turn" : "stop_sequence";
  if (finish_reason == "length") return "max_tokens";
  if (finish_reason == "tool_calls") return "tool_use";
  return nullptr;
}

}  // namespace serval
