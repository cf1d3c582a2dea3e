// The packed GEMM with AMX-INT8 tiles (Intel): per row group and block, one TDPBSUD multiplies 16
// tokens' activations (signed, A: 16 x 32 bytes) by the group's weights (unsigned, B: the packed
// block as it is stored, 8 rows of 16 x 4 bytes: the VNNI order the layout already has). The exact
// integer sums then go through the float steps of packed.h in AVX-512, so results are bitwise those
// of the other levels. Split types (Q6_K) take two half-depth products (S_lo, S_hi). Fewer than
// kMinTokens tokens use the AVX-512 kernel (the same results; tiles do not pay for so few rows).
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/packed.h"

namespace serval::cpu {
namespace {

constexpr int kTileTokens = 16;
constexpr int64_t kMinTokens = 4;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two tile layouts (tile state is per thread; a thread loads the one its kernel needs):
//   plain: 0, 1 sums (16 tokens x 16 rows int32) of two blocks in flight; 2, 3 activations (16 x 32);
//          4, 5 weights (8 x 64);
//   split: 0, 1 sums of the two halves; 4, 5 activation halves (16 x 16); 6, 7 weight halves (4 x 64).
enum class Tiles { None, Plain, Split };

void configure_tiles(Tiles want) {
  thread_local Tiles current = Tiles::None;
  if (current == want) return;
  TileConfig c;
  const int plain[8][2] = {{16, 64}, {16, 64}, {16, 32}, {16, 32}, {8, 64}, {8, 64}, {0, 0}, {0, 0}};
  const int split[8][2] = {{16, 64}, {16, 64}, {0, 0}, {0, 0}, {16, 16}, {16, 16}, {4, 64}, {4, 64}};
  const auto& shape = want == Tiles::Plain ? plain : split;
  for (int i = 0; i < 8; ++i) c.rows[i] = uint8_t(shape[i][0]), c.colsb[i] = uint16_t(shape[i][1]);
  // GCC 12 does not model LDTILECFG as reading the whole 64 bytes and drops the stores above
  // without this barrier.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
  current = want;
}

// The block's values as bytes (nibble types are widened into `buf`).
template <bool kNib, bool kPlane>
const uint8_t* block_bytes(const uint8_t* blk, uint8_t* buf) {
  if constexpr (!kNib) return blk;
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
    _mm512_store_si512(buf + 64 * j, lo);
    _mm512_store_si512(buf + 64 * (j + 4), hi);
  }
  return buf;
}

// The float steps of packed.h for one block: s0 (and s1 for split types) hold the integer sums.
template <bool kSplit, bool kMins>
inline void accumulate(const PackedWeights& w, const PackedActs& x, int64_t g, int64_t b, int64_t t0, int nt,
                       const int32_t (*s0)[16], const int32_t (*s1)[16], __m512* acc) {
  const int64_t nb = w.n_blocks;
  const size_t i = w.index(g, b);
  const __m512 sc = _mm512_loadu_ps(w.scale.data() + i);
  const __m512 nm = kMins ? _mm512_loadu_ps(w.neg_min.data() + i) : _mm512_setzero_ps();
  const __m512i slo = kSplit ? _mm512_loadu_si512(w.sub.data() + 2 * i) : _mm512_setzero_si512();
  const __m512i shi = kSplit ? _mm512_loadu_si512(w.sub.data() + 2 * i + kPackRows) : _mm512_setzero_si512();
  for (int t = 0; t < nt; ++t) {
    const int32_t* xs = x.sums.data() + ((t0 + t) * nb + b) * 2;
    __m512i isum;
    if constexpr (kSplit) {
      const __m512i lo = _mm512_sub_epi32(_mm512_load_si512(s0[t]), _mm512_set1_epi32(w.offset * xs[0]));
      const __m512i hi = _mm512_sub_epi32(_mm512_load_si512(s1[t]), _mm512_set1_epi32(w.offset * xs[1]));
      isum = _mm512_add_epi32(_mm512_mullo_epi32(slo, lo), _mm512_mullo_epi32(shi, hi));
    } else {
      isum = _mm512_sub_epi32(_mm512_load_si512(s0[t]), _mm512_set1_epi32(w.offset * (xs[0] + xs[1])));
    }
    const __m512 xd = _mm512_set1_ps(x.d[(t0 + t) * nb + b]);
    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc, xd), _mm512_cvtepi32_ps(isum), acc[t]);
    if constexpr (kMins) acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(nm, xd), _mm512_set1_ps(float(xs[0] + xs[1])), acc[t]);
  }
}

void store_rows(const PackedWeights& w, int64_t g, int64_t t0, int nt, const __m512* acc, float* y) {
  const int64_t r0 = g * kPackRows;
  const int valid = int(w.rows - r0 < kPackRows ? w.rows - r0 : kPackRows);
  const __mmask16 mask = __mmask16((1u << valid) - 1);
  for (int t = 0; t < nt; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * w.rows + r0, mask, acc[t]);
}

// Plain types: the product of block b + 1 runs on the tile unit while block b's sums are scaled.
template <bool kNib, bool kPlane, bool kMins>
void tile16_plain(const PackedWeights& w, const PackedActs& x, int64_t g, int64_t t0, int nt, float* y) {
  alignas(64) uint8_t wbuf[2][512];
  alignas(64) int32_t s[kTileTokens][16];
  __m512 acc[kTileTokens];
  for (int t = 0; t < kTileTokens; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t nb = w.n_blocks;
  auto issue = [&](int64_t b) {
    const uint8_t* wb = block_bytes<kNib, kPlane>(w.block(g, b), wbuf[b & 1]);
    const int8_t* xa = x.row(t0) + b * kPackBlock;
    if (b & 1) {
      _tile_zero(1);
      _tile_loadd(3, xa, x.cols);
      _tile_loadd(5, wb, 64);
      _tile_dpbsud(1, 3, 5);
    } else {
      _tile_zero(0);
      _tile_loadd(2, xa, x.cols);
      _tile_loadd(4, wb, 64);
      _tile_dpbsud(0, 2, 4);
    }
  };
  issue(0);
  for (int64_t b = 0; b < nb; ++b) {
    if (b + 1 < nb) issue(b + 1);
    if (b & 1) _tile_stored(1, s, 64);
    else _tile_stored(0, s, 64);
    accumulate<false, kMins>(w, x, g, b, t0, nt, s, nullptr, acc);
  }
  store_rows(w, g, t0, nt, acc, y);
}

// Split types (Q6_K): two half-depth products per block.
void tile16_split(const PackedWeights& w, const PackedActs& x, int64_t g, int64_t t0, int nt, float* y) {
  alignas(64) int32_t s0[kTileTokens][16], s1[kTileTokens][16];
  __m512 acc[kTileTokens];
  for (int t = 0; t < kTileTokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.n_blocks; ++b) {
    const uint8_t* wb = w.block(g, b);
    const int8_t* xa = x.row(t0) + b * kPackBlock;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, xa, x.cols);
    _tile_loadd(5, xa + 16, x.cols);
    _tile_loadd(6, wb, 64);
    _tile_loadd(7, wb + 256, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 5, 7);
    _tile_stored(0, s0, 64);
    _tile_stored(1, s1, 64);
    accumulate<true, false>(w, x, g, b, t0, nt, s0, s1, acc);
  }
  store_rows(w, g, t0, nt, acc, y);
}

template <bool kNib, bool kPlane, bool kMins>
void run_plain(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  configure_tiles(Tiles::Plain);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t t = t0; t < t1; t += kTileTokens)
      tile16_plain<kNib, kPlane, kMins>(w, x, g, t, int(t1 - t < kTileTokens ? t1 - t : kTileTokens), y);
}

void run_split(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1, float* y) {
  configure_tiles(Tiles::Split);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t t = t0; t < t1; t += kTileTokens) tile16_split(w, x, g, t, int(t1 - t < kTileTokens ? t1 - t : kTileTokens), y);
}

}  // namespace

void packed_gemm_amx(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                     float* y) {
  if (t1 - t0 < kMinTokens) return packed_gemm_avx512(w, x, g0, g1, t0, t1, y);
  if (w.split) return run_split(w, x, g0, g1, t0, t1, y);
  if (w.nibbles && w.plane) return w.mins ? run_plain<true, true, true>(w, x, g0, g1, t0, t1, y) : run_plain<true, true, false>(w, x, g0, g1, t0, t1, y);
  if (w.nibbles) return w.mins ? run_plain<true, false, true>(w, x, g0, g1, t0, t1, y) : run_plain<true, false, false>(w, x, g0, g1, t0, t1, y);
  return run_plain<false, false, false>(w, x, g0, g1, t0, t1, y);
}

}  // namespace serval::cpu
