// How one rank's share of a model is cut: pipeline stages own runs of layers, tensor-parallel ranks
// own attention heads (KV heads with them, replicated when there are fewer KV heads than ranks), FFN
// columns and rows of the output matrix (docs/scale-out.md). The default is the whole model.
#pragma once
#include <cstdint>
#include <utility>

namespace serval {

struct ModelConfig;

struct ShardLayout {
  int tp = 1, tp_rank = 0;  // tensor-parallel ranks of a stage, and this rank's index among them
  int pp = 1, stage = 0;    // pipeline stages, and this rank's stage
  int64_t layer_begin = 0, layer_end = 0;      // layers [begin, end) of this stage
  int64_t head_begin = 0, head_end = 0;        // query heads of this rank
  int64_t kv_head_begin = 0, kv_head_end = 0;  // KV heads of this rank
  int64_t vocab_begin = 0, vocab_end = 0;      // output rows (logits) of this rank, on the last stage

  bool split() const { return tp > 1 || pp > 1; }
  bool first_stage() const { return stage == 0; }
  bool last_stage() const { return stage == pp - 1; }
  // The process rank: stages one after another, the TP ranks of a stage consecutive.
  int rank() const { return stage * tp + tp_rank; }
};

// The share of TP rank `tp_rank` in pipeline stage `stage`; throws Error when the model cannot be split so.
ShardLayout make_shard_layout(const ModelConfig& config, int tp, int pp, int tp_rank, int stage);
// FFN columns [begin, end) of a TP rank: cut at multiples of `block_elems` (the quantization block of
// the down projection), as near to equal shares as that allows; throws Error when a share is empty.
std::pair<int64_t, int64_t> ffn_share(int64_t n_ff, int64_t block_elems, int tp, int tp_rank);

}  // namespace serval
