#include "model/shard.h"

#include "base/error.h"
#include "io/ggml_types.h"
#include "model/config.h"

namespace serval {
namespace {

// Query heads [begin, end) and KV heads of TP rank r: KV heads split evenly when there are at least
// as many as ranks, else each KV head replicated over tp / n_head_kv ranks that split its query heads.
void split_heads(const ModelConfig& c, int tp, int r, ShardLayout& s) {
  const int64_t group = c.n_head / c.n_head_kv;
  if (c.n_head_kv >= tp) {
    s.kv_head_begin = r * c.n_head_kv / tp;
    s.kv_head_end = (r + 1) * c.n_head_kv / tp;
    s.head_begin = s.kv_head_begin * group;
    s.head_end = s.kv_head_end * group;
    return;
  }
  check(tp % c.n_head_kv == 0, "--tp {} must be a multiple of the model's {} KV heads (or divide them)", tp, c.n_head_kv);
  const int64_t reps = tp / c.n_head_kv, sub = r % reps;
  check(group >= reps, "--tp {} is more than the model's {} query heads", tp, c.n_head);
  s.kv_head_begin = r / reps;
  s.kv_head_end = s.kv_head_begin + 1;
  s.head_begin = s.kv_head_begin * group + sub * group / reps;
  s.head_end = s.kv_head_begin * group + (sub + 1) * group / reps;
}

}  // namespace

ShardLayout make_shard_layout(const ModelConfig& c, int tp, int pp, int tp_rank, int stage) {
  check(tp >= 1 && pp >= 1, "--tp and --pp must be at least 1");
  check(pp <= c.n_layer, "--pp {} is more than the model's {} layers", pp, c.n_layer);
  check(tp_rank >= 0 && tp_rank < tp && stage >= 0 && stage < pp, "rank outside --tp {} --pp {}", tp, pp);
  ShardLayout s;
  s.tp = tp, s.tp_rank = tp_rank, s.pp = pp, s.stage = stage;
  s.layer_begin = stage * c.n_layer / pp;
  s.layer_end = (stage + 1) * c.n_layer / pp;
  split_heads(c, tp, tp_rank, s);
  check(s.head_end > s.head_begin, "--tp {} leaves rank {} without attention heads", tp, tp_rank);
  s.vocab_begin = tp_rank * c.n_vocab / tp;
  s.vocab_end = (tp_rank + 1) * c.n_vocab / tp;
  return s;
}

std::pair<int64_t, int64_t> ffn_share(int64_t n_ff, int64_t block_elems, int tp, int tp_rank) {
  check(n_ff % block_elems == 0, "FFN width {} is not a whole number of {}-element blocks", n_ff, block_elems);
  const int64_t blocks = n_ff / block_elems;
  auto cut = [&](int64_t r) { return (r * blocks + tp / 2) / tp * block_elems; };  // nearest block boundary
  const int64_t begin = cut(tp_rank), end = tp_rank + 1 == tp ? n_ff : cut(tp_rank + 1);
  check(end > begin, "--tp {} leaves rank {} no FFN columns ({} blocks of {})", tp, tp_rank, blocks, block_elems);
  return {begin, end};
}

}  // namespace serval
