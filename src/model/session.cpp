#include "model/session.h"

#include <numeric>

#include "base/error.h"

namespace serval {

SingleSequence::SingleSequence(const Model& model, int64_t n_ctx, DType kv_type)
    : model_(model), n_ctx_(n_ctx), kv_(model.config(), n_ctx, kv_type) {
  check(n_ctx > 0, "context size must be positive");
  slot_table_.resize(n_ctx);
  std::iota(slot_table_.begin(), slot_table_.end(), 0);
}

void SingleSequence::rewind(int64_t n) {
  check(n >= 0 && n <= n_past_, "rewind to {} of a sequence of {} tokens", n, n_past_);
  n_past_ = n;
}

std::vector<float> SingleSequence::eval(std::span<const int32_t> tokens, bool all_logits, int64_t n_batch) {
  check(n_past_ + int64_t(tokens.size()) <= n_ctx_, "sequence of {} tokens exceeds the context size {}",
        n_past_ + tokens.size(), n_ctx_);
  std::vector<float> out, logits;
  for (size_t start = 0; start < tokens.size(); start += n_batch) {
    const size_t end = std::min(tokens.size(), start + size_t(n_batch));
    Batch batch(model_.config().n_kv_groups());
    for (auto& g : batch.block_tables) g = {slot_table_};
    for (size_t i = start; i < end; ++i) {
      const int32_t pos = int32_t(n_past_ + i);
      batch.add(tokens[i], pos, 0, pos, all_logits || i + 1 == tokens.size());
    }
    if (adapter_ >= 0) {
      batch.adapter.assign(batch.size(), int16_t(adapter_));
      batch.adapter_scale.assign(batch.size(), adapter_scale_);
    }
    model_.forward(batch, kv_, logits);
    out.insert(out.end(), logits.begin(), logits.end());
  }
  n_past_ += int64_t(tokens.size());
  return out;
}

}  // namespace serval
