#include "server/completion_run.h"

#include <fmt/core.h>

#include <algorithm>
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

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
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

CompletionRun::CompletionRun(RunContext ctx, GenJob job, std::shared_ptr<http::Exchange> exchange,
                             net::any_io_executor io)
    : ctx_(std::move(ctx)), job_(std::move(job)), ex_(std::move(exchange)), strand_(net::make_strand(io)),
      deadline_(strand_), stream_(std::make_shared<TokenStream>()),
      id_(random_id(job_.chat ? "chatcmpl" : "cmpl")), created_(unix_now()) {}

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
    choices_[i].text = std::make_unique<ChoiceText>(tok, job_.stops);
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
  c.full_text += delta;
  if (c.done) {
    const double e2e = std::chrono::duration<double>(now - c.t_start).count();
    const double tpot = c.tokens > 1 ? std::chrono::duration<double>(c.t_last - c.t_first).count() / double(c.tokens - 1) : 0;
    ctx_.metrics->observe_request(e2e, tpot, c.finish_reason, int64_t(job_.prompt.size()), c.tokens);
  }
  return true;
}

void CompletionRun::send_sse(const json& payload) { ex_->write_chunk("data: " + dump(payload) + "\n\n"); }

void CompletionRun::stream_event(const TokenEvent& ev, const std::string& delta, size_t index) {
  Choice& c = choices_[index];
  const bool first = job_.chat && !c.started;
  const std::string shown = c.started ? delta : job_.echo_text + delta;  // echo: the prompt comes first
  c.started = true;
  json lp = nullptr;
  if (job_.logprobs >= 0 && !ev.finished) {
    const auto& tok = ctx_.model->tokenizer();
    if (job_.chat) {
      lp = json{{"content", json::array({token_logprob_json(ev.token, ev.logprob, ev.top)})}};
    } else {
      json top = json::object();
      for (const auto& t : ev.top) top[tok.token_to_piece(t.id, true)] = t.logprob;
      lp = json{{"tokens", {tok.token_to_piece(ev.token, true)}}, {"token_logprobs", {ev.logprob}},
                {"top_logprobs", json::array({top})}, {"text_offset", {c.full_text.size() - delta.size()}}};
    }
  }
  if (!shown.empty() || first || lp != nullptr) send_sse(chunk_json(index, shown, nullptr, lp, first));
  if (c.done) send_sse(chunk_json(index, "", &c, nullptr, false));
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
  if (job_.stream) {
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
                               bool first) const {
  json choice{{"index", index}, {"logprobs", lp}, {"finish_reason", finished ? json(finished->finish_reason) : json(nullptr)}};
  if (job_.chat) {
    json d = json::object();
    if (first) d["role"] = "assistant";
    if (!delta.empty() || first) d["content"] = delta;
    choice["delta"] = d;
  } else {
    choice["text"] = delta;
  }
  return json{{"id", id_}, {"object", job_.chat ? "chat.completion.chunk" : "text_completion"}, {"created", created_},
              {"model", ctx_.model_name}, {"choices", json::array({choice})}};
}

json CompletionRun::completion_logprobs(const Choice& c) const {
  const auto& tok = ctx_.model->tokenizer();
  if (job_.chat) {
    json lp{{"content", json::array()}};
    for (size_t k = 0; k < c.token_ids.size(); ++k)
      lp["content"].push_back(token_logprob_json(c.token_ids[k], c.token_logprobs[k], c.tops[k]));
    return lp;
  }
  json lp{{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
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
  return lp;
}

json CompletionRun::final_json() const {
  json out = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    json choice{{"index", i}, {"logprobs", job_.logprobs >= 0 ? completion_logprobs(c) : json(nullptr)},
                {"finish_reason", c.finish_reason}};
    if (job_.chat) choice["message"] = json{{"role", "assistant"}, {"content", c.full_text}};
    else choice["text"] = job_.echo_text + c.full_text;
    out.push_back(choice);
  }
  return json{{"id", id_}, {"object", job_.chat ? "chat.completion" : "text_completion"}, {"created", created_},
              {"model", ctx_.model_name}, {"choices", out}, {"usage", usage_json()}};
}

}  // namespace serval
