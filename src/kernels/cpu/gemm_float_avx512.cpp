// The float GEMM at the AVX-512 level (gemm_float.h): one vector is a group's 16 rows. A tile is G
// groups x T tokens with two accumulators each (the two chains): G = 1, T up to 8 for prompts; G = 4,
// T <= 2 for decoding, where the tile's independent chains hide the FMA latency. Per step the group's
// weights are loaded (and widened) once for the tile's tokens, each token's value broadcast.
//
// F16: VCVTPH2PS then VFMADD231PS. BF16: VDPBF16PS on a broadcast pair of activations
// (float_gemm_avx512_bf16), or, without AVX512_BF16, the same two steps per lane as FMAs on the
// widened odd and even halves under MXCSR.FTZ (float_gemm_avx512). Only float_gemm_avx512_bf16 uses a
// BF16 instruction (this file is compiled with -mavx512bf16 for it alone; it holds no __bf16 code).
#include <immintrin.h>

#include <algorithm>

#include "kernels/cpu/gemm_float.h"

namespace serval::cpu {
namespace {

enum class Kind { F16, Bf16Fma, Bf16Dot };

// MXCSR.FTZ and DAZ while a BF16 kernel runs (the flush VDPBF16PS does on its own), restored after.
struct FlushScope {
  unsigned saved;
  explicit FlushScope(bool on) : saved(_mm_getcsr()) {
    if (on) _mm_setcsr(saved | 0x8040u);
  }
  ~FlushScope() { _mm_setcsr(saved); }
};

inline void store_rows(float* dst, __m512 v, int64_t n) {
  if (n >= kFloatRows) _mm512_storeu_ps(dst, v);
  else if (n > 0) _mm512_mask_storeu_ps(dst, __mmask16((1u << n) - 1), v);
}

template <Kind K, int G, int T>
inline void tile(const PackedFloatWeights& w, const FloatActs& a, int64_t g, int64_t t, float* y) {
  __m512 acc[G][T][2];
  for (int i = 0; i < G; ++i)
    for (int j = 0; j < T; ++j) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
  const int64_t kpad = w.kpad;
  const uint16_t* wg[G];
  for (int i = 0; i < G; ++i) wg[i] = w.group(g + i);
  if constexpr (K == Kind::F16) {
    const float* xr[T];
    for (int j = 0; j < T; ++j) xr[j] = a.row(t + j);
    for (int64_t k = 0; k < kpad; k += 2) {
      for (int c = 0; c < 2; ++c) {
        __m512 wv[G];
        for (int i = 0; i < G; ++i)
          wv[i] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(wg[i] + (k + c) * kFloatRows)));
        for (int j = 0; j < T; ++j) {
          const __m512 xb = _mm512_set1_ps(xr[j][k + c]);
          for (int i = 0; i < G; ++i) acc[i][j][c] = _mm512_fmadd_ps(wv[i], xb, acc[i][j][c]);
        }
      }
    }
  } else if constexpr (K == Kind::Bf16Dot) {
    const uint32_t* pr[T];
    for (int j = 0; j < T; ++j) pr[j] = a.pair_row(t + j);
    for (int64_t s = 0; s < kpad / 2; s += 2) {
      for (int c = 0; c < 2; ++c) {
        __m512i wv[G];
        for (int i = 0; i < G; ++i)
          wv[i] = _mm512_load_si512(reinterpret_cast<const __m512i*>(wg[i] + (s + c) * 2 * kFloatRows));
        for (int j = 0; j < T; ++j) {
          const __m512i xb = _mm512_set1_epi32(int(pr[j][s + c]));
          for (int i = 0; i < G; ++i) acc[i][j][c] = _mm512_dpbf16_ps(acc[i][j][c], (__m512bh)wv[i], (__m512bh)xb);
        }
      }
    }
  } else {
    const float* xr[T];
    for (int j = 0; j < T; ++j) xr[j] = a.row(t + j);
    const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
    for (int64_t s = 0; s < kpad / 2; s += 2) {
      for (int c = 0; c < 2; ++c) {
        const int64_t k = 2 * (s + c);
        for (int i = 0; i < G; ++i) {
          const __m512i wv = _mm512_load_si512(reinterpret_cast<const __m512i*>(wg[i] + (s + c) * 2 * kFloatRows));
          const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(wv, high));
          const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
          for (int j = 0; j < T; ++j) {
            acc[i][j][c] = _mm512_fmadd_ps(odd, _mm512_set1_ps(xr[j][k + 1]), acc[i][j][c]);
            acc[i][j][c] = _mm512_fmadd_ps(even, _mm512_set1_ps(xr[j][k]), acc[i][j][c]);
          }
        }
      }
    }
  }
  for (int i = 0; i < G; ++i)
    for (int j = 0; j < T; ++j)
      store_rows(y + (t + j) * w.rows + (g + i) * kFloatRows, _mm512_add_ps(acc[i][j][0], acc[i][j][1]),
                 w.rows - (g + i) * kFloatRows);
}

template <Kind K, int G>
void token_tiles(const PackedFloatWeights& w, const FloatActs& a, int64_t g, int64_t t0, int64_t t1, float* y) {
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) tile<K, G, 8>(w, a, g, t, y);
  switch (t1 - t) {
    case 1: return tile<K, G, 1>(w, a, g, t, y);
    case 2: return tile<K, G, 2>(w, a, g, t, y);
    case 3: return tile<K, G, 3>(w, a, g, t, y);
    case 4: return tile<K, G, 4>(w, a, g, t, y);
    case 5: return tile<K, G, 5>(w, a, g, t, y);
    case 6: return tile<K, G, 6>(w, a, g, t, y);
    case 7: return tile<K, G, 7>(w, a, g, t, y);
    default: return;
  }
}

// Not inlined into the caller, so no vector arithmetic is moved across the MXCSR writes around it.
template <Kind K>
__attribute__((noinline)) void run(const PackedFloatWeights& w, const FloatActs& a, int64_t g0, int64_t g1,
                                   int64_t t0, int64_t t1, float* y) {
  if (t1 - t0 <= 2) {
    int64_t g = g0;
    for (; g + 4 <= g1; g += 4) {
      if (t1 - t0 == 2) tile<K, 4, 2>(w, a, g, t0, y);
      else tile<K, 4, 1>(w, a, g, t0, y);
    }
    for (; g < g1; ++g) {
      if (t1 - t0 == 2) tile<K, 1, 2>(w, a, g, t0, y);
      else tile<K, 1, 1>(w, a, g, t0, y);
    }
    return;
  }
  for (int64_t g = g0; g < g1; ++g) token_tiles<K, 1>(w, a, g, t0, t1, y);
}

}  // namespace

void float_gemm_avx512(const PackedFloatWeights& w, const FloatActs& a, int64_t g0, int64_t g1, int64_t t0,
                       int64_t t1, float* y) {
  if (w.source != DType::BF16) return run<Kind::F16>(w, a, g0, g1, t0, t1, y);
  const FlushScope flush(true);
  run<Kind::Bf16Fma>(w, a, g0, g1, t0, t1, y);
}

void float_gemm_avx512_bf16(const PackedFloatWeights& w, const FloatActs& a, int64_t g0, int64_t g1, int64_t t0,
                            int64_t t1, float* y) {
  if (w.source != DType::BF16) return run<Kind::F16>(w, a, g0, g1, t0, t1, y);
  const FlushScope flush(true);  // for the final add of the two chains (VDPBF16PS flushes by itself)
  run<Kind::Bf16Dot>(w, a, g0, g1, t0, t1, y);
}

}  // namespace serval::cpu
