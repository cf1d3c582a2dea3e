#include "server/completion_run.h"

#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <boost/asio/post.hpp>
#include <random>

#include "base/error.h"
#include "model/model.h"

namespace serval {

namespace net = boost::asio;

namespace {

std::string random_id(const char* prefix) {
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  return fmt::format("{}-{:016x}", prefix, rng());
}

const char* finish_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Error: return "error";
    default: return "abort";
  }
}

}  // namespace

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

CompletionRun::CompletionRun(RunContext ctx, GenJob job, std::shared_ptr<http::Exchange> exchange,
                             net::any_io_executor io)
    : ctx_(std::move(ctx)), job_(std::move(job)), ex_(std::move(exchange)), strand_(net::make_strand(io)),
      deadline_(strand_), stream_(std::make_shared<TokenStream>()),
      id_(random_id(job_.responses_api ? "resp" : job_.messages_api ? "msg" : job_.chat ? "chatcmpl" : "cmpl")),
      created_(unix_now()) {}

void CompletionRun::start() {
  std::weak_ptr<CompletionRun> weak = weak_from_this();
  stream_->set_notify([weak] {
    if (auto self = weak.lock()) net::post(self->strand_, [self] { self->drain(); });
  });
  submit_all();  // throws before anything was sent
  // Everything after the submission happens on the strand, where the events are handled too.
  net::post(strand_, [self = shared_from_this()] { self->begin(); });
}

void CompletionRun::begin() {
  std::weak_ptr<CompletionRun> weak = weak_from_this();
  if (job_.stream) {
    http::Headers headers = ctx_.extra_headers;
    headers.emplace_back("Cache-Control", "no-cache");
    ex_->begin_stream(200, "text/event-stream", std::move(headers));
  }
  ex_->on_disconnect([weak] {
    if (auto self = weak.lock()) net::post(self->strand_, [self] { self->client_gone(); });
  });
  self_ = shared_from_this();  // alive until complete(): event notifications hold only weak references
  deadline_.expires_after(ctx_.timeout);
  deadline_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (!ec && !self->finished_) self->abort_all();  // each choice then ends with "abort"
  });
  begun_ = true;
  drain();
}

void CompletionRun::submit_all() {
  const auto& tok = ctx_.model->tokenizer();
  choices_.resize(job_.n);
  const auto now = SteadyClock::now();
  for (int i = 0; i < job_.n; ++i) {
    GenerationParams p = job_.params;
    p.sampling.seed += uint64_t(i);  // n choices from one seed differ, and repeat with it
    choices_[i].text = std::make_unique<ChoiceText>(tok, job_.stops, job_.render_special);
    if (job_.reasoning != ReasoningFormat::None)
      choices_[i].splitter = std::make_unique<ReasoningSplitter>(job_.reasoning, job_.reasoning_open);
    choices_[i].t_start = now;
    try {
      choices_[i].engine_id = ctx_.loop->submit_into(job_.prompt, p, stream_);
    } catch (const Error& e) {
      for (int k = 0; k < i; ++k) ctx_.loop->abort(choices_[k].engine_id);
      stream_->set_notify(nullptr);
      bad_request(e.what());
    }
  }
}

void CompletionRun::drain() {
  // Events can arrive while start() is still submitting (on an API thread): they wait in the stream
  // until begin() has run on the strand, when every choice knows its engine id.
  if (finished_ || !begun_) return;
  while (auto ev = stream_->try_next()) on_event(*ev);
  if (all_done()) complete();
}

bool CompletionRun::all_done() const {
  return std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return c.done; });
}

void CompletionRun::on_event(const TokenEvent& ev) {
  std::string delta;
  size_t index = 0;
  if (!apply_event(ev, delta, index)) return;
  if (job_.stream) stream_event(ev, delta, index);
}

// Applies one engine event to its choice; true when a (possibly empty) delta or the end of a
// choice should be reported.
bool CompletionRun::apply_event(const TokenEvent& ev, std::string& delta, size_t& index) {
  for (index = 0; index < choices_.size() && choices_[index].engine_id != ev.id; ++index) {}
  if (index == choices_.size()) return false;
  Choice& c = choices_[index];
  if (c.done) return false;
  const auto now = SteadyClock::now();
  delta.clear();
  c.cached_tokens = std::max(c.cached_tokens, ev.cached_tokens);
  if (ev.prompt) {  // a prompt token's log-probability: reported with the echoed prompt
    c.prompt_ids.push_back(ev.token);
    c.prompt_lps.push_back(ev.logprob);
    c.prompt_tops.push_back(ev.top);
    return false;
  }
  if (!ev.finished) {
    if (c.tokens == 0) {
      c.t_first = now;
      ctx_.metrics->observe_ttft(std::chrono::duration<double>(now - c.t_start).count());
    } else {
      ctx_.metrics->observe_itl(std::chrono::duration<double>(now - c.t_last).count());
    }
    c.t_last = now;
    ++c.tokens;
    c.token_ids.push_back(ev.token);
    c.token_logprobs.push_back(ev.logprob);
    c.tops.push_back(ev.top);
    delta = c.text->push(ev.token);
    if (c.text->stopped()) {
      ctx_.loop->abort(c.engine_id);
      c.finish_reason = "stop";
      c.done = true;
    }
  } else {
    delta = c.text->finish();
    c.finish_reason = finish_name(ev.reason);
    c.done = true;
  }
  split_reasoning(c, delta);
  c.full_text += delta;
  if (c.done && job_.parse_tool_calls) {
    c.parsed = parse_tool_calls(c.full_text, job_.tool_format, job_.tools);
    if (!c.parsed.calls.empty() && c.finish_reason == "stop") c.finish_reason = "tool_calls";
  }
  if (c.done) {
    const double e2e = std::chrono::duration<double>(now - c.t_start).count();
    const double tpot = c.tokens > 1 ? std::chrono::duration<double>(c.t_last - c.t_first).count() / double(c.tokens - 1) : 0;
    ctx_.metrics->observe_request(e2e, tpot, c.finish_reason, int64_t(job_.prompt.size()), c.tokens);
  }
  return true;
}

// With a reasoning parser: the thinking in `delta` moves to the choice's reasoning (and its
// reasoning_delta); what is left in `delta` is the answer. Tool calls are parsed from the answer only.
void CompletionRun::split_reasoning(Choice& c, std::string& delta) {
  c.reasoning_delta.clear();
  if (!c.splitter) return;
  ReasoningParts parts = c.splitter->push(delta);
  if (c.done) parts += c.splitter->finish();
  c.reasoning += parts.reasoning;
  if (!parts.reasoning.empty() && parts.content.empty() && !c.done) ++c.reasoning_tokens;
  c.reasoning_delta = std::move(parts.reasoning);
  delta = std::move(parts.content);
}

void CompletionRun::send_sse(const json& payload) { ex_->write_chunk("data: " + dump(payload) + "\n\n"); }

void CompletionRun::stream_event(const TokenEvent& ev, const std::string& delta, size_t index) {
  if (job_.messages_api) return stream_messages_event(delta, index);
  if (job_.responses_api) return stream_responses_event(delta, index);
  if (job_.parse_tool_calls) return stream_tool_event(ev, index);
  Choice& c = choices_[index];
  const bool first = job_.chat && !c.started;
  const std::string shown = c.started ? delta : job_.echo_text + delta;  // echo: the prompt comes first
  c.started = true;
  json lp = nullptr;
  if (job_.logprobs >= 0 && !ev.finished) {
    if (job_.chat) {
      lp = json{{"content", json::array({token_logprob_json(ev.token, ev.logprob, ev.top)})}};
    } else {
      const bool with_prompt = job_.params.prompt_logprobs >= 0 && shown.size() > delta.size();
      const size_t before = job_.params.prompt_logprobs >= 0 ? job_.echo_text.size() : 0;  // echoed text
      lp = completions_lp(c, with_prompt, c.token_ids.size() - 1, c.token_ids.size(),
                          with_prompt ? 0 : before + c.full_text.size() - delta.size());
    }
  }
  const std::string& thought = c.reasoning_delta;
  if (!shown.empty() || !thought.empty() || first || lp != nullptr)
    send_sse(chunk_json(index, shown, nullptr, lp, first, thought));
  if (c.done) send_sse(chunk_json(index, "", &c, nullptr, false));
}

// Streaming with tools: content up to a possible call as it comes; at the end the calls (as
// delta.tool_calls, all fragments of a call in one chunk) or the held-back text.
void CompletionRun::stream_tool_event(const TokenEvent& ev, size_t index) {
  Choice& c = choices_[index];
  const bool first = !c.started;
  c.started = true;
  const bool calls = c.done && !c.parsed.calls.empty();
  const std::string shown = tool_text_delta(c);
  json lp = nullptr;  // each token's log-probability as it comes, even while its text is held back
  if (job_.logprobs >= 0 && !ev.finished)
    lp = json{{"content", json::array({token_logprob_json(ev.token, ev.logprob, ev.top)})}};
  const std::string& thought = c.reasoning_delta;
  if (!shown.empty() || !thought.empty() || first || lp != nullptr)
    send_sse(chunk_json(index, shown, nullptr, lp, first, thought));
  if (calls) {
    json chunk = chunk_json(index, "", nullptr, nullptr, false);
    chunk["choices"][0]["delta"] = json{{"tool_calls", tool_calls_json(c, true)}};
    send_sse(chunk);
  }
  if (c.done) send_sse(chunk_json(index, "", &c, nullptr, false));
}

// With tools: the content that can be shown now (up to where a call may start) and, at the end, the
// rest of it (the parsed content, when there were calls).
std::string CompletionRun::tool_text_delta(Choice& c) {
  const bool calls = c.done && !c.parsed.calls.empty();
  const size_t hold = std::min(c.full_text.size(), tool_call_start(c.full_text, job_.tool_format));
  const size_t until = calls ? c.streamed : c.done ? c.full_text.size() : std::max(c.streamed, hold);
  std::string shown = c.full_text.substr(c.streamed, until - c.streamed);
  c.streamed = until;
  return calls ? content_after_calls(c) : shown;
}

// The content a finished choice with calls has beyond what was streamed: the parsed content starts
// with the streamed text (trimmed).
std::string CompletionRun::content_after_calls(const Choice& c) const {
  std::string_view sent(c.full_text.data(), c.streamed);
  while (!sent.empty() && std::isspace(uint8_t(sent.front()))) sent.remove_prefix(1);
  while (!sent.empty() && std::isspace(uint8_t(sent.back()))) sent.remove_suffix(1);
  const std::string& all = c.parsed.content;
  return all.size() > sent.size() && all.compare(0, sent.size(), sent) == 0 ? all.substr(sent.size()) : "";
}

json CompletionRun::tool_calls_json(const Choice& c, bool delta) const {
  json out = json::array();
  for (size_t k = 0; k < c.parsed.calls.size(); ++k) {
    const ToolCall& call = c.parsed.calls[k];
    json j = delta ? json{{"index", k}} : json::object();
    j.update(json{{"id", call.id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
    out.push_back(j);
  }
  return out;
}

void CompletionRun::abort_all() {
  for (auto& c : choices_)
    if (!c.done) ctx_.loop->abort(c.engine_id);
}

// The client hung up: free its KV now, count what was left as aborted, answer nobody.
void CompletionRun::client_gone() {
  if (finished_) return;
  abort_all();
  for (auto& c : choices_) {
    if (c.done) continue;
    c.done = true;
    c.finish_reason = "abort";  // what a stored response records (Responses: status cancelled)
    ctx_.metrics->observe_request(std::chrono::duration<double>(SteadyClock::now() - c.t_start).count(), 0, "abort",
                                  int64_t(job_.prompt.size()), c.tokens);
  }
  complete();
}

void CompletionRun::complete() {
  if (finished_) return;
  finished_ = true;
  deadline_.cancel();
  auto keep = std::move(self_);  // released when this returns
  stream_->set_notify(nullptr);
  if (job_.responses_api) store_response();
  if (job_.stream && job_.responses_api) {
    finish_responses_stream();
    ex_->end_stream();
  } else if (job_.responses_api) {
    ex_->respond(http::Response{200, "application/json", dump(responses_json()), ctx_.extra_headers});
  } else if (job_.stream && job_.messages_api) {
    finish_messages_stream();
    ex_->end_stream();
  } else if (job_.messages_api) {
    ex_->respond(http::Response{200, "application/json", dump(messages_json()), ctx_.extra_headers});
  } else if (job_.stream) {
    if (job_.include_usage)
      send_sse(json{{"id", id_}, {"object", job_.chat ? "chat.completion.chunk" : "text_completion"},
                    {"created", created_}, {"model", ctx_.model_name}, {"choices", json::array()}, {"usage", usage_json()}});
    ex_->write_chunk("data: [DONE]\n\n");
    ex_->end_stream();
  } else {
    ex_->respond(http::Response{200, "application/json", dump(final_json()), ctx_.extra_headers});
  }
  if (ctx_.on_finished) ctx_.on_finished();
}

json CompletionRun::token_logprob_json(int32_t token, float lp, const std::vector<TokenLogprob>& top) const {
  const auto& tok = ctx_.model->tokenizer();
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

json CompletionRun::usage_json() const {
  int64_t completion = 0;
  for (const auto& c : choices_) completion += c.tokens;
  const int64_t prompt = int64_t(job_.prompt.size());
  // The prompt is counted once for all choices, as OpenAI does; so are its cached tokens (the first
  // choice's: the others find the first one's blocks).
  const int64_t cached = choices_.empty() ? 0 : choices_[0].cached_tokens;
  return json{{"prompt_tokens", prompt},
              {"completion_tokens", completion},
              {"total_tokens", prompt + completion},
              {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

json CompletionRun::chunk_json(size_t index, const std::string& delta, const Choice* finished, const json& lp,
                               bool first, const std::string& reasoning) const {
  json choice{{"index", index}, {"logprobs", lp}, {"finish_reason", finished ? json(finished->finish_reason) : json(nullptr)}};
  if (job_.chat) {
    json d = json::object();
    if (first) d["role"] = "assistant";
    if (!reasoning.empty()) d["reasoning_content"] = reasoning;
    if (!delta.empty() || (first && reasoning.empty())) d["content"] = delta;
    choice["delta"] = d;
  } else {
    choice["text"] = delta;
  }
  return json{{"id", id_}, {"object", job_.chat ? "chat.completion.chunk" : "text_completion"}, {"created", created_},
              {"model", ctx_.model_name}, {"choices", json::array({choice})}};
}

json CompletionRun::completion_logprobs(const Choice& c) const {
  if (job_.chat) {
    json lp{{"content", json::array()}};
    for (size_t k = 0; k < c.token_ids.size(); ++k)
      lp["content"].push_back(token_logprob_json(c.token_ids[k], c.token_logprobs[k], c.tops[k]));
    return lp;
  }
  return completions_lp(c, job_.params.prompt_logprobs >= 0, 0, c.token_ids.size(), 0);
}

json CompletionRun::completions_lp(const Choice& c, bool with_prompt, size_t from, size_t to, size_t offset) const {
  const auto& tok = ctx_.model->tokenizer();
  json lp{{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
          {"text_offset", json::array()}};
  auto add = [&](int32_t id, json value, json top) {
    const std::string piece = tok.token_to_piece(id, true);
    lp["tokens"].push_back(piece);
    lp["token_logprobs"].push_back(std::move(value));
    lp["top_logprobs"].push_back(std::move(top));
    lp["text_offset"].push_back(offset);
    offset += piece.size();
  };
  auto tops = [&](const std::vector<TokenLogprob>& t) {
    json top = json::object();
    for (const auto& e : t) top[tok.token_to_piece(e.id, true)] = e.logprob;
    return top;
  };
  if (with_prompt) {
    if (!job_.prompt.empty()) add(job_.prompt[0], nullptr, nullptr);  // nothing comes before the first token
    for (size_t k = 0; k < c.prompt_ids.size(); ++k) add(c.prompt_ids[k], c.prompt_lps[k], tops(c.prompt_tops[k]));
  }
  for (size_t k = from; k < to; ++k) add(c.token_ids[k], c.token_logprobs[k], tops(c.tops[k]));
  return lp;
}

json CompletionRun::final_json() const {
  json out = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    json choice{{"index", i}, {"logprobs", job_.logprobs >= 0 ? completion_logprobs(c) : json(nullptr)},
                {"finish_reason", c.finish_reason}};
    if (job_.chat && !c.parsed.calls.empty())
      choice["message"] = json{{"role", "assistant"},
                               {"content", c.parsed.content.empty() ? json(nullptr) : json(c.parsed.content)},
                               {"tool_calls", tool_calls_json(c, false)}};
    else if (job_.chat)  // thinking that never ended leaves no answer: null, as vLLM gives it
      choice["message"] = json{{"role", "assistant"},
                               {"content", c.splitter && c.full_text.empty() ? json(nullptr) : json(c.full_text)}};
    else choice["text"] = job_.echo_text + c.full_text;
    if (c.splitter)  // vLLM's shape: the thinking, or null when there was none
      choice["message"]["reasoning_content"] = c.reasoning.empty() ? json(nullptr) : json(c.reasoning);
    out.push_back(choice);
  }
  return json{{"id", id_}, {"object", job_.chat ? "chat.completion" : "text_completion"}, {"created", created_},
              {"model", ctx_.model_name}, {"choices", out}, {"usage", usage_json()}};
}

}  // namespace serval
