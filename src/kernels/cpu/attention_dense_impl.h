// Encoder attention for one (span, head), written once in plain loops and compiled by each level's file
// (attention.cpp, attention_avx2.cpp, attention_avx512.cpp) with that level's flags and no FMA
// contraction: the compiler vectorises the loops, every lane runs the same IEEE operations in the same
// order, so the levels agree bitwise (as the tile kernels do).
//
// The span's keys are transposed once into [d][key] rows padded to 16 keys with zeros. A query's scores
// are taken 16 keys at a time in a local accumulator (a register at the SIMD levels), each score the sum
// of its products in d order; the softmax subtracts the row's max, takes e^x 16 lanes at a time
// (exp_lanes) and sums in double; the output, for
// the common head sizes a local accumulator too, adds its terms in key order. Queries go kDenseQueries
// at a time, so that their chains overlap (without FMA contraction each step is a multiply and an add).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/attention_tile.h"

namespace serval::cpu::attn {
// Internal linkage: each level's file compiles its own copy with its own flags (one shared inline copy
// would let the linker pick any level's code for all).
namespace {

constexpr int kDenseKeys = 16;
// 16 floats as one value (GCC/Clang vector extension): one AVX-512 register, two AVX2 ones, four SSE
// ones at the scalar level's baseline; the operations are lane by lane either way.
using Lanes = float __attribute__((vector_size(64)));
inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_lanes(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }
using LanesI = int32_t __attribute__((vector_size(64)));
inline Lanes select_lanes(LanesI m, Lanes t, Lanes f) { return Lanes((m & LanesI(t)) | (~m & LanesI(f))); }

// e^a lane by lane for a <= 0 (softmax's score minus the row's max): a = n ln2 + r with n = round(a
// log2 e), e^r by its Taylor polynomial to degree 7 on |r| <= ln2 / 2 (relative error below 2^-23),
// times 2^n through the exponent bits. Below -87 (e^a < 2^-125) the result is 0, a NaN stays NaN.
inline Lanes exp_lanes(Lanes a) {
  const LanesI under = a < -87.0f, nan = a != a;
  a = select_lanes(under | nan, Lanes{} + -87.0f, a);
  const LanesI ni = -__builtin_convertvector(0.5f - a * 1.44269504088896341f, LanesI);  // a <= 0: round
  const Lanes n = __builtin_convertvector(ni, Lanes);
  const Lanes r = (a - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  Lanes p = r * (1.0f / 5040) + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Lanes e = Lanes(LanesI(p) + (ni << 23));
  return select_lanes(nan, Lanes{} + __builtin_nanf(""), select_lanes(under, Lanes{}, e));
}

// kQ queries from query i0 (their scores' chains and their outputs' chains are independent, so they
// overlap; each is the same sequence of operations as alone). kD: the head size (a multiple of 16), or
// 0 for any (read from a.d_head); the results are the same either way.
template <int kD, int kQ>
void dense_queries(const DenseArgs& a, const float* __restrict kt, int64_t n_pad, int64_t i0, float* __restrict p) {
  const int64_t D = kD ? kD : a.d_head, n = a.n;
  const float* qs[kQ];
  for (int q = 0; q < kQ; ++q) qs[q] = a.q + (a.begin + i0 + q) * a.q_stride;
  for (int64_t j0 = 0; j0 < n_pad; j0 += kDenseKeys) {
    Lanes acc[kQ] = {};
    for (int64_t d = 0; d < D; ++d) {
      const Lanes kv = load_lanes(kt + d * n_pad + j0);
      for (int q = 0; q < kQ; ++q) acc[q] += qs[q][d] * kv;
    }
    for (int q = 0; q < kQ; ++q) store_lanes(p + q * n_pad + j0, acc[q] * a.scale);
  }
  float inv[kQ];
  for (int q = 0; q < kQ; ++q) {
    float* __restrict pq = p + q * n_pad;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, pq[j]);
    for (int64_t j0 = 0; j0 < n_pad; j0 += kDenseKeys) store_lanes(pq + j0, exp_lanes(load_lanes(pq + j0) - mx));
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += pq[j];
    inv[q] = float(1.0 / sum);
  }
  if constexpr (kD > 0) {
    constexpr int kC = kD / kDenseKeys;
    Lanes acc[kQ][kC] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float* __restrict vj = a.v + (a.begin + j) * a.kv_stride;
      for (int q = 0; q < kQ; ++q) {
        const float w = p[q * n_pad + j] * inv[q];
        for (int c = 0; c < kC; ++c) acc[q][c] += w * load_lanes(vj + kDenseKeys * c);
      }
    }
    for (int q = 0; q < kQ; ++q)
      for (int c = 0; c < kC; ++c) store_lanes(a.out + (a.begin + i0 + q) * a.q_stride + kDenseKeys * c, acc[q][c]);
  } else {
    for (int q = 0; q < kQ; ++q) {
      float* __restrict o = a.out + (a.begin + i0 + q) * a.q_stride;
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float w = p[q * n_pad + j] * inv[q];
        const float* __restrict vj = a.v + (a.begin + j) * a.kv_stride;
        for (int64_t d = 0; d < D; ++d) o[d] += w * vj[d];
      }
    }
  }
}

template <int kD>
void dense_head_impl(const DenseArgs& a) {
  const int64_t D = kD ? kD : a.d_head, n = a.n, n_pad = dense_padded(n);
  float* __restrict kt = a.scratch;  // [D][n_pad]
  float* __restrict p = kt + D * n_pad;  // [kDenseQueries][n_pad]
  for (int64_t j = 0; j < n_pad; ++j) {
    const float* kj = a.k + (a.begin + j) * a.kv_stride;
    for (int64_t d = 0; d < D; ++d) kt[d * n_pad + j] = j < n ? kj[d] : 0.0f;
  }
  int64_t i = 0;
  for (; i + kDenseQueries <= n; i += kDenseQueries) dense_queries<kD, kDenseQueries>(a, kt, n_pad, i, p);
  for (; i < n; ++i) dense_queries<kD, 1>(a, kt, n_pad, i, p);
}

inline void dense_head_any(const DenseArgs& a) {
  switch (a.d_head) {
    case 32: return dense_head_impl<32>(a);
    case 64: return dense_head_impl<64>(a);
    case 128: return dense_head_impl<128>(a);
    default: return dense_head_impl<0>(a);
  }
}

}  // namespace
}  // namespace serval::cpu::attn
