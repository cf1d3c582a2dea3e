#include "server/http_server.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "base/error.h"
#include "server/jinja.h"
#include "server/text_stream.h"
#include "server/web_page.h"

namespace serval {

using json = nlohmann::ordered_json;
using SteadyClock = std::chrono::steady_clock;

namespace {

// An error returned to the client in OpenAI's shape.
struct ApiError {
  int status;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
  std::string code;
};

[[noreturn]] void bad_request(std::string message, std::string param = "") {
  throw ApiError{400, std::move(message), "invalid_request_error", std::move(param), ""};
}

json error_json(const ApiError& e) {
  json err{{"message", e.message}, {"type", e.type}, {"param", e.param.empty() ? json(nullptr) : json(e.param)},
           {"code", e.code.empty() ? json(e.status) : json(e.code)}};
  return json{{"error", err}, {"object", "error"}, {"message", e.message}, {"code", e.status}};
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string random_id(const char* prefix) {
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  return fmt::format("{}-{:016x}", prefix, rng());
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Typed optional field access with OpenAI-style errors.
template <typename T>
std::optional<T> field(const json& body, const char* name);

template <>
std::optional<double> field<double>(const json& b, const char* n) {
  if (!b.contains(n) || b[n].is_null()) return std::nullopt;
  if (!b[n].is_number()) bad_request(fmt::format("'{}' must be a number", n), n);
  return b[n].get<double>();
}
template <>
std::optional<int64_t> field<int64_t>(const json& b, const char* n) {
  if (!b.contains(n) || b[n].is_null()) return std::nullopt;
  if (b[n].is_number_float() && b[n].get<double>() == std::floor(b[n].get<double>()) && std::abs(b[n].get<double>()) < 1e15)
    return int64_t(b[n].get<double>());
  if (!b[n].is_number_integer()) bad_request(fmt::format("'{}' must be an integer", n), n);
  return b[n].get<int64_t>();
}
template <>
std::optional<bool> field<bool>(const json& b, const char* n) {
  if (!b.contains(n) || b[n].is_null()) return std::nullopt;
  if (!b[n].is_boolean()) bad_request(fmt::format("'{}' must be a boolean", n), n);
  return b[n].get<bool>();
}

}  // namespace

// Everything one completion / chat request asks for, validated.
struct GenJob {
  bool chat = false;
  std::vector<int32_t> prompt;
  GenerationParams params;
  int n = 1;
  std::vector<std::string> stops;
  bool stream = false, include_usage = false;
  int logprobs = -1;  // -1: none; chat: top_logprobs count with logprobs=true
};

struct ChoiceState {
  std::unique_ptr<ChoiceText> text;
  std::string full_text;
  RequestId engine_id = 0;
  int64_t tokens = 0;
  json logprobs = json::array();  // chat: content entries; completions: built at the end
  std::vector<int32_t> token_ids;
  std::vector<float> token_logprobs;
  std::vector<std::vector<TokenLogprob>> tops;
  std::string finish_reason;
  bool done = false;
  SteadyClock::time_point t_start, t_first, t_last;
};

struct HttpServer::Impl {
  ServerConfig cfg;
  httplib::Server http;
  std::thread listener;
  std::atomic<const Model*> model{nullptr};
  EngineLoop* loop = nullptr;
  std::unique_ptr<jinja::Template> chat_template;
  std::string chat_template_error;
  std::string model_name;
  int64_t max_model_len = 0;
  Metrics metrics;
  std::atomic<bool> draining{false};
  std::atomic<int> in_flight{0};
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopped = false;

  explicit Impl(ServerConfig c) : cfg(std::move(c)) {}

  void routes();
  void respond_error(httplib::Response& res, const ApiError& e) const;
  template <typename F>
  void guarded(const httplib::Request& req, httplib::Response& res, F&& handler);

  json parse_body(const httplib::Request& req) const;
  void check_model_name(const json& body) const;
  GenJob parse_job(const json& body, bool chat);
  std::string render_chat(const json& body);
  void run_job(GenJob& job, httplib::Response& res);
  void sampling_from(const json& body, GenJob& job);
  std::shared_ptr<TokenStream> submit_all(GenJob& job, std::vector<ChoiceState>& choices);
  bool apply_event(const GenJob& job, std::vector<ChoiceState>& choices, const TokenEvent& ev, std::string& delta_out,
                   size_t& index_out);
  json chunk_json(const GenJob& job, const std::string& id, int64_t created, size_t index, const std::string& delta,
                  const ChoiceState* finished, const json& lp, bool first_chat_chunk) const;
  json final_json(const GenJob& job, const std::string& id, int64_t created, std::vector<ChoiceState>& choices) const;
  json usage_json(const GenJob& job, const std::vector<ChoiceState>& choices) const;
  json token_logprob_json(const GenJob& job, int32_t token, float lp, const std::vector<TokenLogprob>& top) const;
  json engine_state();
};

void HttpServer::Impl::respond_error(httplib::Response& res, const ApiError& e) const {
  res.status = e.status;
  res.set_content(dump(error_json(e)), "application/json");
}

template <typename F>
void HttpServer::Impl::guarded(const httplib::Request& req, httplib::Response& res, F&& handler) {
  try {
    handler();
  } catch (const ApiError& e) {
    respond_error(res, e);
  } catch (const Error& e) {
    respond_error(res, ApiError{400, e.what()});
  } catch (const std::exception& e) {
    respond_error(res, ApiError{500, std::string("internal error: ") + e.what(), "internal_server_error"});
  }
}

json HttpServer::Impl::parse_body(const httplib::Request& req) const {
  json body;
  try {
    body = json::parse(req.body);
  } catch (const json::parse_error& e) {
    bad_request(std::string("Invalid JSON body: ") + e.what());
  }
  if (!body.is_object()) bad_request("The request body must be a JSON object");
  return body;
}

void HttpServer::Impl::check_model_name(const json& body) const {
  if (!body.contains("model") || body["model"].is_null()) return;
  if (!body["model"].is_string()) bad_request("'model' must be a string", "model");
  const std::string name = body["model"].get<std::string>();
  if (name != model_name)
    throw ApiError{404, fmt::format("The model '{}' does not exist; this server serves '{}'", name, model_name),
                   "NotFoundError", "model", "model_not_found"};
}

}  // namespace serval

namespace serval {

std::string HttpServer::Impl::render_chat(const json& body) {
  if (!body.contains("messages") || !body["messages"].is_array()) bad_request("'messages' must be an array", "messages");
  const json& messages = body["messages"];
  if (messages.empty()) bad_request("'messages' must not be empty", "messages");
  for (const auto& m : messages) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      bad_request("each message needs a string 'role'", "messages");
    if (m.contains("content") && !m["content"].is_string() && !m["content"].is_array() && !m["content"].is_null())
      bad_request("a message's 'content' must be a string or a list of parts", "messages");
  }
  std::unique_ptr<jinja::Template> custom;
  const jinja::Template* tmpl = chat_template.get();
  if (body.contains("chat_template") && !body["chat_template"].is_null()) {
    if (!body["chat_template"].is_string()) bad_request("'chat_template' must be a string", "chat_template");
    try {
      custom = std::make_unique<jinja::Template>(body["chat_template"].get<std::string>());
    } catch (const Error& e) {
      bad_request(std::string("unsupported chat template: ") + e.what(), "chat_template");
    }
    tmpl = custom.get();
  }
  if (!tmpl)
    bad_request(chat_template_error.empty() ? "this model has no chat template; use /v1/completions"
                                            : "unsupported chat template: " + chat_template_error);
  const auto& v = model.load()->tokenizer().vocab();
  json ctx{{"messages", messages}, {"add_generation_prompt", body.value("add_generation_prompt", true)},
           {"bos_token", v.bos >= 0 ? v.tokens[v.bos] : ""}, {"eos_token", v.eos >= 0 ? v.tokens[v.eos] : ""}};
  if (body.contains("tools") && !body["tools"].is_null()) ctx["tools"] = body["tools"];
  try {
    return tmpl->render(ctx);
  } catch (const Error& e) {
    bad_request(std::string("chat template error: ") + e.what(), "messages");
  }
}

void HttpServer::Impl::sampling_from(const json& b, GenJob& job) {
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
  else s.seed = std::random_device{}() * 0x9E3779B97F4A7C15ull ^ uint64_t(SteadyClock::now().time_since_epoch().count());
  if (b.contains("logit_bias") && !b["logit_bias"].is_null()) {
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
      if (!v.is_number()) bad_request("'logit_bias' values must be numbers", "logit_bias");
      s.logit_bias.emplace_back(id, std::clamp(v.get<float>(), -100.0f, 100.0f));
    }
  }
  if (job.logprobs > 0) s.n_logprobs = job.logprobs;
  try {
    s.validate(model.load()->tokenizer().n_vocab());
  } catch (const Error& e) {
    bad_request(e.what());
  }
}

GenJob HttpServer::Impl::parse_job(const json& b, bool chat) {
  const Model& m = *model.load();
  const auto& tok = m.tokenizer();
  GenJob job;
  job.chat = chat;
  if (chat) {
    const std::string text = render_chat(b);
    job.prompt = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
  } else {
    if (!b.contains("prompt")) bad_request("'prompt' is required", "prompt");
    const json& p = b["prompt"];
    if (p.is_string()) {
      if (p.get<std::string>().empty()) bad_request("'prompt' must not be empty", "prompt");
      job.prompt = tok.encode(p.get<std::string>(), true, true);
    } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
      for (auto& t : p) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tok.n_vocab())
          bad_request("'prompt' token ids must be integers inside the vocabulary", "prompt");
        job.prompt.push_back(t.get<int32_t>());
      }
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      job.prompt = tok.encode(p[0].get<std::string>(), true, true);
    } else {
      bad_request("'prompt' must be a string, a list of one string, or a list of token ids", "prompt");
    }
    if (job.prompt.empty()) bad_request("'prompt' must not be empty", "prompt");
  }
  if (b.contains("logprobs") && !b["logprobs"].is_null()) {
    if (chat) {
      if (field<bool>(b, "logprobs").value_or(false)) job.logprobs = int(field<int64_t>(b, "top_logprobs").value_or(0));
    } else {
      job.logprobs = int(field<int64_t>(b, "logprobs").value_or(0));
    }
    if (job.logprobs > 20) bad_request("logprobs can be at most 20", chat ? "top_logprobs" : "logprobs");
    if (job.logprobs < -1) bad_request("logprobs must not be negative", "logprobs");
  }
  sampling_from(b, job);
  const int64_t max_tokens_limit = max_model_len;
  const int64_t n_prompt = int64_t(job.prompt.size());
  if (n_prompt >= max_tokens_limit)
    bad_request(fmt::format("This model's maximum context length is {} tokens. However, your prompt has {} tokens.",
                            max_tokens_limit, n_prompt), chat ? "messages" : "prompt");
  auto mt = field<int64_t>(b, "max_completion_tokens");
  if (!mt) mt = field<int64_t>(b, "max_tokens");
  const int64_t max_tokens = mt.value_or(chat ? max_tokens_limit - n_prompt : 16);
  if (max_tokens < 1) bad_request(fmt::format("max_tokens must be at least 1, got {}", max_tokens), "max_tokens");
  if (n_prompt + max_tokens > max_tokens_limit)
    bad_request(fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens ({} in "
                            "the prompt, {} in the completion). Please reduce the prompt or max_tokens.",
                            max_tokens_limit, n_prompt + max_tokens, n_prompt, max_tokens), "max_tokens");
  job.params.max_tokens = int32_t(max_tokens);
  const int64_t n = field<int64_t>(b, "n").value_or(1);
  if (n < 1 || n > 16) bad_request(fmt::format("n must be between 1 and 16, got {}", n), "n");
  job.n = int(n);
  job.params.ignore_eos = field<bool>(b, "ignore_eos").value_or(false);
  if (b.contains("stop") && !b["stop"].is_null()) {
    const json& s = b["stop"];
    if (s.is_string()) job.stops.push_back(s.get<std::string>());
    else if (s.is_array() && s.size() <= 16 && std::all_of(s.begin(), s.end(), [](auto& x) { return x.is_string(); }))
      for (auto& x : s) job.stops.push_back(x.get<std::string>());
    else bad_request("'stop' must be a string or a list of at most 16 strings", "stop");
    job.stops.erase(std::remove(job.stops.begin(), job.stops.end(), ""), job.stops.end());
  }
  if (b.contains("stop_token_ids") && b["stop_token_ids"].is_array())
    for (auto& t : b["stop_token_ids"])
      if (t.is_number_integer()) job.params.stop_token_ids.push_back(t.get<int32_t>());
  job.stream = field<bool>(b, "stream").value_or(false);
  if (b.contains("stream_options") && b["stream_options"].is_object())
    job.include_usage = field<bool>(b["stream_options"], "include_usage").value_or(false);
  job.params.priority = int32_t(field<int64_t>(b, "priority").value_or(0));
  return job;
}

std::shared_ptr<TokenStream> HttpServer::Impl::submit_all(GenJob& job, std::vector<ChoiceState>& choices) {
  const auto& tok = model.load()->tokenizer();
  auto stream = std::make_shared<TokenStream>();
  choices.resize(job.n);
  const auto now = SteadyClock::now();
  for (int i = 0; i < job.n; ++i) {
    GenerationParams p = job.params;
    p.sampling.seed += uint64_t(i);  // n choices from one seed differ, and repeat with it
    choices[i].text = std::make_unique<ChoiceText>(tok, job.stops);
    choices[i].t_start = now;
    try {
      choices[i].engine_id = loop->submit_into(job.prompt, p, stream);
    } catch (const Error& e) {
      for (int k = 0; k < i; ++k) loop->abort(choices[k].engine_id);
      bad_request(e.what());
    }
  }
  return stream;
}

// Applies one engine event to its choice; returns true when a (possibly empty) delta or the end
// of a choice should be reported.
bool HttpServer::Impl::apply_event(const GenJob& job, std::vector<ChoiceState>& choices, const TokenEvent& ev,
                                   std::string& delta, size_t& index) {
  for (index = 0; index < choices.size() && choices[index].engine_id != ev.id; ++index) {}
  if (index == choices.size()) return false;
  ChoiceState& c = choices[index];
  if (c.done) return false;
  const auto now = SteadyClock::now();
  delta.clear();
  if (!ev.finished) {
    if (c.tokens == 0) {
      c.t_first = now;
      metrics.observe_ttft(std::chrono::duration<double>(now - c.t_start).count());
    } else {
      metrics.observe_itl(std::chrono::duration<double>(now - c.t_last).count());
    }
    c.t_last = now;
    ++c.tokens;
    c.token_ids.push_back(ev.token);
    c.token_logprobs.push_back(ev.logprob);
    c.tops.push_back(ev.top);
    delta = c.text->push(ev.token);
    if (c.text->stopped()) {
      loop->abort(c.engine_id);
      c.finish_reason = "stop";
      c.done = true;
    }
  } else {
    delta = c.text->finish();
    c.finish_reason = ev.reason == FinishReason::Stop ? "stop" : ev.reason == FinishReason::Length ? "length"
                      : ev.reason == FinishReason::Error ? "error" : "abort";
    c.done = true;
  }
  c.full_text += delta;
  if (c.done) {
    const double e2e = std::chrono::duration<double>(now - c.t_start).count();
    const double tpot = c.tokens > 1 ? std::chrono::duration<double>(c.t_last - c.t_first).count() / double(c.tokens - 1) : 0;
    metrics.observe_request(e2e, tpot, c.finish_reason, int64_t(job.prompt.size()), c.tokens);
  }
  return true;
}

json HttpServer::Impl::token_logprob_json(const GenJob& job, int32_t token, float lp, const std::vector<TokenLogprob>& top) const {
  const auto& tok = model.load()->tokenizer();
  auto entry = [&](int32_t id, float v) {
    const std::string piece = tok.token_to_piece(id, true);
    json bytes = json::array();
    for (unsigned char ch : piece) bytes.push_back(int(ch));
    return json{{"token", piece}, {"logprob", v}, {"bytes", bytes}};
  };
  json e = entry(token, lp);
  e["top_logprobs"] = json::array();
  for (const auto& t : top) e["top_logprobs"].push_back(entry(t.id, t.logprob));
  return e;
}

json HttpServer::Impl::usage_json(const GenJob& job, const std::vector<ChoiceState>& choices) const {
  int64_t completion = 0;
  for (const auto& c : choices) completion += c.tokens;
  const int64_t prompt = int64_t(job.prompt.size());
  return json{{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

}  // namespace serval

namespace serval {

json HttpServer::Impl::chunk_json(const GenJob& job, const std::string& id, int64_t created, size_t index,
                                  const std::string& delta, const ChoiceState* finished, const json& lp,
                                  bool first_chat_chunk) const {
  json choice{{"index", index}, {"logprobs", lp}, {"finish_reason", finished ? json(finished->finish_reason) : json(nullptr)}};
  if (job.chat) {
    json d = json::object();
    if (first_chat_chunk) d["role"] = "assistant";
    if (!delta.empty() || first_chat_chunk) d["content"] = delta;
    choice["delta"] = d;
  } else {
    choice["text"] = delta;
  }
  return json{{"id", id}, {"object", job.chat ? "chat.completion.chunk" : "text_completion"}, {"created", created},
              {"model", model_name}, {"choices", json::array({choice})}};
}

json HttpServer::Impl::final_json(const GenJob& job, const std::string& id, int64_t created,
                                  std::vector<ChoiceState>& choices) const {
  const auto& tok = model.load()->tokenizer();
  json out_choices = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    ChoiceState& c = choices[i];
    json lp = nullptr;
    if (job.logprobs >= 0 && job.chat) {
      lp = json{{"content", json::array()}};
      for (size_t k = 0; k < c.token_ids.size(); ++k)
        lp["content"].push_back(token_logprob_json(job, c.token_ids[k], c.token_logprobs[k], c.tops[k]));
    } else if (job.logprobs >= 0) {
      lp = json{{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
                {"text_offset", json::array()}};
      size_t offset = 0;
      for (size_t k = 0; k < c.token_ids.size(); ++k) {
        const std::string piece = tok.token_to_piece(c.token_ids[k], true);
        lp["tokens"].push_back(piece);
        lp["token_logprobs"].push_back(c.token_logprobs[k]);
        json top = json::object();
        for (const auto& t : c.tops[k]) top[tok.token_to_piece(t.id, true)] = t.logprob;
        lp["top_logprobs"].push_back(top);
        lp["text_offset"].push_back(offset);
        offset += piece.size();
      }
    }
    json choice{{"index", i}, {"logprobs", lp}, {"finish_reason", c.finish_reason}};
    if (job.chat) choice["message"] = json{{"role", "assistant"}, {"content", c.full_text}};
    else choice["text"] = c.full_text;
    out_choices.push_back(choice);
  }
  return json{{"id", id}, {"object", job.chat ? "chat.completion" : "text_completion"}, {"created", created},
              {"model", model_name}, {"choices", out_choices}, {"usage", usage_json(job, choices)}};
}

void HttpServer::Impl::run_job(GenJob& job, httplib::Response& res) {
  const int64_t waiting = loop->waiting();
  if (waiting >= cfg.max_waiting) {
    res.set_header("Retry-After", "1");
    throw ApiError{429, fmt::format("The server is busy ({} requests waiting); retry later", waiting), "rate_limit_exceeded"};
  }
  auto choices = std::make_shared<std::vector<ChoiceState>>();
  auto stream = submit_all(job, *choices);
  const std::string id = random_id(job.chat ? "chatcmpl" : "cmpl");
  const int64_t created = unix_now();
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(int64_t(cfg.request_timeout_s * 1000));
  auto abort_all = [this, choices] {
    for (auto& c : *choices)
      if (!c.done) loop->abort(c.engine_id);
  };
  auto all_done = [choices] { return std::all_of(choices->begin(), choices->end(), [](auto& c) { return c.done; }); };
  ++in_flight;
  if (!job.stream) {
    while (!all_done()) {
      auto ev = stream->next(std::chrono::milliseconds(200));
      if (SteadyClock::now() > deadline) abort_all();
      if (!ev) continue;
      std::string delta;
      size_t index;
      apply_event(job, *choices, *ev, delta, index);
    }
    --in_flight;
    res.set_content(dump(final_json(job, id, created, *choices)), "application/json");
    return;
  }
  auto shared_job = std::make_shared<GenJob>(std::move(job));
  auto started = std::make_shared<std::vector<bool>>(shared_job->n, false);
  auto finished_stream = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, shared_job, choices, stream, id, created, deadline, abort_all, all_done, started, finished_stream](
          size_t, httplib::DataSink& sink) {
        const GenJob& j = *shared_job;
        auto send = [&](const json& payload) {
          const std::string line = "data: " + dump(payload) + "\n\n";
          return sink.write(line.data(), line.size());
        };
        if (all_done()) {
          if (j.include_usage) {
            json u{{"id", id}, {"object", j.chat ? "chat.completion.chunk" : "text_completion"}, {"created", created},
                   {"model", model_name}, {"choices", json::array()}, {"usage", usage_json(j, *choices)}};
            if (!send(u)) return false;
          }
          const std::string done = "data: [DONE]\n\n";
          sink.write(done.data(), done.size());
          *finished_stream = true;
          sink.done();
          return true;
        }
        auto ev = stream->next(std::chrono::milliseconds(500));
        if (SteadyClock::now() > deadline) abort_all();
        if (!ev) {
          static const std::string ping = ": ping\n\n";  // detects a client that went away
          return sink.write(ping.data(), ping.size());
        }
        std::string delta;
        size_t index;
        if (!apply_event(j, *choices, *ev, delta, index)) return true;
        const ChoiceState& c = (*choices)[index];
        const bool first = j.chat && !(*started)[index];
        (*started)[index] = true;
        json lp = nullptr;
        if (j.logprobs >= 0 && !ev->finished) {
          const auto& tok = model.load()->tokenizer();
          if (j.chat) {
            lp = json{{"content", json::array({token_logprob_json(j, ev->token, ev->logprob, ev->top)})}};
          } else {
            json top = json::object();
            for (const auto& t : ev->top) top[tok.token_to_piece(t.id, true)] = t.logprob;
            lp = json{{"tokens", {tok.token_to_piece(ev->token, true)}}, {"token_logprobs", {ev->logprob}},
                      {"top_logprobs", json::array({top})}, {"text_offset", {c.full_text.size() - delta.size()}}};
          }
        }
        if (!delta.empty() || first || lp != nullptr) {
          if (!send(chunk_json(j, id, created, index, delta, nullptr, lp, first))) return false;
        }
        if (c.done && !send(chunk_json(j, id, created, index, "", &c, nullptr, false))) return false;
        return true;
      },
      [this, abort_all, finished_stream, choices, shared_job](bool) {
        if (!*finished_stream) {  // the client went away: free its KV at once, count the requests as aborted
          abort_all();
          for (auto& c : *choices) {
            if (c.done) continue;
            c.done = true;
            metrics.observe_request(std::chrono::duration<double>(SteadyClock::now() - c.t_start).count(), 0, "abort",
                                    int64_t(shared_job->prompt.size()), c.tokens);
          }
        }
        --in_flight;
      });
}

json HttpServer::Impl::engine_state() {
  json j;
  loop->run_on_engine([&](Engine& e) {
    const EngineStats s = e.stats();
    std::string blocks;
    const auto& kv = e.kv_manager();
    for (int g = 0; g < kv.n_groups(); ++g) {
      const auto& pool = kv.pool(g);
      for (int32_t b = 0; b < pool.n_blocks() && blocks.size() < 16384; ++b) {
        const int32_t rc = pool.ref_count(b);
        blocks += rc > 1 ? 's' : rc == 1 ? 'u' : pool.hash_of(b) ? 'c' : 'f';
      }
    }
    json running = json::array(), waiting = json::array();
    for (const Request* r : e.scheduler().running())
      running.push_back({{"id", r->id}, {"prompt", r->n_prompt}, {"generated", r->num_output_tokens()},
                         {"computed", r->num_computed_tokens}});
    for (const Request* r : e.scheduler().waiting())
      waiting.push_back({{"id", r->id}, {"prompt", r->n_prompt}, {"generated", r->num_output_tokens()},
                         {"preempted", r->n_preemptions > 0}});
    j = json{{"running", running}, {"waiting", waiting}, {"kv_usage", s.kv_usage}, {"blocks", blocks},
             {"block_size", e.capacity().block_size}, {"prefix_queries", s.prefix_queries}, {"prefix_hits", s.prefix_hits},
             {"preemptions", s.preemptions}, {"generation_tokens", s.generation_tokens}};
  });
  j["latency"] = json::parse(metrics.recent_json());
  j["model"] = model_name;
  return j;
}

}  // namespace serval

namespace serval {

void HttpServer::Impl::routes() {
  http.set_payload_max_length(cfg.max_body_bytes);
  const int threads = cfg.threads;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (cfg.cors) {
      res.set_header("Access-Control-Allow-Origin", "*");
      res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
      res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      if (req.method == "OPTIONS") {
        res.status = 204;
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    const bool open_path = req.path == "/health" || req.path == "/" || req.path == "/metrics";
    if (!cfg.api_key.empty() && !open_path && req.get_header_value("Authorization") != "Bearer " + cfg.api_key) {
      respond_error(res, ApiError{401, "Invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error"});
      return httplib::Server::HandlerResponse::Handled;
    }
    const bool api = req.path.rfind("/v1/", 0) == 0 || req.path == "/tokenize" || req.path == "/detokenize";
    if (api && !model.load()) {
      respond_error(res, ApiError{503, "The model is still loading", "service_unavailable"});
      return httplib::Server::HandlerResponse::Handled;
    }
    if (api && req.method == "POST" && draining) {
      respond_error(res, ApiError{503, "The server is shutting down", "service_unavailable"});
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http.set_error_handler([this](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string msg = res.status == 413 ? fmt::format("The request body exceeds {} bytes", cfg.max_body_bytes)
                          : res.status == 404 ? "Not found" : "Request failed";
    respond_error(res, ApiError{res.status, msg, res.status == 404 ? "NotFoundError" : "invalid_request_error"});
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const char* status = !model.load() ? "loading" : draining ? "draining" : "ok";
    res.status = std::string(status) == "ok" ? 200 : 503;
    res.set_content(dump(json{{"status", status}}), "application/json");
  });
  http.Get("/", [](const httplib::Request&, httplib::Response& res) { res.set_content(web_page_html(), "text/html; charset=utf-8"); });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    EngineStats s;
    if (model.load()) s = loop->stats();
    res.set_content(metrics.render(s, model_name), "text/plain; version=0.0.4");
  });
  http.Get("/engine/state", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(req, res, [&] {
      if (!model.load()) throw ApiError{503, "The model is still loading", "service_unavailable"};
      res.set_content(dump(engine_state()), "application/json");
    });
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json m{{"id", model_name}, {"object", "model"}, {"created", unix_now()}, {"owned_by", "serval"}, {"max_model_len", max_model_len}};
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });
  http.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(req, res, [&] {
      const json b = parse_body(req);
      check_model_name(b);
      const auto& tok = model.load()->tokenizer();
      std::vector<int32_t> ids;
      if (b.contains("messages")) ids = tok.encode(render_chat(b), false, true);
      else if (b.contains("prompt") && b["prompt"].is_string())
        ids = tok.encode(b["prompt"].get<std::string>(), field<bool>(b, "add_special_tokens").value_or(true), true);
      else bad_request("'prompt' (a string) or 'messages' is required", "prompt");
      res.set_content(dump(json{{"tokens", ids}, {"count", ids.size()}, {"max_model_len", max_model_len}}), "application/json");
    });
  });
  http.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(req, res, [&] {
      const json b = parse_body(req);
      check_model_name(b);
      const auto& tok = model.load()->tokenizer();
      if (!b.contains("tokens") || !b["tokens"].is_array()) bad_request("'tokens' must be a list of token ids", "tokens");
      std::vector<int32_t> ids;
      for (auto& t : b["tokens"]) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tok.n_vocab())
          bad_request("'tokens' must be token ids inside the vocabulary", "tokens");
        ids.push_back(t.get<int32_t>());
      }
      res.set_content(dump(json{{"prompt", tok.decode(ids)}}), "application/json");
    });
  });
  for (const bool chat : {false, true}) {
    http.Post(chat ? "/v1/chat/completions" : "/v1/completions", [this, chat](const httplib::Request& req, httplib::Response& res) {
      guarded(req, res, [&] {
        const json b = parse_body(req);
        check_model_name(b);
        GenJob job = parse_job(b, chat);
        run_job(job, res);
      });
    });
  }
}

HttpServer::HttpServer(ServerConfig config) : impl_(std::make_unique<Impl>(config)), config_(std::move(config)) {
  impl_->routes();
}

HttpServer::~HttpServer() {
  impl_->http.stop();
  if (impl_->listener.joinable()) impl_->listener.join();
}

void HttpServer::start() {
  bound_port_ = config_.port == 0 ? impl_->http.bind_to_any_port(config_.host) : impl_->http.bind_to_port(config_.host, config_.port)
                                                                                   ? config_.port : -1;
  check(bound_port_ > 0, "cannot listen on {}:{} (in use, or not an address of this machine)", config_.host, config_.port);
  impl_->listener = std::thread([this] {
    impl_->http.listen_after_bind();
    std::lock_guard<std::mutex> lock(impl_->stop_mu);
    impl_->stopped = true;
    impl_->stop_cv.notify_all();
  });
}

void HttpServer::attach(const Model& model, EngineLoop& loop) {
  impl_->loop = &loop;
  impl_->model_name = config_.served_model_name;
  loop.run_on_engine([&](Engine& e) { impl_->max_model_len = e.max_model_len(); });
  const std::string source = config_.chat_template.empty() ? model.tokenizer().vocab().chat_template : config_.chat_template;
  if (!source.empty()) {
    try {
      impl_->chat_template = std::make_unique<jinja::Template>(source);
    } catch (const Error& e) {
      impl_->chat_template_error = e.what();
    }
  }
  impl_->model.store(&model);
}

void HttpServer::wait() {
  std::unique_lock<std::mutex> lock(impl_->stop_mu);
  impl_->stop_cv.wait(lock, [&] { return impl_->stopped; });
}

void HttpServer::drain_and_stop() {
  impl_->draining = true;
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(int64_t(config_.drain_timeout_s * 1000));
  while (impl_->in_flight > 0 && SteadyClock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (impl_->loop) {
    impl_->loop->run_on_engine([](Engine& e) { e.abort_all(); });  // what is left gets its final event
  }
  const auto grace = SteadyClock::now() + std::chrono::seconds(5);
  while (impl_->in_flight > 0 && SteadyClock::now() < grace) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  impl_->http.stop();
}

}  // namespace serval
