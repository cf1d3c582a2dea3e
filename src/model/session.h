// One sequence evaluated incrementally over a contiguous KV cache: the simple driver behind
// `serval generate` and `serval perplexity` (the engine schedules many sequences over pages).
#pragma once
#include <span>
#include <vector>

#include "model/model.h"

namespace serval {

class SingleSequence {
 public:
  // A sequence of at most `n_ctx` tokens.
  SingleSequence(const Model& model, int64_t n_ctx, DType kv_type = DType::F16);

  // Appends `tokens` (evaluated in chunks of `n_batch`); returns logits [n, n_vocab] of the last
  // token, or of every appended token when `all_logits`. Throws Error past the context size.
  std::vector<float> eval(std::span<const int32_t> tokens, bool all_logits = false, int64_t n_batch = 512);
  // Forgets all tokens (the KV memory is reused).
  void reset() { n_past_ = 0; }
  // Forgets the tokens from position `n` on (0 <= n <= n_past()); the KV of positions < n is kept, as
  // later tokens only write the slots of their own positions.
  void rewind(int64_t n);
  int64_t n_past() const { return n_past_; }
  // Every later token's products use LoRA adapter `adapter` (an index into Model::adapters(), -1 none).
  void set_adapter(int adapter, float scale = 1.0f) { adapter_ = adapter, adapter_scale_ = scale; }
  int64_t n_ctx() const { return n_ctx_; }

 private:
  const Model& model_;
  int64_t n_ctx_;
  KvCache kv_;
  std::vector<int32_t> slot_table_;  // position p lives in slot p
  int64_t n_past_ = 0;
  int adapter_ = -1;
  float adapter_scale_ = 1.0f;
};

}  // namespace serval
