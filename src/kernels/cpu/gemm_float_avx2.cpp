// The float GEMM at the AVX2 level (gemm_float.h): a group's 16 rows are two vectors of 8. A tile is
// H half-groups x T tokens with two accumulators each (the two chains): H = 2 (one group), T up to 3
// for prompts; H = 4 (two groups), T = 1 for decoding. F16: VCVTPH2PS then VFMADD231PS. BF16: the
// odd and even values of each pair widened by a mask and a shift, then the two FMAs of VDPBF16PS's
// lane in its order, under MXCSR.FTZ (its output flush).
#include <immintrin.h>

#include <algorithm>

#include "kernels/cpu/gemm_float.h"

namespace serval::cpu {
namespace {

constexpr int kHalf = 8;

struct FlushScope {
  unsigned saved;
  explicit FlushScope(bool on) : saved(_mm_getcsr()) {
    if (on) _mm_setcsr(saved | 0x8040u);
  }
  ~FlushScope() { _mm_setcsr(saved); }
};

inline void store_rows(float* dst, __m256 v, int64_t n) {
  if (n >= kHalf) return _mm256_storeu_ps(dst, v);
  if (n <= 0) return;
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_maskstore_ps(dst, mask, v);
}

// H half-groups starting at half-group `h0` (rows 8 * h0 ...), T tokens starting at t.
template <bool Bf16, int H, int T>
inline void tile(const PackedFloatWeights& w, const FloatActs& a, int64_t h0, int64_t t, float* y) {
  __m256 acc[H][T][2];
  for (int i = 0; i < H; ++i)
    for (int j = 0; j < T; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const int64_t kpad = w.kpad;
  const uint16_t* wh[H];  // the half-group's first value
  for (int i = 0; i < H; ++i) wh[i] = w.group((h0 + i) / 2) + ((h0 + i) % 2) * kHalf * (Bf16 ? 2 : 1);
  const float* xr[T];
  for (int j = 0; j < T; ++j) xr[j] = a.row(t + j);
  if constexpr (!Bf16) {
    for (int64_t k = 0; k < kpad; k += 2) {
      for (int c = 0; c < 2; ++c) {
        __m256 wv[H];
        for (int i = 0; i < H; ++i)
          wv[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wh[i] + (k + c) * kFloatRows)));
        for (int j = 0; j < T; ++j) {
          const __m256 xb = _mm256_broadcast_ss(xr[j] + k + c);
          for (int i = 0; i < H; ++i) acc[i][j][c] = _mm256_fmadd_ps(wv[i], xb, acc[i][j][c]);
        }
      }
    }
  } else {
    const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
    for (int64_t s = 0; s < kpad / 2; s += 2) {
      for (int c = 0; c < 2; ++c) {
        const int64_t k = 2 * (s + c);
        for (int i = 0; i < H; ++i) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh[i] + (s + c) * 2 * kFloatRows));
          const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
          const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
          for (int j = 0; j < T; ++j) {
            acc[i][j][c] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xr[j] + k + 1), acc[i][j][c]);
            acc[i][j][c] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(xr[j] + k), acc[i][j][c]);
          }
        }
      }
    }
  }
  for (int i = 0; i < H; ++i)
    for (int j = 0; j < T; ++j)
      store_rows(y + (t + j) * w.rows + (h0 + i) * kHalf, _mm256_add_ps(acc[i][j][0], acc[i][j][1]),
                 w.rows - (h0 + i) * kHalf);
}

// Not inlined into the caller, so no vector arithmetic is moved across the MXCSR writes around it.
template <bool Bf16>
__attribute__((noinline)) void run(const PackedFloatWeights& w, const FloatActs& a, int64_t g0, int64_t g1,
                                   int64_t t0, int64_t t1, float* y) {
  if (t1 - t0 == 1) {
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2) tile<Bf16, 4, 1>(w, a, 2 * g, t0, y);
    for (; g < g1; ++g) tile<Bf16, 2, 1>(w, a, 2 * g, t0, y);
    return;
  }
  for (int64_t g = g0; g < g1; ++g) {
    int64_t t = t0;
    for (; t + 3 <= t1; t += 3) tile<Bf16, 2, 3>(w, a, 2 * g, t, y);
    if (t1 - t == 2) tile<Bf16, 2, 2>(w, a, 2 * g, t, y);
    else if (t1 - t == 1) tile<Bf16, 2, 1>(w, a, 2 * g, t, y);
  }
}

}  // namespace

// 8 lanes at a time through F16 and back (round to nearest even, subnormals kept), the tail masked.
// VCVTPS2PH keeps a NaN's payload; f32_to_fp16_portable makes it sign | 0x7E00, so NaN lanes are
// replaced by the float that gives back: the quiet NaN of the same sign.
void round_f16_row_avx2(const float* x, float* out, int64_t n) {
  const __m256 sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)));
  const __m256 quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  for (int64_t i = 0; i < n; i += kHalf) {
    const int64_t left = n - i < kHalf ? n - i : kHalf;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 v = left == kHalf ? _mm256_loadu_ps(x + i) : _mm256_maskload_ps(x + i, mask);
    __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_ps(r, _mm256_or_ps(_mm256_and_ps(v, sign_mask), quiet), nan);
    if (left == kHalf) _mm256_storeu_ps(out + i, r);
    else _mm256_maskstore_ps(out + i, mask, r);
  }
}

void float_gemm_avx2(const PackedFloatWeights& w, const FloatActs& a, int64_t g0, int64_t g1, int64_t t0,
                     int64_t t1, float* y) {
  if (w.source != DType::BF16) return run<false>(w, a, g0, g1, t0, t1, y);
  const FlushScope flush(true);
  run<true>(w, a, g0, g1, t0, t1, y);
}

}  // namespace serval::cpu
