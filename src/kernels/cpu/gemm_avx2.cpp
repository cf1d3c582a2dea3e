// The packed GEMM with AVX2 (no VNNI): each group's 16 rows as two vectors of 8, 4-byte products
// summed with VPMADDUBSW + VPMADDWD. Values of up to 6 bits cannot saturate the 16-bit pair sums;
// 8-bit values (offset 128, Q8_0) are multiplied as signed values with the sign moved onto the
// activation, which gives the same integer S - 128 * sum(x). Compiled with this level's flags only.
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#include "kernels/cpu/packed.h"

namespace serval::cpu {
namespace {

constexpr int kMaxTile = 4;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 rows' sums of 4 products: unsigned weights (<= 6 bits, or signed when kSigned) times activations.
template <bool kSigned>
inline __m256i dot4(__m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kSigned) {
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80)));  // u - 128 as int8
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), ones);
  }
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
}

// 32 bits of a bit plane as 32 bytes: 0x10 where the bit is set, 0 elsewhere.
inline __m256i plane_bits(const uint8_t* p) {
  int32_t m;
  std::memcpy(&m, p, 4);
  const __m256i byte_of_bit = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                               3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(m), byte_of_bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

template <bool kNib, bool kPlane>
inline void load_half(const uint8_t* blk, int h, __m256i* v) {
  if constexpr (kNib) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h));
      v[j] = _mm256_and_si256(raw, low4);
      v[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    }
    if constexpr (kPlane)
      for (int k4 = 0; k4 < 8; ++k4) v[k4] = _mm256_or_si256(v[k4], plane_bits(blk + 256 + 8 * k4 + 4 * h));
  } else {
    for (int j = 0; j < 8; ++j) v[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h));
  }
}

// 8 rows' int8 sub-scales or mins as int32, and a (lo, hi) int16 pair per row for VPMADDWD.
inline __m256i widen8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i pair16(__m256i lo, __m256i hi) {
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}

template <bool kSigned>
inline __m256i dot16(const __m256i* v, const int8_t* xq) {
  __m256i s = dot4<kSigned>(v[0], bcast4(xq));
  for (int k = 1; k < 4; ++k) s = _mm256_add_epi32(s, dot4<kSigned>(v[k], bcast4(xq + 4 * k)));
  return s;
}

// One half (8 rows) of a group; kSub as in gemm_avx512.cpp. kSigned: 8-bit values (Q8_0), whose
// signed products already are S - 128 * sum(x).
template <int NT, bool kNib, bool kPlane, int kSub, bool kMins, bool kSigned>
void tile_half(const PackedWeights& w, const PackedActs& x, int64_t g, int h, int64_t t0, float* y) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const int64_t nb = w.n_blocks;
  const int32_t* pairs = x.pairs.data() + t0 * nb;
  for (int64_t sup = 0; sup < w.n_super; ++sup) {
    __m256i isum[NT];
    for (int t = 0; t < NT; ++t) isum[t] = _mm256_setzero_si256();
    for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
      __m256i v[8];
      if (h == 0) prefetch_ahead<kNib, kPlane>(w.block(g, b));  // the second half finds the lines in cache
      load_half<kNib, kPlane>(w.block(g, b), h, v);
      __m256i slo = _mm256_setzero_si256(), shi = slo, offp = slo;
      if constexpr (kSub >= 1) slo = widen8(w.sub.data() + w.int_index(g, b) + 8 * h);
      if constexpr (kSub == 2) {
        shi = widen8(w.sub.data() + w.int_index(g, b) + kPackRows + 8 * h);
        const __m256i neg_off = _mm256_set1_epi32(-w.offset);
        offp = pair16(_mm256_mullo_epi32(slo, neg_off), _mm256_mullo_epi32(shi, neg_off));
      }
      for (int t = 0; t < NT; ++t) {
        const int8_t* xq = x.row(t0 + t) + b * kPackBlock;
        if constexpr (kSub == 2) {
          const __m256i lo = dot16<kSigned>(v, xq), hi = dot16<kSigned>(v + 4, xq + 16);
          isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_mullo_epi32(slo, lo), _mm256_mullo_epi32(shi, hi)));
          isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(offp, _mm256_set1_epi32(pairs[t * nb + b])));
        } else {
          __m256i sum = _mm256_add_epi32(dot16<kSigned>(v, xq), dot16<kSigned>(v + 4, xq + 16));
          if constexpr (!kSigned) {
            const int32_t* xs = x.sums.data() + ((t0 + t) * nb + b) * 2;
            sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(w.offset * (xs[0] + xs[1])));
          }
          isum[t] = _mm256_add_epi32(isum[t], kSub == 1 ? _mm256_mullo_epi32(slo, sum) : sum);
        }
      }
    }
    const size_t f = w.super_index(g, sup) + 8 * h;
    const __m256 sc = _mm256_loadu_ps(w.scale.data() + f);
    for (int t = 0; t < NT; ++t) {
      const __m256 xd = _mm256_set1_ps(x.d[(t0 + t) * nb + sup * w.sb]);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(sc, xd), _mm256_cvtepi32_ps(isum[t]), acc[t]);
    }
    if constexpr (kMins) {
      __m256i msum[NT];
      for (int t = 0; t < NT; ++t) msum[t] = _mm256_setzero_si256();
      for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
        const __m256i mlo = widen8(w.min.data() + w.int_index(g, b) + 8 * h);
        const __m256i mp = pair16(mlo, w.split ? widen8(w.min.data() + w.int_index(g, b) + kPackRows + 8 * h) : mlo);
        for (int t = 0; t < NT; ++t)
          msum[t] = _mm256_add_epi32(msum[t], _mm256_madd_epi16(mp, _mm256_set1_epi32(pairs[t * nb + b])));
      }
      const __m256 nm = _mm256_loadu_ps(w.neg_min.data() + f);
      for (int t = 0; t < NT; ++t) {
        const __m256 xd = _mm256_set1_ps(x.d[(t0 + t) * nb + sup * w.sb]);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(nm, xd), _mm256_cvtepi32_ps(msum[t]), acc[t]);
      }
    }
  }
  const int64_t r0 = g * kPackRows + 8 * h;
  for (int t = 0; t < NT; ++t) {
    float out[8];
    _mm256_storeu_ps(out, acc[t]);
    for (int r = 0; r < 8 && r0 + r < w.rows; ++r) y[(t0 + t) * w.rows + r0 + r] = out[r];
  }
}

template <bool kNib, bool kPlane, int kSub, bool kMins, bool kSigned = false>
void run(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  using TileFn = void (*)(const PackedWeights&, const PackedActs&, int64_t, int, int64_t, float*);
  static constexpr TileFn kTiles[kMaxTile + 1] = {nullptr, tile_half<1, kNib, kPlane, kSub, kMins, kSigned>,
                                                  tile_half<2, kNib, kPlane, kSub, kMins, kSigned>,
                                                  tile_half<3, kNib, kPlane, kSub, kMins, kSigned>,
                                                  tile_half<4, kNib, kPlane, kSub, kMins, kSigned>};
  for (int64_t g = g0; g < g1; ++g)
    for (int h = 0; h < 2; ++h) {
      if (g * kPackRows + 8 * h >= w.rows) break;
      for_even_tiles(t0, t1, kMaxTile, [&](int64_t t, int64_t n) { kTiles[n](w, x, g, h, t, y); });
    }
}

}  // namespace

void packed_gemm_avx2(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                      float* y) {
  // Bytes without sub-scales are Q8_0 (offset 128): multiplied as signed values.
  with_layout(w.source, [&]<bool kNib, bool kPlane, int kSub, bool kMins>() {
    run<kNib, kPlane, kSub, kMins, !kNib && kSub == 0>(w, x, g0, g1, t0, t1, y);
  });
}

}  // namespace serval::cpu
