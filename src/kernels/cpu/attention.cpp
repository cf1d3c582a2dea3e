// Attention over the paged KV cache.
#include <algorithm>
#include <cmath>
#include <vector>

#include "base/thread_pool.h"
#include "kernels/ops.h"
#include "tensor/dequant.h"

namespace serval {
namespace cpu {

// Per KV head: each key and value row is loaded (converted from F16) once and used by every query
// head of its group. Per (head, key) the arithmetic is the same as one head at a time.
void attention(const AttentionShape& s, const float* q, KvLayerView kv, std::span<const int32_t> slots, float* out) {
  const int group = s.n_head / s.n_head_kv;
  const bool half = kv.type == DType::F16;
  const size_t n_keys = slots.size();
  std::vector<float> p(group * n_keys), qg(group * s.d_head), row(s.d_head);
  for (int g = 0; g < s.n_head_kv; ++g) {
    for (int i = 0; i < group * s.d_head; ++i) {
      const float x = q[g * group * s.d_head + i];
      qg[i] = half ? fp16_to_f32(f32_to_fp16(x)) : x;
    }
    for (size_t j = 0; j < n_keys; ++j) {
      kv.load(kv.k, slots[j], g * s.d_head, s.d_head, row.data());
      for (int h = 0; h < group; ++h) p[h * n_keys + j] = dot(qg.data() + h * s.d_head, row.data(), s.d_head) * s.scale;
    }
    std::vector<float> inv(group);
    for (int h = 0; h < group; ++h) {
      float* ph = p.data() + h * n_keys;
      const float mx = *std::max_element(ph, ph + n_keys);
      double sum = 0;
      for (size_t j = 0; j < n_keys; ++j) sum += (ph[j] = std::exp(ph[j] - mx));
      inv[h] = float(1.0 / sum);
      std::fill(out + (g * group + h) * s.d_head, out + (g * group + h + 1) * s.d_head, 0.0f);
    }
    for (size_t j = 0; j < n_keys; ++j) {
      kv.load(kv.v, slots[j], g * s.d_head, s.d_head, row.data());
      for (int h = 0; h < group; ++h) {
        const float w = p[h * n_keys + j] * inv[h];
        const float pj = half ? fp16_to_f32(f32_to_fp16(w)) : w;
        float* o = out + (g * group + h) * s.d_head;
#pragma omp simd
        for (int d = 0; d < s.d_head; ++d) o[d] += pj * row[d];
      }
    }
  }
}

void attention_batch(const AttentionShape& s, std::span<const AttentionQuery> queries, KvLayerView kv) {
  parallel_for(int64_t(queries.size()), [&](int64_t i) {
    const AttentionQuery& a = queries[i];
    std::vector<int32_t> slots(a.keys.size());
    for (int64_t p = a.keys.first; p <= a.keys.last; ++p) slots[p - a.keys.first] = a.keys.slot(p);
    attention(s, a.q, kv, slots, a.out);
  });
}

}  // namespace cpu
}  // namespace serval
