// The packed GEMM with AVX-512 VNNI: a register tile of 16 rows (one vector) x up to 8 tokens.
// Compiled with this level's flags only (CMakeLists.txt); called only when active_isa() allows it.
// The operations per (row, token, block) are those of packed.h, in the same order.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/packed.h"

namespace serval::cpu {
namespace {

constexpr int kMaxTile = 8;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <bool kNib, bool kPlane>
inline void load_block(const uint8_t* blk, __m512i* v) {
  if constexpr (kNib) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_load_si512(blk + 64 * j);
      v[j] = _mm512_and_si512(raw, low4);
      v[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    if constexpr (kPlane) {
      const __m512i bit4 = _mm512_set1_epi8(0x10);
      for (int k4 = 0; k4 < 8; ++k4) {
        __mmask64 m;
        std::memcpy(&m, blk + 256 + 8 * k4, 8);
        v[k4] = _mm512_mask_add_epi8(v[k4], m, v[k4], bit4);  // values <= 15: adding 16 sets the fifth bit
      }
    }
  } else {
    for (int j = 0; j < 8; ++j) v[j] = _mm512_load_si512(blk + 64 * j);
  }
}

template <int NT, bool kNib, bool kPlane, bool kSplit, bool kMins>
void tile(const PackedWeights& w, const PackedActs& x, int64_t g, int64_t t0, float* y) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t nb = w.n_blocks;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i v[8];
    load_block<kNib, kPlane>(w.block(g, b), v);
    const size_t i = w.index(g, b);
    const __m512 sc = _mm512_loadu_ps(w.scale.data() + i);
    __m512 nm = _mm512_setzero_ps();
    __m512i slo = _mm512_setzero_si512(), shi = _mm512_setzero_si512();
    if constexpr (kMins) nm = _mm512_loadu_ps(w.neg_min.data() + i);
    if constexpr (kSplit) {
      slo = _mm512_loadu_si512(w.sub.data() + 2 * i);
      shi = _mm512_loadu_si512(w.sub.data() + 2 * i + kPackRows);
    }
    for (int t = 0; t < NT; ++t) {
      const int8_t* xq = x.row(t0 + t) + b * kPackBlock;
      const int32_t* xs = x.sums.data() + ((t0 + t) * nb + b) * 2;
      __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], bcast4(xq));
      __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[4], bcast4(xq + 16));
      for (int k = 1; k < 4; ++k) {
        lo = _mm512_dpbusd_epi32(lo, v[k], bcast4(xq + 4 * k));
        hi = _mm512_dpbusd_epi32(hi, v[k + 4], bcast4(xq + 16 + 4 * k));
      }
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(w.offset * xs[0]));
      hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(w.offset * xs[1]));
      const __m512i isum = kSplit ? _mm512_add_epi32(_mm512_mullo_epi32(slo, lo), _mm512_mullo_epi32(shi, hi))
                                  : _mm512_add_epi32(lo, hi);
      const __m512 xd = _mm512_set1_ps(x.d[(t0 + t) * nb + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc, xd), _mm512_cvtepi32_ps(isum), acc[t]);
      if constexpr (kMins) acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(nm, xd), _mm512_set1_ps(float(xs[0] + xs[1])), acc[t]);
    }
  }
  const int64_t r0 = g * kPackRows;
  const int valid = int(w.rows - r0 < kPackRows ? w.rows - r0 : kPackRows);
  const __mmask16 mask = __mmask16((1u << valid) - 1);
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * w.rows + r0, mask, acc[t]);
}

template <bool kNib, bool kPlane, bool kSplit, bool kMins>
void run(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  using TileFn = void (*)(const PackedWeights&, const PackedActs&, int64_t, int64_t, float*);
  static constexpr TileFn kTiles[kMaxTile + 1] = {
      nullptr,
      tile<1, kNib, kPlane, kSplit, kMins>,
      tile<2, kNib, kPlane, kSplit, kMins>,
      tile<3, kNib, kPlane, kSplit, kMins>,
      tile<4, kNib, kPlane, kSplit, kMins>,
      tile<5, kNib, kPlane, kSplit, kMins>,
      tile<6, kNib, kPlane, kSplit, kMins>,
      tile<7, kNib, kPlane, kSplit, kMins>,
      tile<8, kNib, kPlane, kSplit, kMins>};
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t t = t0; t < t1; t += kMaxTile) kTiles[t1 - t < kMaxTile ? t1 - t : kMaxTile](w, x, g, t, y);
}

// Q8_0: per 32 values, d = amax / 127 rounded to F16, q = round-half-even(x * 127 / amax).
void quantize_q8_0_row(const float* x, int64_t cols, int8_t* qs, float* d) {
  for (int64_t b = 0; b < cols / 32; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    d[b] = _cvtsh_ss(_cvtss_sh(amax / 127.f, _MM_FROUND_TO_NEAREST_INT));
    const __m512 vid = _mm512_set1_ps(id);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 32 * b), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 32 * b + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid))));
  }
}

// Q8_K: per 256 values, the first value of largest magnitude maps to -127; d = 1 / iscale.
void quantize_q8_k_row(const float* x, int64_t cols, int8_t* qs, float* d) {
  for (int64_t s = 0; s < cols / 256; ++s, x += 256, qs += 256) {
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < 16; ++j) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * j)));
    const float amax = _mm512_reduce_max_ps(m);
    if (amax == 0.0f) {
      std::memset(qs, 0, 256);
      for (int b = 0; b < 8; ++b) d[8 * s + b] = 0.0f;
      continue;
    }
    float max = 0;
    for (int j = 0; j < 16; ++j) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
      if (hit) {
        max = x[16 * j + __builtin_ctz(hit)];
        break;
      }
    }
    const float iscale = -127.f / max;
    const __m512 vs = _mm512_set1_ps(iscale);
    const __m512i top = _mm512_set1_epi32(127);
    for (int j = 0; j < 16; ++j) {
      const __m512i q = _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * j), vs)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16 * j), _mm512_cvtsepi32_epi8(q));
    }
    for (int b = 0; b < 8; ++b) d[8 * s + b] = 1 / iscale;
  }
}

}  // namespace

void quantize_act_row_avx512(bool k_quant, const float* x, int64_t cols, int8_t* qs, float* d, int32_t* sums) {
  if (k_quant) quantize_q8_k_row(x, cols, qs, d);
  else quantize_q8_0_row(x, cols, qs, d);
  for (int64_t h = 0; h < cols / 16; ++h) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * h)));
    sums[h] = _mm512_reduce_add_epi32(v);
  }
}

void packed_gemm_avx512(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                        float* y) {
  // The layouts of the packable types: Q4_0, Q5_0, Q4_K, Q5_K (nibbles, with a plane for 5 bits),
  // Q8_0 (bytes), Q6_K (bytes, split scales).
  if (w.nibbles && w.plane) return w.mins ? run<true, true, false, true>(w, x, g0, g1, t0, t1, y) : run<true, true, false, false>(w, x, g0, g1, t0, t1, y);
  if (w.nibbles) return w.mins ? run<true, false, false, true>(w, x, g0, g1, t0, t1, y) : run<true, false, false, false>(w, x, g0, g1, t0, t1, y);
  if (w.split) return run<false, false, true, false>(w, x, g0, g1, t0, t1, y);
  return run<false, false, false, false>(w, x, g0, g1, t0, t1, y);
}

}  // namespace serval::cpu
