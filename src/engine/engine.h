// The engine: requests in, token streams out. One step = schedule -> one flattened forward pass
// -> sample -> commit. Not thread-safe: EngineLoop runs it on one thread.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/speculative.h"
#include "kv/kv_manager.h"
#include "model/model.h"

namespace serval {

struct EngineConfig {
  int32_t block_size = 16;
  uint64_t kv_cache_bytes = 256ull << 20;  // KV budget; see kv_budget_from_string
  int32_t num_blocks = 0;                  // if > 0, overrides the byte budget (tests)
  DType kv_type = DType::F16;
  int64_t max_model_len = 0;  // 0: the model's trained context
  bool prefix_caching = true;
  SchedulerConfig scheduler;
  SpeculativeConfig spec;  // speculative decoding (off by default)
};

// "512MiB", "2GB", "1073741824" or a fraction of free RAM ("0.5") to bytes; throws Error.
uint64_t kv_budget_from_string(const std::string& text);

struct EngineStats {
  int64_t running = 0, waiting = 0;
  double kv_usage = 0;  // fraction of blocks held by requests
  int64_t prefix_queries = 0, prefix_hits = 0, preemptions = 0;
  int64_t steps = 0, prompt_tokens = 0, generation_tokens = 0, computed_tokens = 0;
  int64_t blocks_total = 0, blocks_free = 0, blocks_cached_free = 0;
  int64_t reserved_slots = 0, used_slots = 0;  // KV slots held by requests vs tokens they hold
  SpecStats spec;
  // Mixture of experts: tokens each expert has run since load, summed over the layers (empty: dense).
  std::vector<uint64_t> expert_tokens;
};

// How the KV cache is laid out, printed at start-up.
struct KvCapacity {
  int64_t bytes_per_token = 0;  // `formula` (2 x n_layers x n_kv_heads x d_head x dtype_bytes; MLA one row) of one rank when split
  int ranks = 1;                // ranks of a split model, each holding this much
  int32_t num_blocks = 0;       // per KV group
  int32_t block_size = 0;
  int64_t tokens = 0;           // num_blocks x block_size
  uint64_t bytes = 0;
  double full_context_sequences = 0;  // sequences of max_model_len that fit
  std::string dtype = "f16";          // the cache type's command-line name
  std::string formula = "2 x layers x kv heads x d_head x dtype bytes";  // of bytes_per_token, per architecture
  std::string describe(int64_t max_model_len) const;
};

class Engine {
 public:
  Engine(const Model& model, EngineConfig config);

  // Queues a request; throws Error for an empty prompt, bad parameters or a request that can never fit
  // (the message says the numbers). Events for it go to `on_token`.
  // `id`: one from reserve_id() (0: the next free id).
  RequestId add_request(std::vector<int32_t> prompt, GenerationParams params, TokenCallback on_token, RequestId id = 0);
  // add_request's checks without adding: reads only what is fixed at construction, so any thread may
  // call it while the engine runs.
  void check_request(const std::vector<int32_t>& prompt, const GenerationParams& params) const;
  // A fresh request id; thread-safe.
  RequestId reserve_id() { return next_id_.fetch_add(1, std::memory_order_relaxed); }
  // Finishes a request now with reason Abort; its blocks return to the pool at once. False if unknown.
  bool abort(RequestId id);
  // Aborts every request (each stream gets its final event).
  void abort_all();
  // Ends every request with FinishReason::Error and `message` (after a failed step).
  void fail_all(const std::string& message);
  // Runs one iteration; false when there was nothing to do.
  bool step();
  // Receives the prefix-cache index's changes (kv/kv_events.h) on the engine's thread, after each step
  // that made some; setting one turns the recording on.
  using KvEventSink = std::function<void(std::vector<KvEvent>)>;
  void set_kv_event_sink(KvEventSink sink);
  // Drops the cached prefixes no request holds (an emptied index is announced as AllBlocksCleared).
  void reset_prefix_cache();
  bool has_work() const { return !requests_.empty(); }
  // Whether a request (waiting, running or preempted) uses LoRA adapter `id`.
  bool adapter_in_use(int32_t id) const;
  EngineStats stats() const;
  const KvCapacity& capacity() const { return capacity_; }
  const KvManager& kv_manager() const { return *kv_; }
  const Scheduler& scheduler() const { return *scheduler_; }
  int64_t max_model_len() const { return max_model_len_; }
  const Model& model() const { return model_; }
  const Proposer* proposer() const { return proposer_.get(); }  // null without speculation
  // Replaces the proposer the configuration chose (a proposer of one's own; the tests' oracles). The
  // configuration's draft_max, draft_min and max_running still apply.
  void set_proposer(std::unique_ptr<Proposer> p) { proposer_ = std::move(p); }
  SpecMethod spec_method() const { return proposer_ ? config_.spec.method : SpecMethod::None; }
  std::string spec_name() const { return proposer_ ? config_.spec.method_name() : "none"; }  // "ngram+draft" ...

 private:
  const Model& model_;
  EngineConfig config_;
  int64_t max_model_len_;
  KvCapacity capacity_;
  std::unique_ptr<KvManager> kv_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<Scheduler> scheduler_;
  std::map<RequestId, std::unique_ptr<Request>> requests_;
  std::atomic<RequestId> next_id_{1};
  int64_t arrivals_ = 0;
  EngineStats counters_;
  std::vector<float> logits_;
  // Prompt rows of one scheduled sequence with logits for prompt log-probabilities: prompt
  // positions first .. first + count - 1, at logits rows row ...
  struct PromptRows {
    int64_t first = 0, count = 0, row = 0;
  };
  std::vector<PromptRows> prompt_rows_;  // per scheduled sequence of the step
  std::vector<float> masked_logits_;  // a constrained request's logits with refused tokens at -inf
  std::shared_ptr<const grammar::TokenVocab> token_vocab_;  // built at the first constrained request
  std::vector<float> hidden_;  // final hidden states of the logits rows (when the proposer wants them)
  // Reused from step to step (no allocation in the steady state).
  Batch batch_;
  std::vector<int64_t> logit_row_;
  // Mean-pooled embedding requests: per scheduled sequence, its want_hidden rows (prompt positions
  // first .. first + count - 1 at hidden rows n_logit_rows_ + row ...).
  std::vector<PromptRows> pool_rows_;
  int64_t n_logit_rows_ = 0;
  std::unique_ptr<Proposer> proposer_;  // null: no speculative decoding
  std::vector<Request*> spec_reqs_;
  std::vector<int32_t> spec_limits_;
  KvEventSink kv_event_sink_;
  std::vector<int32_t> tree_depth_;                   // depth of each token of a draft tree (scratch)
  std::vector<std::vector<int32_t>> tree_prefix_;     // ... and per group the request's slots before it

  bool run_step();  // step() without the event flush
  // Adds request s's pooled rows of this step to its sum; the mean when its prefill is done.
  void pool_hidden(Request& r, size_t s);
  void flush_kv_events();
  // Fills batch_ and logit_row_ (the logits row of each scheduled request, -1 for none); the block
  // tables are moved in from the requests' copies, brought up to date with the new blocks only.
  void build_batch(const SchedulerOutput& plan);
  // Moves the block tables back to their requests.
  void return_block_tables(const SchedulerOutput& plan);
  // Asks the proposer for draft tokens of the running requests that are decoding (when few run).
  void propose_drafts();
  // For r's draft tree: each token's depth, and per group the slots of r's positions before n_known.
  void prepare_tree(const Request& r, int64_t n_known);
  // Adds draft token `node` of `r`'s tree: at the position of its depth,
  // its K/V in the slot of position n_known + node, attending a slot list of its own (the request's
  // positions before n_known, then its ancestors, then itself).
  void add_tree_node(const Request& r, int64_t node, int64_t n_known);
  // Samples `r`'s logits rows from `row` (its last known token) on, walking its draft: a chain, or a
  // tree (row 1 + i is draft token i). A draft token is kept when the sample of its parent's row equals
  // it. Emits each token. Moves the kept tokens' K/V of a tree to their positions. Returns the row of
  // the last token sampled, or -1 when `r` finished.
  int64_t accept_tokens(Request& r, int64_t row);
  // Tree drafts: the K/V of kept draft token path[d], computed in the slot of position n_known +
  // path[d], is copied to the slot of position n_known + d.
  void move_kept_kv(const Request& r, int64_t n_known, std::span<const int32_t> path);
  // Appends and streams one sampled token; finishes `r` (and returns false) on a stop or a limit.
  bool emit(Request& r, const SampleResult& sample);
  void emit_prompt_logprobs(Request& r, const PromptRows& rows);
  // Samples r's next token from `logits`: under its grammar's mask when it has one (nullopt: the
  // grammar allows no token, and r is finished with an error).
  std::optional<SampleResult> sample_next(Request& r, std::span<const float> logits);
  // The vocabulary as bytes for grammars (built once).
  const std::shared_ptr<const grammar::TokenVocab>& token_vocab();
  void record_verification(size_t n_draft, size_t n_accepted);
  void finish(Request& r, FinishReason reason, const std::string& error = "", std::vector<float> embedding = {});
  bool should_stop(const Request& r, int32_t token) const;
};

}  // namespace serval
