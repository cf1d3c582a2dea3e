// cpu::lora_update (ops.h): the dispatch by ISA level, the split over the compute pool, and the scalar
// level. Two parallel jobs per call: A x for every (segment, row of A), then B (A x) for every
// (segment, chunk of 256 outputs); each value is one fixed-order loop over the token's own row.
#include <algorithm>
#include <vector>

#include "base/thread_pool.h"
#include "kernels/cpu/lora_levels.h"
#include "kernels/isa.h"
#include "kernels/ops.h"

namespace serval::cpu {

float lora_dot_scalar(const float* a, const float* x, int64_t n) {
  float acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * x[i];
  return acc;
}

void lora_expand_scalar(const float* bt, int64_t ld, int64_t rank, const float* m, float f, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0;
    for (int64_t r = 0; r < rank; ++r) acc += m[r] * bt[r * ld + i];
    y[i] += f * acc;
  }
}

namespace {

struct LoraLevel {
  float (*dot)(const float*, const float*, int64_t);
  void (*expand)(const float*, int64_t, int64_t, const float*, float, float*, int64_t);
};

LoraLevel lora_level() {
#if defined(SERVAL_X86_KERNELS)
  if (active_isa() >= Isa::Avx2) return {lora_dot_avx2, lora_expand_avx2};
#endif
  return {lora_dot_scalar, lora_expand_scalar};
}

}  // namespace

void lora_update(std::span<const LoraSegment> segments, int64_t in, int64_t out, const float* x, float* y) {
  const LoraLevel level = lora_level();
  // mid[s][k][r] = A_s row r . x[token k of s]: a task per (segment, row of A).
  std::vector<std::vector<float>> mid(segments.size());
  std::vector<std::pair<size_t, int64_t>> rows;
  for (size_t s = 0; s < segments.size(); ++s) {
    mid[s].resize(segments[s].tokens.size() * size_t(segments[s].rank));
    for (int64_t r = 0; r < segments[s].rank; ++r) rows.emplace_back(s, r);
  }
  parallel_for(int64_t(rows.size()), [&](int64_t i) {
    const auto [s, r] = rows[size_t(i)];
    const LoraSegment& g = segments[s];
    for (size_t k = 0; k < g.tokens.size(); ++k)
      mid[s][k * size_t(g.rank) + size_t(r)] = level.dot(g.a + r * in, x + g.tokens[k] * in, in);
  });
  // y += factor * B mid: a task per (segment, 256 outputs).
  constexpr int64_t kChunk = 256;
  std::vector<std::pair<size_t, int64_t>> chunks;
  for (size_t s = 0; s < segments.size(); ++s)
    for (int64_t i = 0; i < out; i += kChunk) chunks.emplace_back(s, i);
  parallel_for(int64_t(chunks.size()), [&](int64_t c) {
    const auto [s, i0] = chunks[size_t(c)];
    const LoraSegment& g = segments[s];
    const int64_t n = std::min(kChunk, out - i0);
    for (size_t k = 0; k < g.tokens.size(); ++k)
      level.expand(g.bt + i0, out, g.rank, mid[s].data() + k * size_t(g.rank), g.factors[k], y + g.tokens[k] * out + i0, n);
  });
}

}  // namespace serval::cpu
