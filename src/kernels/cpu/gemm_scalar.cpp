// The packed GEMM in portable C++: the arithmetic of packed.h one element at a time. It is the
// Isa::Scalar level, and the SIMD levels must agree with it bitwise.
#include <cmath>

#include "kernels/cpu/packed.h"
#include "tensor/blocks.h"

namespace serval::cpu {
namespace {

int value_at(const PackedWeights& w, const uint8_t* blk, int r, int k) {
  const int k4 = k / 4, i = k % 4;
  if (!w.nibbles) return blk[k4 * 64 + 4 * r + i];
  const uint8_t byte = blk[(k4 % 4) * 64 + 4 * r + i];
  const int low = k4 < 4 ? byte & 0x0F : byte >> 4;
  if (w.fp4_codes) return kFp4Table[low];
  const int j = 4 * r + i;  // byte j of vector k4
  int v = low;
  for (int p = 0; p < w.planes; ++p) {  // plane p holds bit 4 + p
    const uint8_t* plane = blk + 256 + 64 * p;
    const int bit = w.plane_by_value ? plane[j] >> k4 : plane[8 * k4 + j / 8] >> (j % 8);
    v |= (bit & 1) << (4 + p);
  }
  return v;
}

float dot_row(const PackedWeights& w, const PackedActs& x, int64_t g, int r, int64_t t) {
  const int8_t* xq = x.row(t);
  const float* xd = x.d.data() + t * x.n_blocks;
  const int32_t* xs = x.sums.data() + t * x.n_blocks * 2;
  float acc = 0.0f;
  for (int64_t sup = 0; sup < w.n_super; ++sup) {
    int32_t isum = 0, msum = 0;
    for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
      const uint8_t* blk = w.block(g, b);
      int32_t s[2] = {0, 0};
      for (int k = 0; k < kPackBlock; ++k) s[k / 16] += value_at(w, blk, r, k) * xq[b * kPackBlock + k];
      for (int h = 0; h < 2; ++h) {
        const size_t i = w.int_index(g, b) + (w.split ? h : 0) * kPackRows + r;
        const int32_t part = s[h] - w.offset * xs[2 * b + h];
        isum += w.has_sub ? w.sub[i] * part : part;
        if (w.mins) msum += w.min[i] * xs[2 * b + h];
      }
    }
    const size_t f = w.super_index(g, sup) + r;
    const float d = xd[sup * w.sb];
    const float sc = w.fp4_codes ? e8m0_half(w.scale_e8m0[f]) : w.scale[f];
    acc = std::fma(sc * d, float(isum), acc);
    if (w.mins) acc = std::fma(w.neg_min[f] * d, float(msum), acc);
  }
  return acc;
}

}  // namespace

void packed_gemm_scalar(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                        float* y) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t t = t0; t < t1; ++t)
      for (int r = 0; r < kPackRows && g * kPackRows + r < w.rows; ++r) y[t * w.rows + g * kPackRows + r] = dot_row(w, x, g, r, t);
}

}  // namespace serval::cpu
