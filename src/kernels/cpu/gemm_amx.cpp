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
//   plain: 0, 1 sums (16 tokens x 16 rows int32) of two blocks in flight; 2, 3 activations (16 x 32);
//          4, 5 weights (8 x 64);
//   split: 0, 1 and 2, 3 the sums of two blocks' halves in flight; 4, 5 activation halves (16 x 16);
//          6, 7 weight halves (4 x 64).
enum class Tiles { None, Plain, Split };

void configure_tiles(Tiles want) {
  thread_local Tiles current = Tiles::None;
  if (current == want) return;
  TileConfig c;
  const int plain[8][2] = {{16, 64}, {16, 64}, {16, 32}, {16, 32}, {8, 64}, {8, 64}, {0, 0}, {0, 0}};
  const int split[8][2] = {{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 16}, {16, 16}, {4, 64}, {4, 64}};
  const auto& shape = want == Tiles::Plain ? plain : split;
  for (int i = 0; i < 8; ++i) c.rows[i] = uint8_t(shape[i][0]), c.colsb[i] = uint16_t(shape[i][1]);
  // GCC 12 does not model LDTILECFG as reading the whole 64 bytes and drops the stores above
  // without this barrier.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
  current = want;
}

// A block's values as signed bytes in the packed order: nibbles widened, the offset subtracted, so that
// a signed-by-signed tile product (TDPBSSD) gives S - offset * sum(x) directly.
template <bool kNib, bool kPlane>
void widen_block(const uint8_t* blk, int offset, uint8_t* out) {
  const __m512i off = _mm512_set1_epi8(char(offset));
  if constexpr (!kNib) {
    for (int j = 0; j < 8; ++j) _mm512_store_si512(out + 64 * j, _mm512_sub_epi8(_mm512_load_si512(blk + 64 * j), off));
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  for (int j = 0; j < 4; ++j) {
    const __m512i raw = _mm512_load_si512(blk + 64 * j);
    __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    if constexpr (kPlane) {
      __mmask64 mlo, mhi;
      std::memcpy(&mlo, blk + 256 + 8 * j, 8);
      std::memcpy(&mhi, blk + 256 + 8 * (j + 4), 8);
      lo = _mm512_mask_add_epi8(lo, mlo, lo, bit4);
      hi = _mm512_mask_add_epi8(hi, mhi, hi, bit4);
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
    _tile_loadd(3, xa, kPackBlock);
    _tile_loadd(5, wb, 64);
    _tile_dpbssd(1, 3, 5);
  } else {
    _tile_zero(0);
    _tile_loadd(2, xa, kPackBlock);
    _tile_loadd(4, wb, 64);
    _tile_dpbssd(0, 2, 4);
  }
}

// Block b's sums (s: [half][token][row]) into the super-block's integer sums, as packed.h says.
// Block b's sums (s: [half][token][row], the offset already out) into the super-block's integer sums.
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
  const __m512 sc = _mm512_loadu_ps(w.scale.data() + f);
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

void store_rows(const PackedWeights& w, int64_t g, int64_t t0, int nt, const __m512* acc, float* y) {
  const int64_t r0 = g * kPackRows;
  const int valid = int(w.rows - r0 < kPackRows ? w.rows - r0 : kPackRows);
  const __mmask16 mask = __mmask16((1u << valid) - 1);
  for (int t = 0; t < nt; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * w.rows + r0, mask, acc[t]);
}

// 16 tokens x one group: the product of block b + 1 is issued before block b's sums are read.
template <bool kSplit, int kSub, bool kMins>
void tile16(const PackedWeights& w, const PackedActs& x, const uint8_t* wq, int64_t g, int64_t t0, int nt, float* y) {
  alignas(64) int32_t s[2][kTileTokens][16];
  __m512 acc[kTileTokens];
  __m512i isum[kTileTokens];
  for (int t = 0; t < kTileTokens; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t nb = w.n_blocks;
  issue<kSplit>(x, wq, t0, 0);
  for (int64_t sup = 0; sup < w.n_super; ++sup) {
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
      add_block<kSub>(w, g, b, nt, s, isum);
    }
    finish_super<kMins>(w, x, g, sup, t0, nt, isum, acc);
  }
  store_rows(w, g, t0, nt, acc, y);
}

template <bool kNib, bool kPlane, int kSub, bool kMins>
void run(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  constexpr bool kSplit = kSub == 2;
  configure_tiles(kSplit ? Tiles::Split : Tiles::Plain);
  uint8_t* widened = widen_buffer(size_t(w.n_blocks) * 512);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < w.n_blocks; ++b) {
      prefetch_ahead<kNib, kPlane>(w.block(g, b));
      widen_block<kNib, kPlane>(w.block(g, b), w.offset, widened + 512 * b);
    }
    const uint8_t* wq = widened;
    for (int64_t t = t0; t < t1; t += kTileTokens)
      tile16<kSplit, kSub, kMins>(w, x, wq, g, t, int(t1 - t < kTileTokens ? t1 - t : kTileTokens), y);
  }
}

}  // namespace

void packed_gemm_amx(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                     float* y) {
  // The tiled activations exist when the call quantized at this level (always, through cpu::matmul);
  // the AVX-512 kernel gives the same bits otherwise.
  if (t1 - t0 < kAmxMinTokens || x.tiled.empty() || t0 % kTileTokens != 0) return packed_gemm_avx512(w, x, g0, g1, t0, t1, y);
  with_layout(w.source, [&]<bool kNib, bool kPlane, int kSub, bool kMins>() {
    run<kNib, kPlane, kSub, kMins>(w, x, g0, g1, t0, t1, y);
  });
}

}  // namespace serval::cpu
