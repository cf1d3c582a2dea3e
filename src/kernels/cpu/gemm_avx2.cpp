// The packed GEMM with AVX2 (no VNNI): each group's 16 rows as two vectors of 8, 4-byte products
// summed with VPMADDUBSW + VPMADDWD. The 16-bit pair sums of several VPMADDUBSW are added in 16 bits
// before one VPMADDWD widens them (kChain below), so that most of a block's multiplies are products,
// not widenings. 8-bit values (offset 128, Q8_0) are multiplied as signed values with the sign moved
// onto the activation, which gives the same integer S - 128 * sum(x). 5-bit types read either plane
// order (packed.h: PlaneLayout); weights packed on a CPU without AVX-512 have ValueBytes, whose bits
// take 2 operations per vector instead of 5. Compiled with this level's flags only.
#include <immintrin.h>

#include <cmath>
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

// How many VPMADDUBSW results (16-bit pair sums of 4 products: unsigned weights times activations, or
// |u - 128| times sign-moved activations for Q8_0) are added in 16 bits before VPMADDWD widens them.
// Activations are at most 127 in magnitude (128 is allowed for here), so one result is at most
// 2 * max(u) * 128: 4-bit values 3840 (8 add up to 30720), 5-bit 7936 (4: 31744), 6-bit 16128
// (2: 32256), MXFP4's values (at most 24) 6144 (4: 24576), all below 32768; signed 8-bit products
// reach 32512 alone. The integer sums are exact, so
// the chains do not change a bit.
template <bool kNib, int kPlanes, bool kSigned>
constexpr int kChain = kSigned ? 1 : !kNib || kPlanes == 2 ? 2 : kPlanes == 1 || kPlanes == kFp4Codes ? 4 : 8;

// 32 bits of a StepMasks plane as 32 bytes: `bit_value` (0x10 or 0x20) where the bit is set, 0 elsewhere.
inline __m256i plane_bits(const uint8_t* p, char bit_value) {
  int32_t m;
  std::memcpy(&m, p, 4);
  const __m256i byte_of_bit = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                               3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(m), byte_of_bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(bit_value));
}

// 8 rows' int8 sub-scales or mins as int32, and a (lo, hi) int16 pair per row for VPMADDWD.
inline __m256i widen8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i pair16(__m256i lo, __m256i hi) {
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}
inline __m256i sub_pairs(__m256i sub) { return pair16(sub, sub); }

// Step k4's bits of a ValueBytes plane's half (bit k4 of each byte) at bit `to` (4 for the fifth bits,
// 5 for the sixth): the 16-bit shift moves bits across bytes only below bit `to` (left by to - k4) or
// above it (right by at most 3).
inline __m256i plane_step(__m256i half, int k4, int to) {
  const __m256i at = k4 < to ? _mm256_slli_epi16(half, to - k4) : k4 > to ? _mm256_srli_epi16(half, k4 - to) : half;
  return _mm256_and_si256(at, _mm256_set1_epi8(char(1 << to)));
}

// Step k4 (values 4*k4 .. 4*k4+3 of each row) of half h of a block: one vector of 8 rows' 4 values.
// kByValue: the plane is in ValueBytes order (packed.h), else StepMasks.
template <bool kNib, int kPlanes, bool kByValue>
inline __m256i load_step(const uint8_t* blk, int h, int k4) {
  const __m256i raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + 64 * (kNib ? k4 % 4 : k4) + 32 * h));
  if constexpr (!kNib) return raw;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i v = _mm256_and_si256(k4 < 4 ? raw : _mm256_srli_epi16(raw, 4), low4);
  if constexpr (kPlanes == kFp4Codes)  // codes to values (packed.h)
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4Table))), v);
  for (int p = 0; p < kPlanes; ++p) {  // plane p: bit 4 + p
    const uint8_t* plane = blk + 256 + 64 * p;
    if constexpr (kByValue)  // the same 32 bytes for every step: loaded once when unrolled
      v = _mm256_or_si256(v, plane_step(_mm256_load_si256(reinterpret_cast<const __m256i*>(plane + 32 * h)), k4, 4 + p));
    else
      v = _mm256_or_si256(v, plane_bits(plane + 8 * k4 + 4 * h, char(0x10 << p)));
  }
  return v;
}

// For each of the NT tokens from t0, adds to s32[t] the 8 rows' int32 sums of the products of steps
// [K0, K1) of block b (4 values each) with the token's activations. Steps run outermost: each step's
// weights are unpacked once and used for every token of the tile, whose 16-bit chains (kChain) and sums
// stay in registers, so no unpacked block is held.
template <int NT, int K0, int K1, bool kNib, int kPlanes, bool kSigned, bool kByValue>
inline void add_steps(const uint8_t* blk, int h, const PackedActs& x, int64_t t0, int64_t b, __m256i* s32,
                      __m256i mul) {
  constexpr int C = kChain<kNib, kPlanes, kSigned>;
  for (int c = K0; c < K1; c += C) {
    __m256i s16[NT];
    for (int t = 0; t < NT; ++t) s16[t] = _mm256_setzero_si256();  // folded into the first add
    for (int k = c; k < c + C && k < K1; ++k) {
      const __m256i v = load_step<kNib, kPlanes, kByValue>(blk, h, k);
      __m256i u = v, q = v;  // unsigned weights; signed: |u - 128|, with the sign moved onto x
      if constexpr (kSigned) {
        q = _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80)));
        u = _mm256_abs_epi8(q);
      }
#pragma GCC unroll 16
      for (int t = 0; t < NT; ++t) {
        __m256i xb = bcast4(x.row(t0 + t) + b * kPackBlock + 4 * k);
        if constexpr (kSigned) xb = _mm256_sign_epi8(xb, q);
        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(u, xb));
      }
    }
    for (int t = 0; t < NT; ++t) s32[t] = _mm256_add_epi32(s32[t], _mm256_madd_epi16(s16[t], mul));
  }
}

// add_steps with the loops the other way round inside each chain: a chain's (at most 4) unpacked
// step vectors are held, and each token's chain runs over them at once. Live: the C step vectors, a
// sum and an accumulator per token, one chain and one broadcast; add_steps keeps a chain per token
// besides, and the unpacking's temporaries, which at 4 tokens is more than AVX2's 16 registers.
// Chains of 8 (4-bit values) are cut into two of 4 here: one more widening per block and token.
template <int NT, int K0, int K1, bool kNib, int kPlanes, bool kSigned, bool kByValue>
inline void add_steps_held(const uint8_t* blk, int h, const PackedActs& x, int64_t t0, int64_t b, __m256i* s32,
                           __m256i mul) {
  constexpr int C = kChain<kNib, kPlanes, kSigned> < 4 ? kChain<kNib, kPlanes, kSigned> : 4;
  for (int c = K0; c < K1; c += C) {
    __m256i v[C];
    for (int k = 0; k < C; ++k) v[k] = load_step<kNib, kPlanes, kByValue>(blk, h, c + k);
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
      const int8_t* xq = x.row(t0 + t) + b * kPackBlock + 4 * c;
      __m256i s16 = _mm256_maddubs_epi16(v[0], bcast4(xq));
      for (int k = 1; k < C; ++k) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[k], bcast4(xq + 4 * k)));
      s32[t] = _mm256_add_epi32(s32[t], _mm256_madd_epi16(s16, mul));
    }
  }
}

// Tiles of 3 or more tokens hold a chain's steps (add_steps_held: fewer live registers, Q5_0 and Q4_K
// 4-token tiles 15-19 % faster alone); smaller ones run steps outermost (add_steps: held steps were 5-15 % slower at 1-2
// tokens). Signed (Q8_0) products keep add_steps: their chains are one step long.
// `mul`: per row, the int16 pair each chain's pair sums are multiplied by as VPMADDWD widens them: ones,
// or a sub-scale twice (sub_pairs), which adds sub * S exactly (|chain| < 32768, |sub| <= 128) without
// a sum per token and a VPMULLD (Q4_K 1- and 4-token tiles alone: 5-14 % faster, minimum of 12 rounds).
template <int NT, int K0, int K1, bool kNib, int kPlanes, bool kSigned, bool kByValue>
inline void add_block_steps(const uint8_t* blk, int h, const PackedActs& x, int64_t t0, int64_t b, __m256i* s32,
                            __m256i mul = _mm256_set1_epi16(1)) {
  if constexpr (kSigned || NT < 3) add_steps<NT, K0, K1, kNib, kPlanes, kSigned, kByValue>(blk, h, x, t0, b, s32, mul);
  else add_steps_held<NT, K0, K1, kNib, kPlanes, kSigned, kByValue>(blk, h, x, t0, b, s32, mul);
}

// Per token, -offset * sum(x) over block b: the start of S - offset * sum(x) (0 for Q8_0, whose signed
// products already are it).
template <int NT, bool kSigned>
inline void start_sums(const PackedWeights& w, const PackedActs& x, int64_t t0, int64_t b, __m256i* s32) {
  for (int t = 0; t < NT; ++t) {
    if constexpr (kSigned) {
      s32[t] = _mm256_setzero_si256();
    } else {
      const int32_t* xs = x.sums.data() + ((t0 + t) * w.n_blocks + b) * 2;
      s32[t] = _mm256_set1_epi32(-w.offset * (xs[0] + xs[1]));
    }
  }
}

// A tile's NT x 8 results into y (rows past the matrix's end are not written).
template <int NT>
inline void store_half(const PackedWeights& w, int64_t g, int h, int64_t t0, const __m256* acc, float* y) {
  const int64_t r0 = g * kPackRows + 8 * h;
  for (int t = 0; t < NT; ++t) {
    float out[8];
    _mm256_storeu_ps(out, acc[t]);
    for (int r = 0; r < 8 && r0 + r < w.rows; ++r) y[(t0 + t) * w.rows + r0 + r] = out[r];
  }
}

// One half (8 rows) of a group; kSub as in gemm_avx512.cpp. kSigned: 8-bit values (Q8_0), whose
// signed products already are S - 128 * sum(x).
template <int NT, bool kNib, int kPlanes, int kSub, bool kMins, bool kSigned, bool kByValue>
void tile_half(const PackedWeights& w, const PackedActs& x, int64_t g, int h, int64_t t0, float* y) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const int64_t nb = w.n_blocks;
  const int32_t* pairs = x.pairs.data() + t0 * nb;
  for (int64_t sup = 0; sup < w.n_super; ++sup) {
    __m256i isum[NT];
    for (int t = 0; t < NT; ++t) isum[t] = _mm256_setzero_si256();
    for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
      const uint8_t* blk = w.block(g, b);
      if (h == 0) prefetch_ahead<kNib, kPlanes>(blk);  // the second half finds the lines in cache
      if constexpr (kSub == 2) {
        const __m256i slo = widen8(w.sub.data() + w.int_index(g, b) + 8 * h);
        const __m256i shi = widen8(w.sub.data() + w.int_index(g, b) + kPackRows + 8 * h);
        add_block_steps<NT, 0, 4, kNib, kPlanes, kSigned, kByValue>(blk, h, x, t0, b, isum, sub_pairs(slo));
        add_block_steps<NT, 4, 8, kNib, kPlanes, kSigned, kByValue>(blk, h, x, t0, b, isum, sub_pairs(shi));
        const __m256i neg_off = _mm256_set1_epi32(-w.offset);
        const __m256i offp = pair16(_mm256_mullo_epi32(slo, neg_off), _mm256_mullo_epi32(shi, neg_off));
        for (int t = 0; t < NT; ++t)
          isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(offp, _mm256_set1_epi32(pairs[t * nb + b])));
      } else if constexpr (kSub == 1) {  // sub * S: the types with a sub-scale per block (Q4_K, Q5_K) have
        // no offset (the bitwise tests of every packable type would catch one that had)
        const __m256i slo = widen8(w.sub.data() + w.int_index(g, b) + 8 * h);
        add_block_steps<NT, 0, 8, kNib, kPlanes, kSigned, kByValue>(blk, h, x, t0, b, isum, sub_pairs(slo));
      } else {
        __m256i sum[NT];
        start_sums<NT, kSigned>(w, x, t0, b, sum);
        add_block_steps<NT, 0, 8, kNib, kPlanes, kSigned, kByValue>(blk, h, x, t0, b, sum);
        for (int t = 0; t < NT; ++t) isum[t] = _mm256_add_epi32(isum[t], sum[t]);
      }
    }
    const size_t f = w.super_index(g, sup) + 8 * h;
    const __m256 sc = group_scales8(w, f, kPlanes == kFp4Codes);
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
  store_half<NT>(w, g, h, t0, acc, y);
}

// Types of one block per scale and no sub-scales or mins (Q4_0, Q5_0, Q8_0, IQ4_NL): each block's sum
// goes straight into the float accumulator, so no integer sums stay live across blocks. The integer
// sum per (row, token, block) is S - offset * sum(x), as in tile_half, and the float steps are the
// same: the same bits.
template <int NT, bool kNib, int kPlanes, bool kSigned, bool kByValue>
void tile_half_one_block(const PackedWeights& w, const PackedActs& x, int64_t g, int h, int64_t t0, float* y) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const int64_t nb = w.n_blocks;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w.block(g, b);
    if (h == 0) prefetch_ahead<kNib, kPlanes>(blk);
    __m256i sum[NT];
    start_sums<NT, kSigned>(w, x, t0, b, sum);
    add_block_steps<NT, 0, 8, kNib, kPlanes, kSigned, kByValue>(blk, h, x, t0, b, sum);
    const __m256 sc = group_scales8(w, w.super_index(g, b) + 8 * h, kPlanes == kFp4Codes);
    for (int t = 0; t < NT; ++t) {
      const __m256 xd = _mm256_set1_ps(x.d[(t0 + t) * nb + b]);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(sc, xd), _mm256_cvtepi32_ps(sum[t]), acc[t]);
    }
  }
  store_half<NT>(w, g, h, t0, acc, y);
}

using TileFn = void (*)(const PackedWeights&, const PackedActs&, int64_t, int, int64_t, float*);

// Every row group [g0, g1), half by half, by tokens [t0, t1) in even tiles (tiles[n]: n tokens).
void run_tiles(const TileFn (&tiles)[kMaxTile + 1], const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1,
               int64_t t0, int64_t t1, float* y) {
  for (int64_t g = g0; g < g1; ++g)
    for (int h = 0; h < 2; ++h) {
      if (g * kPackRows + 8 * h >= w.rows) break;
      for_even_tiles(t0, t1, kMaxTile, [&](int64_t t, int64_t n) { tiles[n](w, x, g, h, t, y); });
    }
}

template <bool kNib, int kPlanes, int kSub, bool kMins, bool kSigned, bool kByValue>
void run(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  static constexpr TileFn kTiles[kMaxTile + 1] = {nullptr, tile_half<1, kNib, kPlanes, kSub, kMins, kSigned, kByValue>,
                                                  tile_half<2, kNib, kPlanes, kSub, kMins, kSigned, kByValue>,
                                                  tile_half<3, kNib, kPlanes, kSub, kMins, kSigned, kByValue>,
                                                  tile_half<4, kNib, kPlanes, kSub, kMins, kSigned, kByValue>};
  if constexpr (kSub == 0 && !kMins) {
    static constexpr TileFn kOneBlock[kMaxTile + 1] = {nullptr, tile_half_one_block<1, kNib, kPlanes, kSigned, kByValue>,
                                                       tile_half_one_block<2, kNib, kPlanes, kSigned, kByValue>,
                                                       tile_half_one_block<3, kNib, kPlanes, kSigned, kByValue>,
                                                       tile_half_one_block<4, kNib, kPlanes, kSigned, kByValue>};
    if (w.sb == 1) return run_tiles(kOneBlock, w, x, g0, g1, t0, t1, y);
  }
  run_tiles(kTiles, w, x, g0, g1, t0, t1, y);
}

}  // namespace

void packed_gemm_avx2(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                      float* y) {
  // Bytes without sub-scales are Q8_0 (offset 128): multiplied as signed values.
  with_layout(w.source, [&]<bool kNib, int kPlanes, int kSub, bool kMins>() {
    constexpr bool kSigned = !kNib && kSub == 0;
    if constexpr (kPlanes > 0)
      if (w.plane_by_value) return run<kNib, kPlanes, kSub, kMins, kSigned, true>(w, x, g0, g1, t0, t1, y);
    run<kNib, kPlanes, kSub, kMins, kSigned, false>(w, x, g0, g1, t0, t1, y);
  });
}

namespace avx2_act {

float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

__m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

// 32 floats times `scale`, rounded half to even (MXCSR's default mode) and saturated to int8, in order.
void store32(const float* x, __m256 scale, int8_t* out, __m256i top) {
  __m256i q[4];
  for (int k = 0; k < 4; ++k) q[k] = _mm256_min_epi32(top, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), scale)));
  // packs work within 128-bit lanes: the permute puts the 32 bytes back in element order.
  const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

void q8_0_row(const float* x, int64_t cols, int8_t* qs, float* d) {
  const __m256i top = _mm256_set1_epi32(127);
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* v = x + 32 * b;
    __m256 m = _mm256_max_ps(_mm256_max_ps(abs8(_mm256_loadu_ps(v)), abs8(_mm256_loadu_ps(v + 8))),
                             _mm256_max_ps(abs8(_mm256_loadu_ps(v + 16)), abs8(_mm256_loadu_ps(v + 24))));
    const float amax = hmax(m);
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    d[b] = _cvtsh_ss(_cvtss_sh(amax / 127.f, _MM_FROUND_TO_NEAREST_INT));
    store32(v, _mm256_set1_ps(id), qs + 32 * b, top);
  }
}

// Q8_K: per 256 values, the first value of largest magnitude maps to -127; d = 1 / iscale.
void q8_k_row(const float* x, int64_t cols, int8_t* qs, float* d) {
  const __m256i top = _mm256_set1_epi32(127);
  for (int64_t s = 0; s < cols / 256; ++s, x += 256, qs += 256) {
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < 32; ++j) m = _mm256_max_ps(m, abs8(_mm256_loadu_ps(x + 8 * j)));
    const float amax = hmax(m);
    if (amax == 0.0f) {
      std::memset(qs, 0, 256);
      for (int b = 0; b < 8; ++b) d[8 * s + b] = 0.0f;
      continue;
    }
    float max = 0;
    for (int j = 0; j < 256; ++j)
      if (std::abs(x[j]) == amax) {
        max = x[j];
        break;
      }
    const float iscale = -127.f / max;
    for (int j = 0; j < 8; ++j) store32(x + 32 * j, _mm256_set1_ps(iscale), qs + 32 * j, top);
    for (int b = 0; b < 8; ++b) d[8 * s + b] = 1 / iscale;
  }
}

}  // namespace avx2_act

void quantize_act_row_avx2(bool k_quant, const float* x, int64_t cols, int8_t* qs, float* d, int32_t* sums) {
  if (k_quant) avx2_act::q8_k_row(x, cols, qs, d);
  else avx2_act::q8_0_row(x, cols, qs, d);
  for (int64_t h = 0; h < cols / 16; ++h) {
    const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * h)));
    const __m256i v = _mm256_madd_epi16(v0, _mm256_set1_epi16(1));  // 8 int32 pair sums
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
    sums[h] = _mm_cvtsi128_si32(r);
  }
}

}  // namespace serval::cpu
