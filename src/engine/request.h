// A generation request as the engine tracks it: a small state machine with its tokens, the number
// whose KV is computed (versus all known tokens: the target), its KV allocation and its sampler.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "grammar/matcher.h"
#include "kv/kv_manager.h"
#include "sampling/sampler.h"

namespace serval {

using RequestId = uint64_t;

enum class RequestState { Waiting, Running, Preempted, Finished };
enum class FinishReason { None, Stop, Length, Abort, Error };

const char* to_string(RequestState s);
const char* to_string(FinishReason r);

struct GenerationParams {
  SamplingParams sampling;
  int32_t max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's end-of-generation tokens
  int32_t priority = 0;                 // lower is served first (with the priority policy)
  // Speculative decoding for this request: -1 as the engine is configured, 0 off, N > 0 at most N
  // proposed tokens per step (never more than the engine's draft_max).
  int32_t draft_max = -1;
  // Constrained decoding: every generated token keeps the output a prefix of a sentence of this
  // grammar, and the request stops when the sentence is complete. Turns speculation off.
  std::shared_ptr<grammar::CompiledGrammar> grammar;
  // >= 0: report the log-probability of every prompt token after the first (and the top n) as prompt
  // events, before the first generated token. The prompt is then computed, not taken from the prefix
  // cache.
  int32_t prompt_logprobs = -1;
  // An embedding request (decoder models as embedders, last-token pooling): prefill only, in the same
  // continuous batch as generation; its final event carries the last prompt token's final hidden state
  // (after the output norm, unnormalized) and nothing is generated. No speculation or grammar.
  bool embed = false;
  // With `embed`: the mean of every prompt token's final hidden state instead of the last one's (mean
  // pooling). Every prompt position is then computed, never taken from the prefix cache.
  bool embed_mean = false;
  // The LoRA adapter this request's tokens use (an index into Model::adapters(), -1 none) and its user
  // scale (the update is scale * alpha / rank * B A x). Prefix-cache blocks are keyed by both.
  int32_t adapter = -1;
  float adapter_scale = 1.0f;
};

// One generated token, or the end of the stream (finished = true; token may be -1).
struct TokenEvent {
  RequestId id = 0;
  int32_t token = -1;
  float logprob = 0;
  std::vector<TokenLogprob> top;
  bool finished = false;
  FinishReason reason = FinishReason::None;
  std::string error;  // for FinishReason::Error
  // Prompt tokens whose KV came from the prefix cache when the request was first scheduled (OpenAI's
  // usage.prompt_tokens_details.cached_tokens); on every event of a request that was scheduled.
  int64_t cached_tokens = 0;
  // A prompt token's log-probability (GenerationParams::prompt_logprobs), not a generated token.
  bool prompt = false;
  // The final event of an embedding request (GenerationParams::embed): [n_embd] floats.
  std::vector<float> embedding;
};

using TokenCallback = std::function<void(const TokenEvent&)>;
using Clock = std::chrono::steady_clock;

struct Request {
  Request(RequestId id, std::vector<int32_t> prompt, GenerationParams params, TokenCallback on_token, int64_t arrival);

  RequestId id;
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int64_t n_prompt;
  GenerationParams params;
  TokenCallback on_token;
  int64_t arrival;  // order of arrival (ties in priority go to the earlier one)

  RequestState state = RequestState::Waiting;
  FinishReason finish_reason = FinishReason::None;
  int64_t num_computed_tokens = 0;  // tokens whose KV is in the cache
  KvAllocation kv;
  // Prefix-cache hash chain of the full blocks of `tokens` (KvManager::hash_blocks), extended as
  // tokens arrive; kept across preemptions (the tokens do not change).
  std::vector<uint64_t> block_hashes;
  // The prefix-cache salt of the request's KV (0 without a LoRA adapter; else its adapter and scale).
  uint64_t cache_salt() const;
  // The engine's copy of kv's block tables as the last batch carried them (moved into each batch
  // and back), so that a step copies only the blocks new since; taken from allocation
  // `batch_tables_serial`, with blocks before `batch_tables_live[g]` already marked freed.
  std::vector<std::vector<int32_t>> batch_tables;
  uint64_t batch_tables_serial = 0;
  std::vector<int64_t> batch_tables_live;
  Sampler sampler;
  std::unique_ptr<grammar::GrammarMatcher> matcher;  // with params.grammar: the output's parse state
  int32_t n_preemptions = 0;
  int64_t cached_prompt_tokens = -1;
  // A mean-pooled embedding (GenerationParams::embed_mean): the sum of the final hidden states of the
  // prompt positions below `pooled`, in position order (positions computed again after a preemption
  // are not added twice).
  std::vector<float> pool_sum;
  int64_t pooled = 0;
  int64_t prompt_logprobs_done = 1;  // prompt positions below this have had their prompt event  // prefix-cache hit at the first scheduling (-1: not scheduled yet)
  // Speculative decoding: tokens proposed to follow `tokens`, verified in this step's batch (the
  // scheduler may shorten or drop them), and the adaptive proposal length (0: not set yet).
  std::vector<int32_t> draft;
  // A token tree instead of a chain: draft_parents[i] is the index in `draft` of token i's parent
  // (-1: the last known token), parents before children, so any prefix of the draft is a tree.
  // Empty: the draft is one chain (each token's parent is the one before it).
  std::vector<int32_t> draft_parents;
  int32_t spec_len = 0;

  Clock::time_point t_arrival = Clock::now(), t_first_token{}, t_last_token{};

  // All known tokens need KV; the last one's logits give the next token.
  int64_t num_tokens() const { return int64_t(tokens.size()); }
  int64_t num_output_tokens() const { return num_tokens() - n_prompt; }
  bool is_finished() const { return state == RequestState::Finished; }
  bool wants_prompt_logits() const { return params.prompt_logprobs >= 0 && prompt_logprobs_done < n_prompt; }
  bool mean_pooled() const { return params.embed && params.embed_mean; }
  // Every prompt row is computed (no prefix-cache hit): its logits or hidden states are an output.
  bool needs_every_prompt_row() const { return wants_prompt_logits() || mean_pooled(); }
  // Keeps the first n draft tokens (and their parents).
  void cut_draft(size_t n) {
    if (draft.size() > n) draft.resize(n);
    if (draft_parents.size() > n) draft_parents.resize(n);
  }
};

}  // namespace serval
