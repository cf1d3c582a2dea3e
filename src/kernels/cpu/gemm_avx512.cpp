// The packed GEMM with AVX-512 VNNI: a register tile of 16 rows (one vector) x up to 9 tokens (10 for
// the one-block types).
// Compiled with this level's flags only (CMakeLists.txt); called only when active_isa() allows it.
// The integer and float steps per (row, token, super-block) are those of packed.h, in the same order.
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#include "kernels/cpu/packed.h"

namespace serval::cpu {
namespace {

constexpr int kMaxTile = 9;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <bool kNib, int kPlanes>
inline void load_block(const uint8_t* blk, __m512i* v) {
  if constexpr (kNib) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_load_si512(blk + 64 * j);
      v[j] = _mm512_and_si512(raw, low4);
      v[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    if constexpr (kPlanes == kFp4Codes) {  // codes to values: one shuffle per vector (packed.h)
      const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4Table)));
      for (int k4 = 0; k4 < 8; ++k4) v[k4] = _mm512_shuffle_epi8(table, v[k4]);
    }
    for (int p = 0; p < kPlanes; ++p) {  // plane p: bit 4 + p, not set yet, so adding it sets it
      const __m512i bit = _mm512_set1_epi8(char(0x10 << p));
      for (int k4 = 0; k4 < 8; ++k4) {
        __mmask64 m;
        std::memcpy(&m, blk + 256 + 64 * p + 8 * k4, 8);
        v[k4] = _mm512_mask_add_epi8(v[k4], m, v[k4], bit);
      }
    }
  } else {
    for (int j = 0; j < 8; ++j) v[j] = _mm512_load_si512(blk + 64 * j);
  }
}

// 16 rows' int8 sub-scales or mins (one vector of 16 bytes) as int32.
inline __m512i widen16(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Per row, (lo, hi) as an int16 pair: the operand VPDPWSSD multiplies with an activation's half sums.
inline __m512i pair16(__m512i lo, __m512i hi) {
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
}

// 4 products per row of 4 weight vectors with 16 activation bytes, added to `acc`.
inline __m512i dot16(__m512i acc, const __m512i* v, const int8_t* xq) {
  for (int k = 0; k < 4; ++k) acc = _mm512_dpbusd_epi32(acc, v[k], bcast4(xq + 4 * k));
  return acc;
}

// Token `tok`'s integer sum over block b of the 16 rows, S - offset * sum(x), for types without split
// sub-scales (packed.h's arithmetic).
inline __m512i block_sum(const PackedWeights& w, const PackedActs& x, const __m512i* v, int64_t tok, int64_t b) {
  const int8_t* xq = x.row(tok) + b * kPackBlock;
  const int32_t* xs = x.sums.data() + (tok * w.n_blocks + b) * 2;
  const __m512i start = w.offset != 0 ? _mm512_set1_epi32(-w.offset * (xs[0] + xs[1])) : _mm512_setzero_si512();
  return dot16(dot16(start, v, xq), v + 4, xq + 16);
}

// The tile's NT x 16 results into y (rows past the matrix's end are not written).
template <int NT>
inline void store_tile(const PackedWeights& w, int64_t g, int64_t t0, const __m512* acc, float* y) {
  const int64_t r0 = g * kPackRows;
  const int valid = int(w.rows - r0 < kPackRows ? w.rows - r0 : kPackRows);
  const __mmask16 mask = __mmask16((1u << valid) - 1);
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * w.rows + r0, mask, acc[t]);
}

// kSub: 0 without sub-scales, 1 one per block, 2 one per half (packed.h).
template <int NT, bool kNib, int kPlanes, int kSub, bool kMins>
void tile(const PackedWeights& w, const PackedActs& x, int64_t g, int64_t t0, float* y) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t nb = w.n_blocks;
  const int32_t* pairs = x.pairs.data() + t0 * nb;
  for (int64_t sup = 0; sup < w.n_super; ++sup) {
    __m512i isum[NT];
    for (int t = 0; t < NT; ++t) isum[t] = _mm512_setzero_si512();
    for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
      __m512i v[8];
      prefetch_ahead<kNib, kPlanes>(w.block(g, b));
      load_block<kNib, kPlanes>(w.block(g, b), v);
      __m512i slo = _mm512_setzero_si512(), shi = slo, offp = slo;
      if constexpr (kSub >= 1) slo = widen16(w.sub.data() + w.int_index(g, b));
      if constexpr (kSub == 2) {
        shi = widen16(w.sub.data() + w.int_index(g, b) + kPackRows);
        const __m512i neg_off = _mm512_set1_epi32(-w.offset);
        offp = pair16(_mm512_mullo_epi32(slo, neg_off), _mm512_mullo_epi32(shi, neg_off));
      }
      for (int t = 0; t < NT; ++t) {
        if constexpr (kSub == 2) {
          const int8_t* xq = x.row(t0 + t) + b * kPackBlock;
          const __m512i lo = dot16(_mm512_setzero_si512(), v, xq), hi = dot16(_mm512_setzero_si512(), v + 4, xq + 16);
          isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(_mm512_mullo_epi32(slo, lo), _mm512_mullo_epi32(shi, hi)));
          if (w.offset != 0) isum[t] = _mm512_dpwssd_epi32(isum[t], offp, _mm512_set1_epi32(pairs[t * nb + b]));
        } else {
          const __m512i sum = block_sum(w, x, v, t0 + t, b);
          isum[t] = _mm512_add_epi32(isum[t], kSub == 1 ? _mm512_mullo_epi32(slo, sum) : sum);
        }
      }
    }
    const size_t f = w.super_index(g, sup);
    const __m512 sc = group_scales16(w, f, kPlanes == kFp4Codes);
    for (int t = 0; t < NT; ++t) {
      const __m512 xd = _mm512_set1_ps(x.d[(t0 + t) * nb + sup * w.sb]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc, xd), _mm512_cvtepi32_ps(isum[t]), acc[t]);
    }
    if constexpr (kMins) {
      __m512i msum[NT];
      for (int t = 0; t < NT; ++t) msum[t] = _mm512_setzero_si512();
      for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
        const __m512i mlo = widen16(w.min.data() + w.int_index(g, b));
        const __m512i mp = pair16(mlo, w.split ? widen16(w.min.data() + w.int_index(g, b) + kPackRows) : mlo);
        for (int t = 0; t < NT; ++t) msum[t] = _mm512_dpwssd_epi32(msum[t], mp, _mm512_set1_epi32(pairs[t * nb + b]));
      }
      const __m512 nm = _mm512_loadu_ps(w.neg_min.data() + f);
      for (int t = 0; t < NT; ++t) {
        const __m512 xd = _mm512_set1_ps(x.d[(t0 + t) * nb + sup * w.sb]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(nm, xd), _mm512_cvtepi32_ps(msum[t]), acc[t]);
      }
    }
  }
  store_tile<NT>(w, g, t0, acc, y);
}

// Types of one block per scale and no sub-scales or mins (Q4_0, Q5_0, Q8_0, IQ4_NL): each block's sum
// goes straight into the float accumulator, so no integer sums stay live and a tile holds up to 10
// tokens: 9 and 10 tokens load and unpack the weights once, not twice (0.5B, 9 tokens: 29.3 -> 25.4 ms).
// The operations per (row, token, block) are tile<>'s with one block per super-block, in the same
// order: the same bits. Tiles of 12 or 16 spill registers and were no faster than two tiles.
constexpr int kMaxTileOneBlock = 10;

template <int NT, bool kNib, int kPlanes>
void tile_one_block(const PackedWeights& w, const PackedActs& x, int64_t g, int64_t t0, float* y) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t nb = w.n_blocks;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<kNib, kPlanes>(w.block(g, b));
    __m512i v[8];
    load_block<kNib, kPlanes>(w.block(g, b), v);
    const __m512 sc = group_scales16(w, w.super_index(g, b), kPlanes == kFp4Codes);
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
      const __m512i sum = block_sum(w, x, v, t0 + t, b);
      const __m512 xd = _mm512_set1_ps(x.d[(t0 + t) * nb + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc, xd), _mm512_cvtepi32_ps(sum), acc[t]);
    }
  }
  store_tile<NT>(w, g, t0, acc, y);
}

using TileFn = void (*)(const PackedWeights&, const PackedActs&, int64_t, int64_t, float*);

// Every row group [g0, g1) by tokens [t0, t1) in even tiles of `tiles`' widths (tiles[n]: n tokens).
template <int kMax>
void run_tiles(const TileFn (&tiles)[kMax + 1], const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1,
               int64_t t0, int64_t t1, float* y) {
  for (int64_t g = g0; g < g1; ++g)
    for_even_tiles(t0, t1, kMax, [&](int64_t t, int64_t n) { tiles[n](w, x, g, t, y); });
}

template <bool kNib, int kPlanes>
void run_one_block(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  static constexpr TileFn kTiles[kMaxTileOneBlock + 1] = {
      nullptr,
      tile_one_block<1, kNib, kPlanes>, tile_one_block<2, kNib, kPlanes>, tile_one_block<3, kNib, kPlanes>,
      tile_one_block<4, kNib, kPlanes>, tile_one_block<5, kNib, kPlanes>, tile_one_block<6, kNib, kPlanes>,
      tile_one_block<7, kNib, kPlanes>, tile_one_block<8, kNib, kPlanes>, tile_one_block<9, kNib, kPlanes>,
      tile_one_block<10, kNib, kPlanes>};
  run_tiles<kMaxTileOneBlock>(kTiles, w, x, g0, g1, t0, t1, y);
}

template <bool kNib, int kPlanes, int kSub, bool kMins>
void run(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  static constexpr TileFn kTiles[kMaxTile + 1] = {
      nullptr,
      tile<1, kNib, kPlanes, kSub, kMins>,
      tile<2, kNib, kPlanes, kSub, kMins>,
      tile<3, kNib, kPlanes, kSub, kMins>,
      tile<4, kNib, kPlanes, kSub, kMins>,
      tile<5, kNib, kPlanes, kSub, kMins>,
      tile<6, kNib, kPlanes, kSub, kMins>,
      tile<7, kNib, kPlanes, kSub, kMins>,
      tile<8, kNib, kPlanes, kSub, kMins>,
      tile<9, kNib, kPlanes, kSub, kMins>};
  run_tiles<kMaxTile>(kTiles, w, x, g0, g1, t0, t1, y);
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
  with_layout(w.source, [&]<bool kNib, int kPlanes, int kSub, bool kMins>() {
    if constexpr (kSub == 0 && !kMins) {
      if (w.sb == 1) return run_one_block<kNib, kPlanes>(w, x, g0, g1, t0, t1, y);
    }
    run<kNib, kPlanes, kSub, kMins>(w, x, g0, g1, t0, t1, y);
  });
}

}  // namespace serval::cpu
