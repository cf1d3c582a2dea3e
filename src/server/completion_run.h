// One completion or chat request in flight: submits its n choices to the engine, turns the
// engine's token events into OpenAI JSON (SSE chunks or one final body) without holding a thread
// (events wake it on its own strand), and aborts its engine requests when the client hangs up or
// the request timeout passes.
#pragma once
#include <atomic>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine_loop.h"
#include "server/api_request.h"
#include "server/http_transport.h"
#include "server/metrics.h"
#include "server/responses_api.h"
#include "server/text_stream.h"
#include "server/tool_calls.h"

namespace serval {

class Model;

// Seconds since the Unix epoch (the `created` field of OpenAI objects).
int64_t unix_now();

// What a run needs from the server that owns it.
struct RunContext {
  const Model* model = nullptr;
  EngineLoop* loop = nullptr;
  Metrics* metrics = nullptr;
  std::string model_name;
  std::chrono::milliseconds timeout{600000};
  http::Headers extra_headers;          // CORS and the like
  std::function<void()> on_finished;    // once, when the reply is complete or the client is gone
  ResponseStore* responses = nullptr;   // where a Responses API answer is stored (store: true)
};

class CompletionRun : public std::enable_shared_from_this<CompletionRun> {
 public:
  using SteadyClock = std::chrono::steady_clock;
  struct Choice {
    std::unique_ptr<ChoiceText> text;
    std::string full_text;
    RequestId engine_id = 0;
    int64_t tokens = 0;
    int64_t cached_tokens = 0;  // prompt tokens the prefix cache held
    std::vector<int32_t> token_ids;
    std::vector<float> token_logprobs;
    std::vector<std::vector<TokenLogprob>> tops;
    // echo with logprobs: the prompt tokens' log-probabilities (from the second token on)
    std::vector<int32_t> prompt_ids;
    std::vector<float> prompt_lps;
    std::vector<std::vector<TokenLogprob>> prompt_tops;
    std::string finish_reason;
    bool done = false, started = false;
    // With tools: the bytes of full_text streamed as content so far, and the calls found at the end.
    size_t streamed = 0;
    ParsedToolOutput parsed;
    // With --reasoning-parser (chat): the thinking, apart from full_text (the answer), and the part of
    // it the last event made visible.
    std::unique_ptr<ReasoningSplitter> splitter;
    std::string reasoning, reasoning_delta;
    int64_t reasoning_tokens = 0;  // tokens that showed only thinking
    SteadyClock::time_point t_start, t_first, t_last;
  };

  CompletionRun(RunContext ctx, GenJob job, std::shared_ptr<http::Exchange> exchange, boost::asio::any_io_executor io);
  // Submits the choices (throws ApiError if the engine refuses them) and starts answering.
  void start();

 private:
  RunContext ctx_;
  GenJob job_;
  std::shared_ptr<http::Exchange> ex_;
  boost::asio::strand<boost::asio::any_io_executor> strand_;
  boost::asio::steady_timer deadline_;
  std::shared_ptr<TokenStream> stream_;
  std::vector<Choice> choices_;
  std::string id_;
  int64_t created_ = 0;
  bool finished_ = false;
  std::shared_ptr<CompletionRun> self_;  // from begin() to complete()
  bool begun_ = false;  // begin() ran (on the strand): drains before that leave events queued

  void submit_all();
  void begin();
  void drain();
  void on_event(const TokenEvent& ev);
  bool apply_event(const TokenEvent& ev, std::string& delta, size_t& index);
  void stream_event(const TokenEvent& ev, const std::string& delta, size_t index);
  void stream_tool_event(const TokenEvent& ev, size_t index);
  std::string tool_text_delta(Choice& c);
  std::string content_after_calls(const Choice& c) const;
  json tool_calls_json(const Choice& c, bool delta) const;
  void client_gone();
  void abort_all();
  void complete();
  bool all_done() const;
  void send_sse(const json& payload);
  void split_reasoning(Choice& c, std::string& delta);

  json chunk_json(size_t index, const std::string& delta, const Choice* finished, const json& lp, bool first,
                  const std::string& reasoning = {}) const;
  json final_json() const;
  json usage_json() const;
  json token_logprob_json(int32_t token, float lp, const std::vector<TokenLogprob>& top) const;
  json completion_logprobs(const Choice& c) const;
  // Completions' logprobs arrays (tokens, token_logprobs, top_logprobs, text_offset) for the echoed
  // prompt (its first token has none: null) and then tokens [from, to) of the choice.
  json completions_lp(const Choice& c, bool with_prompt, size_t from, size_t to, size_t offset) const;

  // Anthropic's Messages API (messages_reply.cpp): content blocks, and its stream of named events.
  int block_ = -1;          // the index of the content block streaming now (-1: none yet)
  std::string block_type_;  // its type, "" once closed
  bool message_started_ = false;
  void send_event(const json& payload);
  void stream_messages_event(const std::string& delta, size_t index);
  void block_delta(const std::string& type, const std::string& text);
  void close_block();
  void finish_messages_stream();
  json messages_json() const;
  json messages_usage() const;

  // OpenAI's Responses API (responses_reply.cpp): output items, and the response.* stream events.
  int item_ = -1;           // the output index of the item streaming now
  std::string item_type_;   // "reasoning" or "message" while one is open
  std::string item_text_;   // its text so far
  int64_t sequence_ = 0;    // every event's sequence_number
  bool response_started_ = false;
  void send_response_event(json payload);
  void stream_responses_event(const std::string& delta, size_t index);
  void item_delta(const std::string& type, const std::string& text);
  void close_item();
  void finish_responses_stream();
  void store_response() const;
  std::string item_id(const char* prefix) const;
  std::string response_status() const;
  json response_object(const std::string& status, json output) const;
  json output_items() const;
  json responses_json() const;
};

}  // namespace serval
