// The packed GEMM with AMX-INT8 tiles (Intel): per row group and block, one TDPBSSD multiplies 16
// tokens' activations (signed, A: 16 x 32 bytes) by the group's weights (B: 8 rows of 16 x 4 bytes: the
// VNNI order of the packed layout). Values are widened to signed bytes, their offset subtracted, once
// per group and call for all the token tiles, so the products (TDPBSSD) need no offset correction.
// Split types (per-half sub-scales) take two half-depth products.
// The product of block b + 1 runs on the tile unit while block b's exact integer sums go through the
// integer and float steps of packed.h in AVX-512, so results are bitwise those of the other levels.
// Fewer than kAmxMinTokens tokens use the AVX-512 kernel (the same results; tiles do not pay for so few).
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "kernels/cpu/gemm_float.h"
#include "kernels/cpu/packed.h"

namespace serval::cpu {
namespace {

constexpr int kTileTokens = 16;

// The calling thread's buffer for widened weights: 64-byte aligned, grown when needed.
uint8_t* widen_buffer(size_t bytes) {
  thread_local std::unique_ptr<uint8_t[], WeightsDeleter> buf;
  thread_local size_t capacity = 0;
  if (capacity < bytes) {
    buf = alloc_weights(bytes);
    if (!buf) std::abort();
    capacity = bytes;
  }
  return buf.get();
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two tile layouts (tile state is per thread; a thread loads the one its kernel needs):
//   plain: 0 - 3 sums (16 tokens x 16 rows int32); 4, 5 activations (16 x 32); 6, 7 weights (8 x 64).
//          One token tile x one group keeps two blocks in flight (sums 0, 1; activations and weights
//          by the block's parity); two token tiles x two groups (quad16) run one block's four
//          products at a time;
//   split: 0, 1 and 2, 3 the sums of two blocks' halves in flight; 4, 5 activation halves (16 x 16);
//          6, 7 weight halves (4 x 64).
//   bf16:  0 - 3 float sums (16 tokens x 16 rows); 4, 5 activations (16 tokens x 16 BF16 pairs);
//          6, 7 weights (16 pairs x 16 rows x 2): bf16_quad.
enum class Tiles { None, Plain, Split, Bf16 };

void configure_tiles(Tiles want) {
  thread_local Tiles current = Tiles::None;
  if (current == want) return;
  TileConfig c;
  const int plain[8][2] = {{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 32}, {16, 32}, {8, 64}, {8, 64}};
  const int split[8][2] = {{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 16}, {16, 16}, {4, 64}, {4, 64}};
  const int bf16[8][2] = {{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}};
  const auto& shape = want == Tiles::Plain ? plain : want == Tiles::Split ? split : bf16;
  for (int i = 0; i < 8; ++i) c.rows[i] = uint8_t(shape[i][0]), c.colsb[i] = uint16_t(shape[i][1]);
  // GCC 12 does not model LDTILECFG as reading the whole 64 bytes and drops the stores above
  // without this barrier.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
  current = want;
}

// A block's values as signed bytes in the packed order: nibbles widened, the offset subtracted, so that
// a signed-by-signed tile product (TDPBSSD) gives S - offset * sum(x) directly.
template <bool kNib, int kPlanes>
void widen_block(const uint8_t* blk, int offset, uint8_t* out) {
  const __m512i off = _mm512_set1_epi8(char(offset));
  if constexpr (!kNib) {
    for (int j = 0; j < 8; ++j) _mm512_store_si512(out + 64 * j, _mm512_sub_epi8(_mm512_load_si512(blk + 64 * j), off));
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i raw = _mm512_load_si512(blk + 64 * j);
    __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    if constexpr (kPlanes == kFp4Codes) {  // codes to values (packed.h)
      const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4Table)));
      lo = _mm512_shuffle_epi8(table, lo);
      hi = _mm512_shuffle_epi8(table, hi);
    }
    for (int p = 0; p < kPlanes; ++p) {  // plane p: bit 4 + p (StepMasks order)
      const __m512i bit = _mm512_set1_epi8(char(0x10 << p));
      __mmask64 mlo, mhi;
      std::memcpy(&mlo, blk + 256 + 64 * p + 8 * j, 8);
      std::memcpy(&mhi, blk + 256 + 64 * p + 8 * (j + 4), 8);
      lo = _mm512_mask_add_epi8(lo, mlo, lo, bit);
      hi = _mm512_mask_add_epi8(hi, mhi, hi, bit);
    }
    _mm512_store_si512(out + 64 * j, _mm512_sub_epi8(lo, off));
    _mm512_store_si512(out + 64 * (j + 4), _mm512_sub_epi8(hi, off));
  }
}

inline __m512i widen16(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i pair16(__m512i lo, __m512i hi) {
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
}

// Starts the tile products of block b: `wq` is the group's bytes (512 per block).
template <bool kSplit>
inline void issue(const PackedActs& x, const uint8_t* wq, int64_t t0, int64_t b) {
  const int8_t* xa = x.tiled.data() + ((t0 / kTileTokens) * x.n_blocks + b) * (kTileTokens * kPackBlock);
  const uint8_t* wb = wq + 512 * b;
  if constexpr (kSplit) {
    _tile_loadd(4, xa, kPackBlock);
    _tile_loadd(5, xa + 16, kPackBlock);
    _tile_loadd(6, wb, 64);
    _tile_loadd(7, wb + 256, 64);
    if (b & 1) {
      _tile_zero(2);
      _tile_zero(3);
      _tile_dpbssd(2, 4, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 5, 7);
    }
  } else if (b & 1) {
    _tile_zero(1);
    _tile_loadd(5, xa, kPackBlock);
    _tile_loadd(7, wb, 64);
    _tile_dpbssd(1, 5, 7);
  } else {
    _tile_zero(0);
    _tile_loadd(4, xa, kPackBlock);
    _tile_loadd(6, wb, 64);
    _tile_dpbssd(0, 4, 6);
  }
}

// Block b's sums (s: [half][token][row], the offset already out) into the super-block's integer sums, as
// packed.h says.
template <int kSub>
inline void add_block(const PackedWeights& w, int64_t g, int64_t b, int nt, const int32_t (*s)[kTileTokens][16],
                      __m512i* isum) {
  if constexpr (kSub == 2) {
    const __m512i slo = widen16(w.sub.data() + w.int_index(g, b)), shi = widen16(w.sub.data() + w.int_index(g, b) + kPackRows);
    for (int t = 0; t < nt; ++t) {
      const __m512i lo = _mm512_load_si512(s[0][t]), hi = _mm512_load_si512(s[1][t]);
      isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(_mm512_mullo_epi32(slo, lo), _mm512_mullo_epi32(shi, hi)));
    }
  } else if constexpr (kSub == 1) {
    const __m512i sl = widen16(w.sub.data() + w.int_index(g, b));
    for (int t = 0; t < nt; ++t) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(sl, _mm512_load_si512(s[0][t])));
  } else {
    for (int t = 0; t < nt; ++t) isum[t] = _mm512_add_epi32(isum[t], _mm512_load_si512(s[0][t]));
  }
}

// The float steps of one super-block (and its mins) for nt tokens.
template <bool kMins>
inline void finish_super(const PackedWeights& w, const PackedActs& x, int64_t g, int64_t sup, int64_t t0, int nt,
                         __m512i* isum, __m512* acc) {
  const int64_t nb = w.n_blocks;
  const size_t f = w.super_index(g, sup);
  const __m512 sc = group_scales16(w, f, w.fp4_codes);
  for (int t = 0; t < nt; ++t) {
    const __m512 xd = _mm512_set1_ps(x.d[(t0 + t) * nb + sup * w.sb]);
    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc, xd), _mm512_cvtepi32_ps(isum[t]), acc[t]);
  }
  if constexpr (kMins) {
    for (int t = 0; t < nt; ++t) isum[t] = _mm512_setzero_si512();  // now the mins' sums
    for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
      const __m512i mlo = widen16(w.min.data() + w.int_index(g, b));
      const __m512i mp = pair16(mlo, w.split ? widen16(w.min.data() + w.int_index(g, b) + kPackRows) : mlo);
      for (int t = 0; t < nt; ++t)
        isum[t] = _mm512_dpwssd_epi32(isum[t], mp, _mm512_set1_epi32(x.pairs[(t0 + t) * nb + b]));
    }
    const __m512 nm = _mm512_loadu_ps(w.neg_min.data() + f);
    for (int t = 0; t < nt; ++t) {
      const __m512 xd = _mm512_set1_ps(x.d[(t0 + t) * nb + sup * w.sb]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(nm, xd), _mm512_cvtepi32_ps(isum[t]), acc[t]);
    }
  }
}

// Block b's sums (s: [half][token][row]) for nt tokens of one tile: into the super-block's integer sums,
// or, for one-block super-blocks without sub-scales or mins (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4; kDirect), straight
// into the float accumulators: there I = S, so fma(scale * xd, float(S), acc) is packed.h's operation.
// `f` indexes the group's scales of block b's super-block, `xd` the first token's activation scale of it.
template <int kSub, bool kDirect>
inline void fold_block(const PackedWeights& w, int64_t g, int64_t b, size_t f, const float* xd, int nt,
                       const int32_t (*s)[kTileTokens][16], __m512i* isum, __m512* acc) {
  if constexpr (kDirect) {
    const __m512 scale = group_scales16(w, f, w.fp4_codes);
    const int64_t nb = w.n_blocks;
    for (int t = 0; t < nt; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(xd[t * nb])),
                               _mm512_cvtepi32_ps(_mm512_load_si512(s[0][t])), acc[t]);
  } else {
    add_block<kSub>(w, g, b, nt, s, isum);
  }
}

void store_rows(const PackedWeights& w, int64_t g, int64_t t0, int nt, const __m512* acc, float* y) {
  const int64_t r0 = g * kPackRows;
  const int valid = int(w.rows - r0 < kPackRows ? w.rows - r0 : kPackRows);
  const __mmask16 mask = __mmask16((1u << valid) - 1);
  for (int t = 0; t < nt; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * w.rows + r0, mask, acc[t]);
}

// 16 tokens x one group: the product of block b + 1 is issued before block b's sums are read. kFull:
// nt is 16, so the token loops have constant bounds.
template <bool kSplit, int kSub, bool kMins, bool kFull>
void tile16(const PackedWeights& w, const PackedActs& x, const uint8_t* wq, int64_t g, int64_t t0, int nt_in,
            float* y) {
  constexpr bool kDirect = kSub == 0 && !kMins;
  const int nt = kFull ? kTileTokens : nt_in;
  alignas(64) int32_t s[2][kTileTokens][16];
  __m512 acc[kTileTokens];
  __m512i isum[kTileTokens];
  for (int t = 0; t < kTileTokens; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t nb = w.n_blocks;
  issue<kSplit>(x, wq, t0, 0);
  for (int64_t sup = 0; sup < w.n_super; ++sup) {
    if constexpr (!kDirect)
      for (int t = 0; t < kTileTokens; ++t) isum[t] = _mm512_setzero_si512();
    for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
      if (b + 1 < nb) issue<kSplit>(x, wq, t0, b + 1);
      if (kSplit && (b & 1)) {
        _tile_stored(2, s[0], 64);
        _tile_stored(3, s[1], 64);
      } else if (kSplit) {
        _tile_stored(0, s[0], 64);
        _tile_stored(1, s[1], 64);
      } else if (b & 1) {
        _tile_stored(1, s[0], 64);
      } else {
        _tile_stored(0, s[0], 64);
      }
      fold_block<kSub, kDirect>(w, g, b, w.super_index(g, b), x.d.data() + t0 * nb + b, nt, s,
                                isum, acc);
    }
    if constexpr (!kDirect) finish_super<kMins>(w, x, g, sup, t0, nt, isum, acc);
  }
  store_rows(w, g, t0, nt, acc, y);
}

// Two token tiles (t0 and t0 + 16, whose nt1 <= 16 tokens may be a partial tile: the tiled activations
// are zero past the last token) x two groups (g, g + 1; widened weights wq0, wq1), for types without
// half-block sums. Per block: the four sums of block b are stored, then block b + 1's four products are
// issued (sums c = 2 * group + token tile), then block b's sums are folded while the tile unit works:
// four independent products per block rather than one, and each activation and weight tile loaded
// for two products. Every token and row gets tile16's operations in its order.
template <int kSub, bool kMins>
void quad16(const PackedWeights& w, const PackedActs& x, const uint8_t* wq0, const uint8_t* wq1, int64_t g, int64_t t0,
            int nt1, float* y) {
  constexpr bool kDirect = kSub == 0 && !kMins;
  alignas(64) int32_t s[4][1][kTileTokens][16];
  __m512 acc[4][kTileTokens];
  __m512i isum[4][kTileTokens];
  const int nt[4] = {kTileTokens, nt1, kTileTokens, nt1};
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const int64_t nb = w.n_blocks;
  constexpr int64_t kTileBytes = kTileTokens * kPackBlock;
  const int8_t* xa0 = x.tiled.data() + (t0 / kTileTokens) * nb * kTileBytes;
  const int8_t* xa1 = xa0 + nb * kTileBytes;
  const auto issue4 = [&](int64_t b) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, xa0 + b * kTileBytes, kPackBlock);
    _tile_loadd(5, xa1 + b * kTileBytes, kPackBlock);
    _tile_loadd(6, wq0 + 512 * b, 64);
    _tile_loadd(7, wq1 + 512 * b, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 5, 6);
    _tile_dpbssd(2, 4, 7);
    _tile_dpbssd(3, 5, 7);
  };
  issue4(0);
  for (int64_t sup = 0; sup < w.n_super; ++sup) {
    if constexpr (!kDirect)
      for (auto& a : isum)
        for (auto& v : a) v = _mm512_setzero_si512();
    for (int64_t b = sup * w.sb; b < (sup + 1) * w.sb; ++b) {
      _tile_stored(0, s[0][0], 64);
      _tile_stored(1, s[1][0], 64);
      _tile_stored(2, s[2][0], 64);
      _tile_stored(3, s[3][0], 64);
      if (b + 1 < nb) issue4(b + 1);
      for (int c = 0; c < 4; ++c) {
        const int64_t gc = g + c / 2, tc = t0 + kTileTokens * (c % 2);
        fold_block<kSub, kDirect>(w, gc, b, w.super_index(gc, b), x.d.data() + tc * nb + b, nt[c],
                                  s[c], isum[c], acc[c]);
      }
    }
    if constexpr (!kDirect)
      for (int c = 0; c < 4; ++c)
        finish_super<kMins>(w, x, g + c / 2, sup, t0 + kTileTokens * (c % 2), nt[c], isum[c], acc[c]);
  }
  for (int c = 0; c < 4; ++c) store_rows(w, g + c / 2, t0 + kTileTokens * (c % 2), nt[c], acc[c], y);
}

template <bool kNib, int kPlanes, int kSub, bool kMins>
void run(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  constexpr bool kSplit = kSub == 2;
  configure_tiles(kSplit ? Tiles::Split : Tiles::Plain);
  const size_t group_bytes = size_t(w.n_blocks) * 512;
  uint8_t* widened = widen_buffer(2 * group_bytes);
  const auto widen_group = [&](int64_t g, uint8_t* out) {
    for (int64_t b = 0; b < w.n_blocks; ++b) {
      prefetch_ahead<kNib, kPlanes>(w.block(g, b));
      widen_block<kNib, kPlanes>(w.block(g, b), w.offset, out + 512 * b);
    }
  };
  for (int64_t g = g0; g < g1;) {
    const int64_t n_g = kSub == 0 && g + 1 < g1 ? 2 : 1;  // groups widened: a pair runs quad16
    for (int64_t i = 0; i < n_g; ++i) widen_group(g + i, widened + i * group_bytes);
    int64_t t = t0;
    if constexpr (kSub == 0)
      for (; n_g == 2 && t + kTileTokens < t1; t += 2 * kTileTokens)
        quad16<kSub, kMins>(w, x, widened, widened + group_bytes, g, t,
                            int(t1 - t - kTileTokens < kTileTokens ? t1 - t - kTileTokens : kTileTokens), y);
    for (int64_t i = 0; i < n_g; ++i)
      for (int64_t tt = t; tt < t1; tt += kTileTokens) {
        const uint8_t* wq = widened + i * group_bytes;
        if (t1 - tt >= kTileTokens) tile16<kSplit, kSub, kMins, true>(w, x, wq, g + i, tt, kTileTokens, y);
        else tile16<kSplit, kSub, kMins, false>(w, x, wq, g + i, tt, int(t1 - tt), y);
      }
    g += n_g;
  }
}

// kT token tiles (t, t + 16) x kG groups (g, g + 1) of BF16 tiles: the sums c = 2 * group + token tile
// accumulate every 32-deep K block in the tile unit, then go to y: straight from the tile for a full
// 16 x 16 block, through a buffer for a partial one (fewer than 16 tokens or rows).
template <int kG, int kT>
void bf16_quad(const PackedFloatWeights& w, const FloatActs& x, int64_t g, int64_t t, int64_t t1, float* y) {
  const int64_t a_stride = w.kpad * 2;  // bytes per token: kpad BF16 values
  const uint8_t* a0 = reinterpret_cast<const uint8_t*>(x.pairs.data()) + t * a_stride;
  const uint8_t* a1 = a0 + kTileTokens * a_stride;
  const uint8_t* b0 = reinterpret_cast<const uint8_t*>(w.group(g));
  const uint8_t* b1 = reinterpret_cast<const uint8_t*>(w.group(kG == 2 ? g + 1 : g));
  _tile_zero(0);
  if constexpr (kT == 2) _tile_zero(1);
  if constexpr (kG == 2) _tile_zero(2);
  if constexpr (kG == 2 && kT == 2) _tile_zero(3);
  for (int64_t kb = 0; kb < w.kpad / 32; ++kb) {
    _tile_loadd(4, a0 + 64 * kb, a_stride);
    if constexpr (kT == 2) _tile_loadd(5, a1 + 64 * kb, a_stride);
    _tile_loadd(6, b0 + 1024 * kb, 64);
    if constexpr (kG == 2) _tile_loadd(7, b1 + 1024 * kb, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kT == 2) _tile_dpbf16ps(1, 5, 6);
    if constexpr (kG == 2) _tile_dpbf16ps(2, 4, 7);
    if constexpr (kG == 2 && kT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  // Tile numbers are part of the instruction (the intrinsics take literals).
  const auto store = [](int c, void* p, int64_t stride) {
    switch (c) {
      case 0: _tile_stored(0, p, stride); break;
      case 1: _tile_stored(1, p, stride); break;
      case 2: _tile_stored(2, p, stride); break;
      default: _tile_stored(3, p, stride); break;
    }
  };
  const auto put = [&](int c) {
    const int64_t tok = t + kTileTokens * (c % 2), r0 = (g + c / 2) * kPackRows;
    const int64_t nt = t1 - tok < kTileTokens ? t1 - tok : kTileTokens, valid = w.rows - r0 < 16 ? w.rows - r0 : 16;
    float* dst = y + tok * w.rows + r0;
    if (nt == kTileTokens && valid == 16) {
      store(c, dst, w.rows * 4);
      return;
    }
    alignas(64) float buf[kTileTokens][16];
    store(c, buf, 64);
    const __mmask16 mask = __mmask16((1u << valid) - 1);
    for (int64_t i = 0; i < nt; ++i) _mm512_mask_storeu_ps(dst + i * w.rows, mask, _mm512_load_ps(buf[i]));
  };
  put(0);
  if constexpr (kT == 2) put(1);
  if constexpr (kG == 2) put(2);
  if constexpr (kG == 2 && kT == 2) put(3);
}

}  // namespace

void bf16_tile_row_amx(const float* x, int64_t cols, int64_t kpad, uint32_t* pairs) {
  uint16_t* out = reinterpret_cast<uint16_t*>(pairs);
  int64_t k = 0;
  for (; k + 16 <= cols; k += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), __m256i(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k))));
  if (k < cols) {
    const __mmask16 m = __mmask16((1u << (cols - k)) - 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), __m256i(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k))));
    k += 16;
  }
  for (; k < kpad; k += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_setzero_si256());
}

void bf16_tile_gemm_amx(const PackedFloatWeights& w, const FloatActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                        float* y) {
  configure_tiles(Tiles::Bf16);
  for (int64_t g = g0; g < g1; g += 2)
    for (int64_t t = t0; t < t1; t += 2 * kTileTokens) {
      const bool two_g = g + 1 < g1, two_t = t + kTileTokens < t1;
      if (two_g && two_t) bf16_quad<2, 2>(w, x, g, t, t1, y);
      else if (two_g) bf16_quad<2, 1>(w, x, g, t, t1, y);
      else if (two_t) bf16_quad<1, 2>(w, x, g, t, t1, y);
      else bf16_quad<1, 1>(w, x, g, t, t1, y);
    }
}

void packed_gemm_amx(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                     float* y) {
  // The tiled activations exist when the call quantized at this level (always, through cpu::matmul);
  // the AVX-512 kernel gives the same bits otherwise.
  if (t1 - t0 < kAmxMinTokens || x.tiled.empty() || t0 % kTileTokens != 0) return packed_gemm_avx512(w, x, g0, g1, t0, t1, y);
  with_layout(w.source, [&]<bool kNib, int kPlanes, int kSub, bool kMins>() {
    run<kNib, kPlanes, kSub, kMins>(w, x, g0, g1, t0, t1, y);
  });
}

}  // namespace serval::cpu
