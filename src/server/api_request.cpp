#include "server/api_request.h"
#include "server/structured_output.h"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <stdexcept>

#include "base/error.h"
#include "server/jinja.h"
#include "tokenizer/tokenizer.h"

namespace serval {

void bad_request(std::string message, std::string param) {
  throw ApiError{400, std::move(message), "invalid_request_error", std::move(param), ""};
}

json error_json(const ApiError& e) {
  json err{{"message", e.message}, {"type", e.type}, {"param", e.param.empty() ? json(nullptr) : json(e.param)},
           {"code", e.code.empty() ? json(e.status) : json(e.code)}};
  return json{{"error", err}, {"object", "error"}, {"message", e.message}, {"code", e.status}};
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

namespace {

// Typed optional field access with OpenAI-style errors.
template <typename T>
std::optional<T> field(const json& body, const char* name);

template <>
std::optional<double> field<double>(const json& b, const char* n) {
  if (!b.contains(n) || b[n].is_null()) return std::nullopt;
  if (!b[n].is_number()) bad_request(fmt::format("'{}' must be a number", n), n);
  const double v = b[n].get<double>();
  if (!std::isfinite(v)) bad_request(fmt::format("'{}' must be finite", n), n);
  return v;
}
template <>
std::optional<int64_t> field<int64_t>(const json& b, const char* n) {
  if (!b.contains(n) || b[n].is_null()) return std::nullopt;
  if (b[n].is_number_float() && b[n].get<double>() == std::floor(b[n].get<double>()) && std::abs(b[n].get<double>()) < 1e15)
    return int64_t(b[n].get<double>());
  if (b[n].is_number_unsigned() && b[n].get<uint64_t>() > uint64_t(INT64_MAX))
    bad_request(fmt::format("'{}' is too large", n), n);
  if (!b[n].is_number_integer()) bad_request(fmt::format("'{}' must be an integer", n), n);
  return b[n].get<int64_t>();
}
template <>
std::optional<bool> field<bool>(const json& b, const char* n) {
  if (!b.contains(n) || b[n].is_null()) return std::nullopt;
  if (!b[n].is_boolean()) bad_request(fmt::format("'{}' must be a boolean", n), n);
  return b[n].get<bool>();
}

void check_messages(const json& body) {
  if (!body.contains("messages") || !body["messages"].is_array()) bad_request("'messages' must be an array", "messages");
  const json& messages = body["messages"];
  if (messages.empty()) bad_request("'messages' must not be empty", "messages");
  for (const auto& m : messages) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      bad_request("each message needs a string 'role'", "messages");
    if (m.contains("content") && !m["content"].is_string() && !m["content"].is_array() && !m["content"].is_null())
      bad_request("a message's 'content' must be a string or a list of parts", "messages");
  }
}

// The request's own template, when the server trusts request templates.
std::unique_ptr<jinja::Template> request_template(const json& body, const ApiContext& ctx) {
  if (!body.contains("chat_template") || body["chat_template"].is_null()) return nullptr;
  if (!ctx.trust_request_chat_template)
    bad_request("a chat template in the request is not accepted by this server (start it with "
                "--trust-request-chat-template to allow it)", "chat_template");
  if (!body["chat_template"].is_string()) bad_request("'chat_template' must be a string", "chat_template");
  try {
    return std::make_unique<jinja::Template>(body["chat_template"].get<std::string>());
  } catch (const Error& e) {
    bad_request(std::string("unsupported chat template: ") + e.what(), "chat_template");
  }
}

std::vector<int32_t> checked_token_ids(const json& ids, const Tokenizer& tok, const char* param) {
  std::vector<int32_t> out;
  out.reserve(ids.size());
  for (const auto& t : ids) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tok.n_vocab())
      bad_request(fmt::format("'{}' must be token ids inside the vocabulary", param), param);
    out.push_back(t.get<int32_t>());
  }
  return out;
}

std::vector<int32_t> completion_prompt(const json& b, const Tokenizer& tok) {
  if (!b.contains("prompt")) bad_request("'prompt' is required", "prompt");
  const json& p = b["prompt"];
  std::vector<int32_t> prompt;
  if (p.is_string()) {
    if (p.get<std::string>().empty()) bad_request("'prompt' must not be empty", "prompt");
    prompt = tok.encode(p.get<std::string>(), true, true);
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    prompt = checked_token_ids(p, tok, "prompt");
  } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
    prompt = tok.encode(p[0].get<std::string>(), true, true);
  } else {
    bad_request("'prompt' must be a string, a list of one string, or a list of token ids", "prompt");
  }
  if (prompt.empty()) bad_request("'prompt' must not be empty", "prompt");
  return prompt;
}

// The text a prompt stands for (echo): the string as sent, or the decoded token ids.
std::string prompt_text(const json& b, const std::vector<int32_t>& ids, const Tokenizer& tok) {
  const json& p = b["prompt"];
  if (p.is_string()) return p.get<std::string>();
  if (p.is_array() && p.size() == 1 && p[0].is_string()) return p[0].get<std::string>();
  return tok.decode(ids, true);
}

// Fill in the middle: `suffix` comes after the completion. The prompt becomes the model's FIM form
// (<|fim_prefix|> prompt <|fim_suffix|> suffix <|fim_middle|>, the Qwen2.5-Coder and StarCoder
// tokens), so what the model writes is the middle.
void fill_in_the_middle(const json& b, const Tokenizer& tok, std::vector<int32_t>& prompt) {
  if (!b.contains("suffix") || b["suffix"].is_null()) return;
  if (!b["suffix"].is_string()) bad_request("'suffix' must be a string", "suffix");
  const auto token = [&](const char* a, const char* c) { return tok.find(a) >= 0 ? tok.find(a) : tok.find(c); };
  const int32_t pre = token("<|fim_prefix|>", "<fim_prefix>"), suf = token("<|fim_suffix|>", "<fim_suffix>"),
                mid = token("<|fim_middle|>", "<fim_middle>");
  if (pre < 0 || suf < 0 || mid < 0)
    bad_request("'suffix' needs a model with fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                "<|fim_middle|>); this one has none", "suffix");
  std::vector<int32_t> out{pre};
  out.insert(out.end(), prompt.begin(), prompt.end());
  out.push_back(suf);
  const std::vector<int32_t> s = tok.encode(b["suffix"].get<std::string>(), false, false);
  out.insert(out.end(), s.begin(), s.end());
  out.push_back(mid);
  prompt = std::move(out);
}

void echo_from(const json& b, const Tokenizer& tok, GenJob& job) {
  if (!field<bool>(b, "echo").value_or(false)) return;
  job.echo_text = prompt_text(b, job.prompt, tok);
  if (job.logprobs < 0) return;
  // The prompt's tokens get log-probabilities too; with a suffix they would be the fill-in-the-middle
  // prompt's, not the echoed text's.
  if (b.contains("suffix") && !b["suffix"].is_null())
    bad_request("'echo' with 'logprobs' and 'suffix' is not supported (the prompt becomes a fill-in-the-middle one)",
                "echo");
  job.params.prompt_logprobs = job.logprobs;
}

void logit_bias_from(const json& b, SamplingParams& s) {
  if (!b.contains("logit_bias") || b["logit_bias"].is_null()) return;
  if (!b["logit_bias"].is_object()) bad_request("'logit_bias' must be an object of token id to bias", "logit_bias");
  for (auto& [k, v] : b["logit_bias"].items()) {
    int32_t id;
    try {
      size_t used = 0;
      id = std::stoi(k, &used);
      if (used != k.size()) throw std::invalid_argument(k);
    } catch (const std::exception&) {
      bad_request("'logit_bias' keys must be token ids", "logit_bias");
    }
    if (!v.is_number() || !std::isfinite(v.get<double>())) bad_request("'logit_bias' values must be numbers", "logit_bias");
    s.logit_bias.emplace_back(id, std::clamp(v.get<float>(), -100.0f, 100.0f));
  }
}

void sampling_from(const json& b, GenJob& job, const ApiContext& ctx) {
  SamplingParams& s = job.params.sampling;
  s.temperature = float(field<double>(b, "temperature").value_or(1.0));
  s.top_p = float(field<double>(b, "top_p").value_or(1.0));
  const int64_t top_k = field<int64_t>(b, "top_k").value_or(0);
  s.top_k = top_k < 0 ? 0 : int32_t(std::min<int64_t>(top_k, 1 << 30));
  s.min_p = float(field<double>(b, "min_p").value_or(0.0));
  s.presence_penalty = float(field<double>(b, "presence_penalty").value_or(0.0));
  s.frequency_penalty = float(field<double>(b, "frequency_penalty").value_or(0.0));
  s.repeat_penalty = float(field<double>(b, "repetition_penalty").value_or(1.0));
  s.repeat_last_n = -1;
  if (auto seed = field<int64_t>(b, "seed")) s.seed = uint64_t(*seed);
  else s.seed = std::random_device{}() * 0x9E3779B97F4A7C15ull ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  logit_bias_from(b, s);
  if (job.logprobs > 0) s.n_logprobs = job.logprobs;
  s.compute_logprob = job.logprobs >= 0;  // a full-vocabulary log-sum-exp per token only when asked for
  try {
    s.validate(ctx.tokenizer->n_vocab());
  } catch (const Error& e) {
    bad_request(e.what());
  }
}

void logprobs_from(const json& b, bool chat, GenJob& job) {
  if (!b.contains("logprobs") || b["logprobs"].is_null()) return;
  int64_t n = -1;
  if (chat) {
    if (field<bool>(b, "logprobs").value_or(false)) n = field<int64_t>(b, "top_logprobs").value_or(0);
  } else {
    n = field<int64_t>(b, "logprobs").value_or(0);
  }
  if (n > 20) bad_request("logprobs can be at most 20", chat ? "top_logprobs" : "logprobs");
  if (n < -1 || (chat && n < 0 && field<bool>(b, "logprobs").value_or(false)))
    bad_request("logprobs must not be negative", "logprobs");
  job.logprobs = int(n);
}

void lengths_from(const json& b, bool chat, GenJob& job, const ApiContext& ctx) {
  const int64_t limit = ctx.max_model_len;
  const int64_t n_prompt = int64_t(job.prompt.size());
  if (n_prompt >= limit)
    bad_request(fmt::format("This model's maximum context length is {} tokens. However, your prompt has {} tokens.",
                            limit, n_prompt), chat ? "messages" : "prompt");
  auto mt = field<int64_t>(b, "max_completion_tokens");
  if (!mt) mt = field<int64_t>(b, "max_tokens");
  const int64_t max_tokens = mt.value_or(chat ? limit - n_prompt : 16);
  if (max_tokens < 1) bad_request(fmt::format("max_tokens must be at least 1, got {}", max_tokens), "max_tokens");
  if (max_tokens > limit - n_prompt)
    bad_request(fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens ({} in "
                            "the prompt, {} in the completion). Please reduce the prompt or max_tokens.",
                            limit, n_prompt + max_tokens, n_prompt, max_tokens), "max_tokens");
  job.params.max_tokens = int32_t(max_tokens);
}

void stops_from(const json& b, GenJob& job, int32_t n_vocab) {
  if (b.contains("stop") && !b["stop"].is_null()) {
    const json& s = b["stop"];
    if (s.is_string()) job.stops.push_back(s.get<std::string>());
    else if (s.is_array() && s.size() <= 16 && std::all_of(s.begin(), s.end(), [](auto& x) { return x.is_string(); }))
      for (auto& x : s) job.stops.push_back(x.get<std::string>());
    else bad_request("'stop' must be a string or a list of at most 16 strings", "stop");
    job.stops.erase(std::remove(job.stops.begin(), job.stops.end(), ""), job.stops.end());
  }
  if (b.contains("stop_token_ids") && !b["stop_token_ids"].is_null()) {
    const json& ids = b["stop_token_ids"];
    if (!ids.is_array() || ids.size() > 64 ||
        !std::all_of(ids.begin(), ids.end(), [](auto& t) { return t.is_number_integer(); }))
      bad_request("'stop_token_ids' must be a list of at most 64 token ids", "stop_token_ids");
    for (auto& t : ids) {
      const int64_t id = t.get<int64_t>();
      if (id < 0 || id >= n_vocab)
        bad_request(fmt::format("stop token id {} is outside the vocabulary (0..{})", id, n_vocab - 1), "stop_token_ids");
      job.params.stop_token_ids.push_back(int32_t(id));
    }
  }
}

// ---- the fields a request may carry ------------------------------------------------------------------
// Every field of OpenAI's completions and chat completions APIs, and the extensions Serval takes from
// vLLM and llama-server, with what becomes of it. A field Serval does not implement is refused with a
// 400 that names it, and so is a field nobody defines: nothing a client sends is silently ignored.

void refuse(const char* name, const std::string& why) { bad_request(fmt::format("'{}' {}", name, why), name); }

// Values used by the parser itself (checked where they are read).
void used(const char*, const json&) {}

void not_supported(const char* name, const json&) { refuse(name, "is not supported by this server"); }

void short_string(const char* name, const json& v) {
  if (!v.is_string() || v.get<std::string>().size() > 512) refuse(name, "must be a string of at most 512 bytes");
}

// OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512.
void metadata(const char* name, const json& v) {
  if (!v.is_object() || v.size() > 16) refuse(name, "must be an object of at most 16 string pairs");
  for (const auto& [k, x] : v.items())
    if (k.size() > 64 || !x.is_string() || x.get<std::string>().size() > 512)
      refuse(name, "keys must be at most 64 characters and values strings of at most 512");
}

void store(const char* name, const json& v) {
  if (!v.is_boolean()) refuse(name, "must be a boolean");
  if (v.get<bool>()) refuse(name, "true is not supported: this server stores no completions");
}

void service_tier(const char* name, const json& v) {
  if (v != "auto" && v != "default") refuse(name, "must be 'auto' or 'default' (this server has one tier)");
}

void boolean(const char* name, const json& v) {
  if (!v.is_boolean()) refuse(name, "must be a boolean");
}

void modalities(const char* name, const json& v) {
  if (v != json::array({"text"})) refuse(name, "must be [\"text\"]: this server generates text only");
}

enum : uint8_t { kCompletions = 1, kChat = 2, kBoth = 3 };
struct FieldRule {
  const char* name;
  uint8_t endpoints;
  void (*check)(const char* name, const json& value);  // throws ApiError for a value refused
};

constexpr FieldRule kFields[] = {
    // OpenAI, both endpoints
    {"model", kBoth, used}, {"frequency_penalty", kBoth, used}, {"logit_bias", kBoth, used},
    {"logprobs", kBoth, used}, {"max_tokens", kBoth, used}, {"n", kBoth, used}, {"presence_penalty", kBoth, used},
    {"seed", kBoth, used}, {"stop", kBoth, used}, {"stream", kBoth, used}, {"stream_options", kBoth, used},
    {"temperature", kBoth, used}, {"top_p", kBoth, used}, {"user", kBoth, short_string},
    // OpenAI, completions
    {"prompt", kCompletions, used}, {"echo", kCompletions, used}, {"suffix", kCompletions, used},
    {"best_of", kCompletions, used},
    // OpenAI, chat completions
    {"messages", kChat, used}, {"max_completion_tokens", kBoth, used}, {"top_logprobs", kChat, used},
    {"tools", kChat, used}, {"tool_choice", kChat, used}, {"parallel_tool_calls", kChat, boolean},
    {"response_format", kBoth, used}, {"metadata", kChat, metadata}, {"store", kChat, store},
    {"service_tier", kChat, service_tier}, {"modalities", kChat, modalities}, {"prompt_cache_key", kChat, short_string},
    {"safety_identifier", kChat, short_string}, {"audio", kChat, not_supported}, {"prediction", kChat, not_supported},
    {"reasoning_effort", kChat, used}, {"verbosity", kChat, not_supported},
    {"web_search_options", kChat, not_supported}, {"functions", kChat, not_supported},
    {"function_call", kChat, not_supported},
    // vLLM's and llama-server's extensions that Serval implements
    {"top_k", kBoth, used}, {"min_p", kBoth, used}, {"repetition_penalty", kBoth, used}, {"ignore_eos", kBoth, used},
    {"stop_token_ids", kBoth, used}, {"priority", kBoth, used}, {"speculative", kBoth, used},
    {"speculative.n_max", kBoth, used}, {"chat_template", kChat, used}, {"add_generation_prompt", kChat, used},
    {"chat_template_kwargs", kChat, used}, {"lora", kBoth, used},
    // Structured output (src/server/structured_output.cpp): vLLM's fields, then llama-server's
    {"structured_outputs", kBoth, used}, {"guided_json", kBoth, used}, {"guided_regex", kBoth, used},
    {"guided_choice", kBoth, used}, {"guided_grammar", kBoth, used}, {"guided_decoding_backend", kBoth, short_string},
    {"guided_whitespace_pattern", kBoth, not_supported}, {"json_schema", kBoth, used}, {"grammar", kBoth, used},
};

void check_fields(const json& b, bool chat) {
  for (const auto& [key, value] : b.items()) {
    const FieldRule* rule = nullptr;
    for (const FieldRule& r : kFields)
      if (key == r.name) rule = &r;
    if (!rule || !(rule->endpoints & (chat ? kChat : kCompletions)))
      bad_request(fmt::format("unknown field '{}' for {}", key, chat ? "/v1/chat/completions" : "/v1/completions"),
                  key);
    if (!value.is_null()) rule->check(rule->name, value);
  }
}

}  // namespace

json parse_json_body(std::string_view text) {
  // Deeply nested values would make every later copy and render recurse that deep: refuse them while
  // parsing, before the tree exists.
  static constexpr int kMaxDepth = 64;
  const json::parser_callback_t limit_depth = [](int depth, json::parse_event_t event, json&) {
    if (depth > kMaxDepth && (event == json::parse_event_t::object_start || event == json::parse_event_t::array_start))
      bad_request(fmt::format("The request body is nested deeper than {} levels", kMaxDepth));
    return true;
  };
  json body;
  try {
    body = json::parse(text.begin(), text.end(), limit_depth);
  } catch (const json::exception& e) {  // parse errors, and numbers out of a double's range
    bad_request(std::string("Invalid JSON body: ") + e.what());
  }
  if (!body.is_object()) bad_request("The request body must be a JSON object");
  return body;
}

void check_model_name(const json& body, const ApiContext& ctx) {
  if (!body.contains("model") || body["model"].is_null()) return;
  if (!body["model"].is_string()) bad_request("'model' must be a string", "model");
  const std::string name = body["model"].get<std::string>();
  const auto adapters = ctx.adapters.get();
  if (name != ctx.model_name && AdapterList::find(*adapters, name) < 0)
    throw ApiError{404, fmt::format("The model '{}' does not exist; this server serves '{}'{}", name, ctx.model_name,
                                    AdapterList::loaded(*adapters) == 0 ? "" : " and its LoRA adapters (see /v1/models)"),
                   "NotFoundError", "model", "model_not_found"};
}

AdapterList::Snapshot AdapterList::get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return list_;
}

void AdapterList::set(std::vector<Adapter> list) {
  auto next = std::make_shared<const std::vector<Adapter>>(std::move(list));
  std::lock_guard<std::mutex> lock(mu_);
  list_ = std::move(next);
}

int32_t AdapterList::find(const std::vector<Adapter>& list, const std::string& name) {
  if (name.empty()) return -1;
  for (size_t i = 0; i < list.size(); ++i)
    if (list[i].name == name) return int32_t(i);
  return -1;
}

size_t AdapterList::loaded(const std::vector<Adapter>& list) {
  return size_t(std::count_if(list.begin(), list.end(), [](const Adapter& a) { return !a.name.empty(); }));
}

// The messages as chat templates expect them: `content` a string. Null content (an assistant turn that
// only called tools) becomes "", and a list of parts the text of its text parts joined by newlines, as
// vLLM does for text-only models; other parts (images, audio) are refused.
// An assistant turn's tool calls carry their arguments as JSON text (OpenAI's shape); templates
// expect objects (Qwen2.5's renders them with tojson), as vLLM gives them.
void arguments_as_objects(json& m) {
  if (!m.contains("tool_calls") || !m["tool_calls"].is_array()) return;
  for (auto& call : m["tool_calls"]) {
    if (!call.is_object() || !call.contains("function") || !call["function"].is_object()) continue;
    json& args = call["function"]["arguments"];
    if (!args.is_string()) continue;
    try {
      json parsed = json::parse(args.get<std::string>());
      if (parsed.is_object()) args = std::move(parsed);
    } catch (const json::exception&) {
    }
  }
}

json template_messages(const json& messages) {
  json out = messages;
  for (auto& m : out) {
    arguments_as_objects(m);
    if (!m.contains("content") || m["content"].is_string()) continue;
    if (m["content"].is_null()) {
      m["content"] = "";
      continue;
    }
    std::string text;
    for (const auto& part : m["content"]) {
      if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
          !part["text"].is_string())
        bad_request("only text parts ({\"type\": \"text\", \"text\": ...}) are supported in 'content'", "messages");
      if (!text.empty()) text += "\n";
      text += part["text"].get<std::string>();
    }
    m["content"] = text;
  }
  return out;
}

// The template variables a request adds: vLLM's `chat_template_kwargs` (e.g. {"enable_thinking": false}
// for Qwen3's template) and OpenAI's `reasoning_effort` (gpt-oss's template reads it). The variables
// Serval sets itself cannot be replaced.
void request_template_vars(const json& body, json& vars) {
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    const json& kw = body["chat_template_kwargs"];
    if (!kw.is_object() || kw.size() > 32)
      bad_request("'chat_template_kwargs' must be an object of at most 32 variables", "chat_template_kwargs");
    for (const auto& [key, value] : kw.items()) {
      if (vars.contains(key) || key == "tools" || key == "reasoning_effort")
        bad_request(fmt::format("'chat_template_kwargs' cannot set '{}' (the request's own fields set it)", key),
                    "chat_template_kwargs");
      vars[key] = value;
    }
  }
  if (body.contains("reasoning_effort") && !body["reasoning_effort"].is_null()) {
    static const json kEfforts = {"none", "minimal", "low", "medium", "high"};
    const json& effort = body["reasoning_effort"];
    if (std::find(kEfforts.begin(), kEfforts.end(), effort) == kEfforts.end())
      bad_request("'reasoning_effort' must be one of none, minimal, low, medium, high", "reasoning_effort");
    vars["reasoning_effort"] = effort;
  }
}

std::string render_chat(const json& body, const ApiContext& ctx) {
  check_messages(body);
  const std::unique_ptr<jinja::Template> custom = request_template(body, ctx);
  const jinja::Template* tmpl = custom ? custom.get() : ctx.chat_template;
  if (!tmpl)
    bad_request(ctx.chat_template_error.empty() ? "this model has no chat template; use /v1/completions"
                                                : "unsupported chat template: " + ctx.chat_template_error);
  const auto& v = ctx.tokenizer->vocab();
  const json& agp = body.contains("add_generation_prompt") ? body["add_generation_prompt"] : json(true);
  if (!agp.is_boolean()) bad_request("'add_generation_prompt' must be a boolean", "add_generation_prompt");
  json vars{{"messages", template_messages(body["messages"])}, {"add_generation_prompt", agp},
            {"bos_token", v.bos >= 0 ? v.tokens[v.bos] : ""}, {"eos_token", v.eos >= 0 ? v.tokens[v.eos] : ""}};
  request_template_vars(body, vars);
  if (body.contains("tools") && !body["tools"].is_null()) vars["tools"] = body["tools"];
  try {
    return tmpl->render(vars);
  } catch (const Error& e) {
    bad_request(std::string("chat template error: ") + e.what(), "messages");
  }
}

// `speculative`: false (off), true (the server's setting) or {"enabled": bool, "draft_max": N}; and
// llama-server's flat `speculative.n_max`. A cap above the server's --draft-max is the server's.
void speculative_from(const json& b, GenJob& job) {
  std::optional<int64_t> n_max = field<int64_t>(b, "speculative.n_max");
  bool enabled = true;
  if (b.contains("speculative") && !b["speculative"].is_null()) {
    const json& s = b["speculative"];
    if (s.is_boolean()) {
      enabled = s.get<bool>();
    } else if (s.is_object()) {
      for (const auto& [key, value] : s.items())
        if (key != "enabled" && key != "draft_max")
          bad_request(fmt::format("unknown field 'speculative.{}' (enabled, draft_max)", key), "speculative");
      try {
        enabled = field<bool>(s, "enabled").value_or(true);
        if (auto n = field<int64_t>(s, "draft_max")) n_max = n;
      } catch (ApiError& e) {
        e.param = "speculative";  // the field the client sent
        throw;
      }
    } else {
      bad_request("'speculative' must be a boolean or an object {\"enabled\", \"draft_max\"}", "speculative");
    }
  }
  if (n_max && (*n_max < 0 || *n_max > 64))
    bad_request(fmt::format("the speculative draft_max must be 0..64, got {}", *n_max), "speculative");
  job.params.draft_max = !enabled ? 0 : n_max ? int32_t(*n_max) : -1;
}

// The output constraint and the tool plan: at most one grammar, from the structured-output fields or
// from a tool_choice that forces a call.
void constraint_from(const json& b, bool chat, const ApiContext& ctx, GenJob& job) {
  std::optional<OutputConstraint> c = output_constraint(b);
  if (chat) {
    ToolPlan plan = tool_plan(b, ctx.tool_format);
    job.parse_tool_calls = plan.parse_calls;
    job.tool_format = ctx.tool_format;
    job.tools = std::move(plan.tools);
    if (plan.forced && c)
      bad_request(fmt::format("'tool_choice' forces a tool call, which '{}' would constrain too; send one", c->field),
                  "tool_choice");
    if (plan.forced) c = std::move(plan.forced);
  }
  if (c) job.params.grammar = compile_grammar(c->gbnf, c->field);
}

// The LoRA adapter of a request: `model` naming one (vLLM), or llama-server's `lora` list of
// {"id", "scale"} (entries with scale 0 mean "not this one"; one adapter per request).
static void adapter_from(const json& b, const ApiContext& ctx, GenerationParams& params) {
  const auto snapshot = ctx.adapters.get();
  const std::vector<AdapterList::Adapter>& adapters = *snapshot;
  if (b.contains("model") && b["model"].is_string())
    if (const int32_t id = AdapterList::find(adapters, b["model"].get<std::string>()); id >= 0) {
      params.adapter = id;
      params.adapter_scale = adapters[size_t(id)].scale;
    }
  if (!b.contains("lora") || b["lora"].is_null()) return;
  const json& l = b["lora"];
  if (!l.is_array() || l.size() > 64) bad_request("'lora' must be a list of {\"id\", \"scale\"} objects", "lora");
  int chosen = 0;
  for (const auto& e : l) {
    if (!e.is_object() || !e.contains("id") || !e["id"].is_number_integer() || !e.contains("scale") || !e["scale"].is_number())
      bad_request("each 'lora' entry must be {\"id\": integer, \"scale\": number}", "lora");
    const int64_t id = e["id"].get<int64_t>();
    const double scale = e["scale"].get<double>();
    if (id < 0 || id >= int64_t(adapters.size()) || adapters[size_t(id)].name.empty())
      bad_request(fmt::format("LoRA adapter id {} is not loaded (see /lora-adapters)", id), "lora");
    if (!std::isfinite(scale) || std::abs(scale) > 1e4) bad_request("a LoRA scale must be a finite number", "lora");
    if (scale == 0) continue;
    if (++chosen > 1) bad_request("at most one LoRA adapter per request (with a non-zero scale)", "lora");
    if (params.adapter >= 0 && params.adapter != int32_t(id))
      bad_request("'model' names one LoRA adapter and 'lora' another", "lora");
    params.adapter = int32_t(id);
    params.adapter_scale = float(scale);
  }
}

GenJob parse_generation_request(const json& b, bool chat, const ApiContext& ctx) {
  const Tokenizer& tok = *ctx.tokenizer;
  check_fields(b, chat);
  GenJob job;
  job.chat = chat;
  if (chat) {
    const std::string text = render_chat(b, ctx);
    job.prompt = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
    job.reasoning = ctx.reasoning;
    job.reasoning_open = prompt_opens_thinking(text);
  } else {
    job.prompt = completion_prompt(b, tok);
  }
  if (job.prompt.empty()) bad_request("the chat template rendered an empty prompt", "messages");
  logprobs_from(b, chat, job);
  if (!chat) {
    echo_from(b, tok, job);  // the prompt as sent, before it becomes a fill-in-the-middle prompt
    fill_in_the_middle(b, tok, job.prompt);
  }
  sampling_from(b, job, ctx);
  lengths_from(b, chat, job, ctx);
  const int64_t n = field<int64_t>(b, "n").value_or(1);
  if (n < 1 || n > 16) bad_request(fmt::format("n must be between 1 and 16, got {}", n), "n");
  job.n = int(n);
  const int64_t best_of = field<int64_t>(b, "best_of").value_or(n);
  if (best_of < n) bad_request(fmt::format("best_of must be at least n ({}), got {}", n, best_of), "best_of");
  if (best_of > n)
    bad_request("best_of greater than n is not supported (it would rank candidates by log-probability)", "best_of");
  job.params.ignore_eos = field<bool>(b, "ignore_eos").value_or(false);
  stops_from(b, job, tok.n_vocab());
  job.stream = field<bool>(b, "stream").value_or(false);
  if (b.contains("stream_options") && b["stream_options"].is_object())
    job.include_usage = field<bool>(b["stream_options"], "include_usage").value_or(false);
  const int64_t priority = field<int64_t>(b, "priority").value_or(0);
  if (priority < INT32_MIN || priority > INT32_MAX) bad_request("'priority' is out of range", "priority");
  job.params.priority = int32_t(priority);
  speculative_from(b, job);
  constraint_from(b, chat, ctx, job);
  const bool marker_tools = job.parse_tool_calls && (job.tool_format == ToolFormat::Harmony || job.tool_format == ToolFormat::DeepSeekR1 ||
                                                     job.tool_format == ToolFormat::DeepSeekV31);
  job.render_special = chat && (job.reasoning == ReasoningFormat::GptOss || marker_tools);
  adapter_from(b, ctx, job.params);
  return job;
}

std::vector<int32_t> parse_tokenize_request(const json& b, const ApiContext& ctx) {
  check_model_name(b, ctx);
  const Tokenizer& tok = *ctx.tokenizer;
  if (b.contains("messages")) return tok.encode(render_chat(b, ctx), false, true);
  if (b.contains("prompt") && b["prompt"].is_string())
    return tok.encode(b["prompt"].get<std::string>(), field<bool>(b, "add_special_tokens").value_or(true), true);
  bad_request("'prompt' (a string) or 'messages' is required", "prompt");
}

std::vector<int32_t> parse_detokenize_request(const json& b, const ApiContext& ctx) {
  check_model_name(b, ctx);
  if (!b.contains("tokens") || !b["tokens"].is_array()) bad_request("'tokens' must be a list of token ids", "tokens");
  return checked_token_ids(b["tokens"], *ctx.tokenizer, "tokens");
}

}  // namespace serval
