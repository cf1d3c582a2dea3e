// A loaded model (config, weights, tokenizer) and its forward pass over one flattened batch.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "base/huge_pages.h"
#include "model/lora.h"
#include "model/weights.h"
#include "tokenizer/tokenizer.h"

namespace serval {

// K and V of every layer in slots of kv_dim elements (F16 by default, as llama.cpp; F32, BF16, Q8_0 or
// F8_E4M3). Each KV group (see ModelConfig::kv_group) has its own slot space; a sequence maps
// positions to slots. A token's K and V are quantized alone (Q8_0: blocks of 32 values of one head;
// F8_E4M3: a fixed scale per layer and KV head, 1 unless set, and V rotated per head, see
// KvLayerView::v_rotated): the bytes never depend on the batch. For these two types the model stores
// keys minus a fixed centre per layer (Model::KCentring).
class KvCache {
 public:
  // `n_slots[g]` slots for group g.
  KvCache(const ModelConfig& config, std::vector<int64_t> n_slots, DType type = DType::F16);
  // The same number of slots in every group.
  KvCache(const ModelConfig& config, int64_t n_slots, DType type = DType::F16);
  int64_t n_slots(int group = 0) const { return n_slots_[group]; }
  int n_groups() const { return int(n_slots_.size()); }
  int64_t kv_dim() const { return kv_dim_; }
  DType type() const { return type_; }
  // Bytes of K and V per token per layer.
  size_t bytes_per_slot_per_layer() const { return (shared_v_ ? 1 : 2) * row_bytes_; }
  // F8_E4M3: the scale of KV head `head` of `layer` (stored = value / scale). Set before any write.
  float head_scale(int64_t layer, int64_t head) const { return head_scale_[layer * n_head_kv_ + head]; }
  void set_head_scale(int64_t layer, int64_t head, float scale);
  // Stores one token's K and V (kv_dim floats each) of `layer` in `slot` of the layer's group. MLA
  // (ModelConfig::mla): one row, the latent and the rotated key; `v` is ignored (null) and view()
  // gives the K pool as V.
  void write(int64_t layer, int32_t slot, const float* k, const float* v);
  // Copies K and V of slot `from` to slot `to` in every layer of KV group `group`.
  void copy_slot(int group, int32_t from, int32_t to);
  // Slot copies since the last call, when this cache leads a split model (the other ranks replay them).
  struct SlotCopy {
    int32_t group, from, to;
  };
  std::vector<SlotCopy> take_copies() { return std::exchange(copies_, {}); }
  // The layer's pools for the attention kernel.
  KvLayerView view(int64_t layer) const;
  uint64_t bytes() const;

 private:
  std::vector<int64_t> n_slots_;
  std::vector<int> layer_group_;
  int64_t kv_dim_;
  DType type_;
  int64_t d_head_, n_head_kv_;
  size_t row_bytes_;                // bytes of one slot's K (or V) row of a layer
  std::vector<float> head_scale_;  // [layer][local KV head]
  bool v_rotated_;                  // F8_E4M3 with a power-of-two head size: V stored rotated (KvLayerView)
  bool shared_v_;                   // MLA: no V pools; V is the K rows
  // Uninitialized on purpose: pages are only touched (and become resident) when written. On huge
  // pages (base/huge_pages.h): attention reads a sequence's blocks scattered over the pool.
  struct Pool {
    HugeBuffer data;
    size_t bytes = 0;
  };
  std::vector<Pool> k_, v_;
  bool record_copies_ = false;
  std::vector<SlotCopy> copies_;
};

// One step's tokens from any number of sequences, each with its position and, per KV group, the
// slot it writes and the block table of its sequence.
struct Batch {
  explicit Batch(int n_groups = 1) : slots(n_groups), block_tables(n_groups) {}

  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;
  std::vector<int32_t> seq_ids;  // index into block_tables[g]
  std::vector<uint8_t> want_logits;
  // [token] (empty: none): rows whose final hidden state is wanted without their logits (mean pooling
  // of a decoder embedder); forward() appends them to `hidden` after the want_logits rows.
  std::vector<uint8_t> want_hidden;
  std::vector<std::vector<int32_t>> slots;  // [group][token]: slot this token's K/V is written to
  // [group][sequence]: the sequence's block table, covering positions 0..max position in this batch
  // (earlier tokens included): position p is in slot table[p / block_size] * block_size +
  // p % block_size. Blocks wholly outside a sliding window may be -1. With block_size 1 the table
  // lists one slot per position.
  std::vector<std::vector<std::vector<int32_t>>> block_tables;
  int32_t block_size = 1;
  // [sequence]: the block size of that sequence's tables when set, else block_size. A token of a
  // draft tree attends its own list of slots (block size 1): the sequence's earlier positions, then
  // its ancestors in the tree.
  std::vector<int32_t> table_block_size;
  int32_t block_size_of(int32_t seq) const {
    return size_t(seq) < table_block_size.size() ? table_block_size[size_t(seq)] : block_size;
  }

  // [token]: the LoRA adapter (an index into Model::adapters(), -1 none) and the user scale each token's
  // products use; empty: no adapter for any token.
  std::vector<int16_t> adapter;
  std::vector<float> adapter_scale;

  // Appends one token writing `slot` in every group.
  void add(int32_t token, int32_t pos, int32_t seq, int32_t slot, bool logits);
  size_t size() const { return tokens.size(); }
  int n_groups() const { return int(slots.size()); }
};

struct LoadOptions {
  std::string tokenizer_json;  // optional: override the tokenizer with a Hugging Face tokenizer.json
  // Load only the share of TP rank `tp_rank` of pipeline stage `stage` (shard.h); 1 x 1: everything.
  int tp = 1, pp = 1, tp_rank = 0, stage = 0;
  // vLLM's --load-format dummy: the weights are generated (model/dummy.h) from the GGUF header of
  // `path`, a shape file or any GGUF file, whose data is not read.
  bool dummy = false;
  uint64_t dummy_seed = 0;
  // Compute logits for the vocabulary's first `logit_rows` tokens only (0, or at least n_vocab: all):
  // the output matrix is cut to those rows, so forward() writes rows of that width (n_logits()). For a draft model, whose
  // guesses the target verifies: FR-Spec's reduced head (docs/speculative.md). Not with tp x pp > 1.
  int64_t logit_rows = 0;
  // The matrices requantized to this type as they load (model/requant.h: the bytes `serval quantize
  // --allow-requantize --pure` writes); none: as in the file. For a draft model: a cheaper pass.
  std::optional<DType> requant;
};

// What a rank's share of the forward pass needs from the other ranks (dist/ implements it over a
// communication layer; the model code knows nothing of MPI).
class ShardIo {
 public:
  virtual ~ShardIo() = default;
  // Sums x over the TP ranks of this stage, in rank order (the same bits on every rank).
  virtual void tp_sum(float* x, int64_t n) = 0;
  // The activations from the previous pipeline stage / to the next one.
  virtual void recv_prev(float* x, int64_t n) = 0;
  virtual void send_next(const float* x, int64_t n) = 0;
};

// Runs Model::forward of a split model on the leader rank (it sends the step to the other ranks).
class ForwardDriver {
 public:
  virtual ~ForwardDriver() = default;
  virtual void forward(const Batch& batch, KvCache& kv, std::vector<float>& logits, std::vector<float>* hidden) = 0;
};

// Sees the input rows x[n_tok][cols] of a weight matrix product during Model::forward, with the
// matrix's GGUF name ("blk.0.attn_q.weight", ..., "output.weight", also when the output is tied to the
// embedding). The fused products (q/k/v, gate/up) report the same input once per weight. It is called
// on the thread that runs forward, between the parallel kernels (never concurrently with itself), so it
// needs no locking unless one observer serves several models running on different threads. `x` is
// valid only during the call. A split model (--tp) reports this rank's share of the columns.
using MatmulObserver = std::function<void(const std::string& weight_name, const float* x, int64_t n_tok, int64_t cols)>;
// The same for the experts of a mixture-of-experts layer: the rows x[n_rows][cols] that expert
// `expert` (of n_expert) multiplied with its slice of the stacked weight ("blk.1.ffn_gate_exps.weight",
// ffn_up_exps, ffn_down_exps). Same threading rules (the experts run one after another while it is set).
using ExpertObserver = std::function<void(const std::string& weight_name, int64_t expert, int64_t n_expert, const float* x,
                                          int64_t n_rows, int64_t cols)>;

class Model {
 public:
  // Loads a GGUF file, a .safetensors file or a Hugging Face model directory; throws Error.
  static std::unique_ptr<Model> load(const std::string& path, const LoadOptions& options = {});
  virtual ~Model() = default;

  const ModelConfig& config() const { return config_; }
  // The width of forward()'s logit rows: n_vocab, or LoadOptions::logit_rows where that cut it.
  int64_t n_logits() const { return config_.logit_rows > 0 ? config_.logit_rows : config_.n_vocab; }
  // Row `token` of the output matrix as floats [n_embd] (a decoder reranker scores the final hidden
  // state against the rows of its yes / no tokens). Not on a split model.
  std::vector<float> output_row(int32_t token) const;
  const ModelWeights& weights() const { return weights_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const std::string& path() const { return path_; }

  // Runs the batch; writes logits [rows with want_logits, n_vocab] in batch order and, when `hidden` is
  // given, the same rows' final hidden states (after the output norm) [rows, n_embd], then those of
  // the want_hidden rows.
  void forward(const Batch& batch, KvCache& kv, std::vector<float>& logits, std::vector<float>* hidden = nullptr) const;
  // Only the final hidden states of the want_logits rows (no output matrix: cheap for training heads).
  void forward_hidden(const Batch& batch, KvCache& kv, std::vector<float>& hidden) const;
  // This rank's share of forward (config().shard): the first stage embeds the tokens, others receive
  // the activations; its layers; the last stage's ranks return true with the output-normed rows in
  // `hidden` (when given) and their rows of the logits [n_out, vocab_end - vocab_begin]; other stages
  // send the activations on and return false. With `io` null the model must not be split. Over
  // several stages a batch of enough tokens runs as micro-batches (micro_batches()), so that the
  // stages overlap; every row's result is the same either way (batch invariance).
  bool forward_shard(const Batch& batch, KvCache& kv, ShardIo* io, std::vector<float>& logits,
                     std::vector<float>* hidden) const;
  // Makes forward() go through `driver` (a split model's leader rank).
  void set_driver(std::shared_ptr<ForwardDriver> driver) { driver_ = std::move(driver); }
  // Calls `observer` with the input of every weight matrix product of later forward passes (empty:
  // none; the default, costing one test per product). Not to be changed while a forward runs.
  void set_matmul_observer(MatmulObserver observer) { observer_ = std::move(observer); }
  // Calls `observer` with the inputs of every expert's products (the router's and shared expert's go
  // to the matmul observer); empty: none.
  void set_expert_observer(ExpertObserver observer) { expert_observer_ = std::move(observer); }
  // LoRA adapters that batches may name per token (Batch::adapter); set before serving, or between
  // forward passes on the thread that runs them.
  void set_adapters(std::vector<std::shared_ptr<const LoraAdapter>> adapters) { adapters_ = std::move(adapters); }
  // Puts `adapter` at index `id` (growing the list), or empties that slot (null: an unloaded adapter,
  // which no batch may name any more). Same rule as set_adapters.
  void set_adapter(size_t id, std::shared_ptr<const LoraAdapter> adapter);
  const std::vector<std::shared_ptr<const LoraAdapter>>& adapters() const { return adapters_; }
  // Whether slot `id` holds an adapter. Safe on any thread while set_adapter runs on the forward
  // passes' thread (a request is checked on the caller's thread before it is queued).
  bool has_adapter(int32_t id) const;
  // Keys are centred before a quantized (q8_0, fp8_e4m3) cache stores them: a fixed vector per layer,
  // the rotary mean of the layer's K bias (k_centres()), is subtracted from every key. A query's scores
  // then all move by the same amount (q . centre), which softmax cancels, so attention is unchanged in
  // exact arithmetic; what changes is that the cache no longer spends its range on Qwen's K-bias
  // outliers (|b| up to 354). Always/Never are for tests and measurements.
  enum class KCentring { QuantizedCaches, Always, Never };
  void set_k_centring(KCentring mode) { k_centring_ = mode; }
  // The context length the model runs with (--max-model-len): LongRoPE models take their long factors
  // when it exceeds the original context, else the short ones (llama.cpp's rule). Load sets the
  // model's own context length. Call before any forward pass.
  void set_context_length(int64_t n_ctx);
  bool uses_long_rope() const { return long_rope_; }
  // Per layer, this rank's kv_dim centre (empty where the layer has no K bias or uses QK-norm): the
  // layer's K bias rotated by RoPE and averaged over positions 0 .. n_ctx_train - 1.
  const std::vector<std::vector<float>>& k_centres() const { return k_centres_; }
  // Mixture of experts: tokens each expert of each layer has run since load ([layer][expert]).
  uint64_t expert_tokens(int64_t layer, int64_t expert) const {
    return expert_tokens_[size_t(layer * config_.n_expert + expert)].load(std::memory_order_relaxed);
  }

 protected:
  Model() = default;
  std::string path_;
  ModelConfig config_;
  ModelWeights weights_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::shared_ptr<ForwardDriver> driver_;
  MatmulObserver observer_;
  ExpertObserver expert_observer_;

 private:
  std::vector<std::vector<float>> compute_k_centres() const;
  // The centre subtracted from layer il's keys before `kv` stores them, or null.
  const float* k_centre(int64_t il, const KvCache& kv) const;
  std::vector<std::vector<float>> k_centres_;
  std::vector<float> rope_div_;     // per pair: the angle is divided by it (Llama 3 factors, LongRoPE's set)
  std::vector<double> yarn_ramp_;   // per pair: YaRN's extrapolation weight
  bool long_rope_ = false;
  bool context_set_ = false;  // set_context_length has run (at load)
  mutable std::vector<std::atomic<uint64_t>> expert_tokens_;  // [layer][expert], counted by forward
  KCentring k_centring_ = KCentring::QuantizedCaches;
  std::vector<std::shared_ptr<const LoraAdapter>> adapters_;
  mutable std::mutex adapters_mu_;  // set_adapter against has_adapter on another thread
  // y[t] += factor * B (A x[t]) for each token t whose adapter changes layer il's `target`; x is
  // [n_tok][cols], y [n_tok][out]. A token's rows are computed alone (the other tokens and adapters of
  // the batch do not change them).
  void apply_lora(int64_t il, LoraTarget target, const Batch& batch, const float* x, int64_t cols, float* y) const;
  // y [m][out] += each row's adapter update of the product `pair_of(adapter)` gives (null or empty:
  // none), of x [m][cols]; row i is the batch's token tokens[i] (tokens null: token i).
  void lora_rows(const Batch& batch, const std::function<const LoraPair*(const LoraAdapter&)>& pair_of,
                 const int64_t* tokens, int64_t m, const float* x, int64_t cols, float* y) const;

  // Reports x[n_tok][cols] to the observer, if any, as the input of "blk.{il}.{kind}.weight" for each
  // kind (il < 0: the un-numbered "{kind}.weight").
  void observe(int64_t il, std::initializer_list<const char*> kinds, const float* x, int64_t n_tok, int64_t cols) const;
  void validate_batch(const Batch& batch, const KvCache& kv) const;
  // The micro-batches a pipeline stage runs a batch of n_tok tokens in: [begin, end) token ranges.
  std::vector<std::pair<int64_t, int64_t>> micro_batches(int64_t n_tok) const;
  bool forward_rows(const Batch& batch, KvCache& kv, ShardIo* io, std::vector<float>& logits,
                    std::vector<float>* hidden) const;
  // cos and sin of every rotary angle of every token of a batch ([token][d_head / 2]), for the global
  // layers (index 0) or the sliding-window ones (1): computed once per forward, not once per layer.
  struct RopeTable {
    std::vector<float> cs, sn;
  };
  RopeTable rope_table(const Batch& batch, bool swa_layer) const;
  // The rotary angle of pair i at position `pos` (rope_table's, and k_centres' per-position step).
  double rope_angle(double pos, int64_t i, bool swa_layer) const;
  // YaRN's extrapolation weight of each pair (1: angle kept, 0: divided by the factor); empty: no YaRN.
  void init_yarn();
  void apply_rope(float* vec, int64_t n_heads, const float* cs, const float* sn) const;
  void attention_block(int64_t il, const Batch& batch, const RopeTable* ropes, KvCache& kv, std::vector<float>& x,
                       ShardIo* io) const;
  // Multi-head latent attention (ModelConfig::mla) of layer il, absorbed: the cache row of each token,
  // each head's query turned into latent space, one KV head shared by all, the output's latent part
  // turned into the head's values. Adds the output projection to x.
  // Split over TP ranks: this rank's heads, the output's partial sums added over the ranks.
  void mla_attention_block(int64_t il, const Batch& batch, const RopeTable& rope, KvCache& kv, std::vector<float>& x,
                           ShardIo* io) const;
  void ffn_block(int64_t il, const Batch& batch, std::vector<float>& x, ShardIo* io) const;
  // This rank's layers over the batch, then (last stage) the output norm of the want_logits rows into
  // `rows`; false on other stages (the activations went to the next one).
  bool final_rows(const Batch& batch, KvCache& kv, std::vector<float>& rows, ShardIo* io = nullptr) const;
};

}  // namespace serval
