// The attention tile kernel, written once over a SIMD policy `V` and compiled once per ISA level
// (attention.cpp: portable; attention_avx2.cpp; attention_avx512.cpp), each with its own flags.
//
// Rows in lanes: the rows of a tile (query q, head h of the KV group: row q * group + h) are the
// lanes of the vectors; keys and head dimensions are loops. Every vector operation is therefore
// lane-wise, and a row's result is the same sequence of IEEE operations whatever the other lanes
// hold, whatever the lane width, and whichever level runs it. That is what makes the op batch
// invariant and the levels agree bitwise. A tile of one query (a decode step) has few rows (the
// group: 7 of 16 lanes for the Qwen 0.5B), so it puts keys in the lanes for the scores and the
// softmax and head dimensions for weights x V (chunk_single: the scores and stats_single or
// weights_single over all of a chunk's key tiles, then pv_single tile by tile): the same operations
// per (row, key) and per (row, dimension), in the same order, so the same bits.
//
// Per lane (row r, attending positions [first_r, last_r]), over fixed chunks of kChunk positions
// and within them fixed tiles of kKeyTile positions (both aligned to absolute positions):
//   s_j = (sum_d q_d * k_jd, fused multiply-adds in order d = 0, 1, ...) * scale
//         (-inf where position j is outside [first_r, last_r])
// Pass 1, per chunk from (m, l) = (-1e30, 0), per tile:
//   m' = max(m, T(s))      l' = l * exp(m - m') + T(exp(s_j - m'))
//   where T is the tile's pairwise tree over its 16 keys: key j with j + 8, then j + 4, j + 2, j + 1
// and the chunks' (m, l) merged in position order into (M, L).
// Pass 2 (the scores computed again), per chunk from acc = 0, per tile:
//   w_j = exp(s_j - M) * (1 / L), rounded to F16 with an F16 cache (the reference's and llama.cpp's
//         rounding point: the normalised weight)
//   acc'_d = acc_d + w_0 v_0d + ... + w_15 v_15d     (fused, keys in order)
// and out = the chunks' acc added in position order. A key a lane does not see leaves its state
// bitwise unchanged (exp(-inf) = 0, masked FMAs, exp(0) = 1 exactly when the max does not move),
// and so does a tile or chunk without any of its keys, so a lane sees the same operations whether
// its tile holds other queries or not.
//
// Everything here has internal linkage: this file is included by translation units compiled with
// different instruction-set flags.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/cpu/attention_tile.h"

namespace serval::cpu::attn {
namespace {

constexpr float kNegBig = -1e30f;  // the initial running max (finite: exp(kNegBig - kNegBig) = 1)
constexpr float kInf = __builtin_inff();
// How far ahead a tile's rows are fetched. Measured (serval_bench_attention, 0.5B decode at 8K): 2
// tiles 13.9 ms a step, 4 tiles 14.2, none 17.5; the first 64 bytes of each row only, 16.5.
constexpr int kPrefetchTiles = 2;
constexpr int kTilesPerChunk = int(kChunk / kKeyTile);

// exp(x) for x <= 0 (larger x are clamped at 88): Cody-Waite reduction to r in [-ln2/2, ln2/2],
// Cephes' degree-7 polynomial, scaling by 2^n through the exponent bits. 0 for x < -87 (so
// exp(-inf) = 0), exactly 1 for x = 0. Relative error about 2 ulp.
template <class V>
inline typename V::T vexp(typename V::T x) {
  using T = typename V::T;
  const T xc = V::max(V::min(x, V::set1(88.0f)), V::set1(-88.0f));
  const T magic = V::set1(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to nearest
  const T fx = V::sub(V::add(V::mul(xc, V::set1(1.44269504088896341f)), magic), magic);
  T r = V::fma(fx, V::set1(-0.693359375f), xc);
  r = V::fma(fx, V::set1(2.12194440e-4f), r);
  const T z = V::mul(r, r);
  T y = V::set1(1.9875691500e-4f);
  y = V::fma(y, r, V::set1(1.3981999507e-3f));
  y = V::fma(y, r, V::set1(8.3334519073e-3f));
  y = V::fma(y, r, V::set1(4.1665795894e-2f));
  y = V::fma(y, r, V::set1(1.6666665459e-1f));
  y = V::fma(y, r, V::set1(5.0000001201e-1f));
  y = V::fma(y, z, r);
  y = V::add(y, V::set1(1.0f));
  const T e = V::mul(y, V::pow2i(fx));
  return V::select(V::lt(x, V::set1(-87.0f)), V::zero(), e);
}

// cap * tanh(x / cap), Gemma 2's soft-capping of scores: tanh(y) = sign(y) (1 - e) / (1 + e) with
// e = exp(-2 |y|) <= 1 (vexp's range), the same operations at every level.
template <class V>
inline typename V::T vsoftcap(typename V::T x, float cap) {
  using T = typename V::T;
  const T y = V::mul(x, V::set1(1.0f / cap));
  const T a = V::max(y, V::sub(V::zero(), y));
  const T e = vexp<V>(V::mul(a, V::set1(-2.0f)));
  const T t = V::div(V::sub(V::set1(1.0f), e), V::add(V::set1(1.0f), e));
  return V::mul(V::select(V::lt(y, V::zero()), V::sub(V::zero(), t), t), V::set1(cap));
}

// Scratch layout of one tile (floats; every part starts on a 16-float boundary).
struct Layout {
  int rows = 0, nv = 0, w = 0, d = 0;
  int64_t qt = 0, firstv = 0, lastv = 0, inv = 0, rvfirst = 0, rvlast = 0, sp = 0, st = 0, run = 0, kt = 0, vt = 0,
          zrow = 0, acct = 0, ktt = 0, skc = 0, red = 0;
  int64_t state = 0;  // floats of one state
};

inline int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

inline Layout layout(int rows, int d, int w) {
  Layout L;
  L.rows = rows, L.w = w, L.d = d, L.nv = (rows + w - 1) / w;
  const int64_t nvw = int64_t(L.nv) * w;
  L.state = state_floats(rows, d, w);
  int64_t o = 0;
  L.qt = o, o += up16(nvw * d);
  L.firstv = o, o += up16(nvw);
  L.lastv = o, o += up16(nvw);
  L.inv = o, o += up16(nvw);
  L.rvfirst = o, o += up16(L.nv);
  L.rvlast = o, o += up16(L.nv);
  L.sp = o, o += up16(nvw * kKeyTile);
  L.st = o, o += up16(L.state);
  L.run = o, o += up16(L.state);
  L.kt = o, o += up16(int64_t(kKeyTile) * d);
  L.vt = o, o += up16(int64_t(kKeyTile) * d);
  L.zrow = o, o += up16(d);
  L.acct = o, o += up16(nvw * d);
  L.ktt = o, o += up16(int64_t(kKeyTile) * d);
  L.skc = o, o += up16(scores_floats(rows, w));
  L.red = o, o += up16(3 * kTilesPerChunk * nvw);
  return L;
}

// A state: m at [0, nv*w), l at [nv*w, 2*nv*w), acc of vector v, dimension d at
// 2*nv*w + (v*D + d)*w. A chunk's state holds its statistics (pass 1) and its weighted sum of
// values (pass 2); the running state holds the merged statistics and the sum of the chunks' sums.
inline float* acc_of(float* s, const Layout& L) { return s + 2 * int64_t(L.nv) * L.w; }
inline const float* acc_of(const float* s, const Layout& L) { return s + 2 * int64_t(L.nv) * L.w; }

template <class V>
void stats_reset(float* s, const Layout& L) {
  for (int v = 0; v < L.nv; ++v) {
    V::store(s + v * V::W, V::set1(kNegBig));
    V::store(s + (L.nv + v) * V::W, V::zero());
  }
}

template <class V>
void acc_reset(float* s, const Layout& L) {
  float* acc = acc_of(s, L);
  for (int64_t i = 0; i < int64_t(L.nv) * L.d; ++i) V::store(acc + i * V::W, V::zero());
}

// Lanes whose [first, last] meets chunk c.
template <class V>
typename V::M chunk_lanes(const float* sc, const Layout& L, int v, int64_t c) {
  const typename V::T lo = V::set1(float(c * kChunk)), hi = V::set1(float(c * kChunk + kChunk - 1));
  return V::mand(V::le(V::load(sc + L.firstv + v * V::W), hi), V::le(lo, V::load(sc + L.lastv + v * V::W)));
}

// Merges the statistics of chunk c (state `cs`) into the running state `r`: lanes without keys in
// the chunk are kept as they are.
template <class V>
void stats_merge(float* r, const float* cs, const float* sc, const Layout& L, int64_t c) {
  using T = typename V::T;
  const int W = V::W;
  for (int v = 0; v < L.nv; ++v) {
    const T mc = V::load(cs + v * W), lc = V::load(cs + (L.nv + v) * W);
    const T m = V::load(r + v * W), l = V::load(r + (L.nv + v) * W);
    const auto has = chunk_lanes<V>(sc, L, v, c);
    const T mn = V::max(m, mc);
    const T a = vexp<V>(V::sub(m, mn)), b = vexp<V>(V::sub(mc, mn));
    V::store(r + v * W, V::select(has, mn, m));
    V::store(r + (L.nv + v) * W, V::select(has, V::fma(lc, b, V::mul(l, a)), l));
  }
}

// Adds chunk c's weighted sum of values (state `cs`) to the running sum of `r`.
template <class V>
void acc_add(float* r, const float* cs, const float* sc, const Layout& L, int64_t c) {
  for (int v = 0; v < L.nv; ++v) {
    const auto has = chunk_lanes<V>(sc, L, v, c);
    float* racc = acc_of(r, L) + int64_t(v) * L.d * V::W;
    const float* cacc = acc_of(cs, L) + int64_t(v) * L.d * V::W;
    for (int d = 0; d < L.d; ++d) {
      const typename V::T o = V::load(racc + d * V::W);
      V::store(racc + d * V::W, V::select(has, V::add(o, V::load(cacc + d * V::W)), o));
    }
  }
}

// A tile's max and sum over its keys, in one fixed order: key j with key j + 8, then j + 4, j + 2,
// j + 1 (the lower key the left operand). tree: over the keys of rows in lanes (x[j]: key j);
// lane_tree: over keys in lanes (xs: kKeyTile / W vectors of keys), the same pairs in the same order,
// so the two layouts give the same bits.
static_assert(kKeyTile == 16, "the trees below pair keys j and j + 8, 4, 2, 1");
// The tree's levels after the first: a[j] = op(x[j], x[j + 8]) for j < 8 given.
template <class V, class Op>
inline typename V::T tree_from_halves(typename V::T* a, Op op) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) a[j] = op(a[j], a[j + 4]);
  a[0] = op(a[0], a[2]), a[1] = op(a[1], a[3]);
  return op(a[0], a[1]);
}

template <class V, class Op>
inline typename V::T tree(const typename V::T* x, Op op) {
  typename V::T a[kKeyTile / 2];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) a[j] = op(x[j], x[j + 8]);
  return tree_from_halves<V>(a, op);
}

template <class V, class Op>
inline float lane_tree(const typename V::T* xs, Op op) {
  static_assert(kKeyTile / V::W == 1 || kKeyTile / V::W == 2);
  typename V::T a = kKeyTile / V::W == 2 ? op(xs[0], xs[1]) : xs[0];  // W = 8: keys j and j + 8
  for (int k = V::W / 2; k >= 1; k /= 2) a = op(a, V::fold(a, k));
  return V::lane0(a);
}

// S[r][j] = sum_d Qt[r][d] * k_j[d] for RV row vectors and the kKeyTile keys.
template <class V, int RV>
void qk(const float* qt, int D, const float* const* kp, float* s) {
  using T = typename V::T;
  const int W = V::W;
  for (int jb = 0; jb < kKeyTile; jb += 8) {
    T acc[RV][8];
#pragma GCC unroll 16
    for (int r = 0; r < RV; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[r][j] = V::zero();
    for (int d = 0; d < D; ++d) {
      T q[RV];
#pragma GCC unroll 16
      for (int r = 0; r < RV; ++r) q[r] = V::load(qt + (int64_t(r) * D + d) * W);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const T k = V::set1(kp[jb + j][d]);
#pragma GCC unroll 16
        for (int r = 0; r < RV; ++r) acc[r][j] = V::fma(q[r], k, acc[r][j]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RV; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) V::store(s + (r * kKeyTile + jb + j) * W, acc[r][j]);
  }
}

// acc[r][d] += sum_j w[r][j] * v_j[d] (fused, keys in order) for dimensions [d0, d0 + DB).
template <class V, int RV, int DB, bool Masked>
inline void pv_block(float* acc, const float* w, const float* const* vp, int D, int d0,
                     const typename V::M (*valid)[kKeyTile]) {
  using T = typename V::T;
  const int W = V::W;
  T a[RV][DB];
#pragma GCC unroll 16
  for (int r = 0; r < RV; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < DB; ++i) a[r][i] = V::load(acc + (int64_t(r) * D + d0 + i) * W);
  for (int j = 0; j < kKeyTile; ++j) {
    T wj[RV];
#pragma GCC unroll 16
    for (int r = 0; r < RV; ++r) wj[r] = V::load(w + (r * kKeyTile + j) * W);
#pragma GCC unroll 8
    for (int i = 0; i < DB; ++i) {
      const T vv = V::set1(vp[j][d0 + i]);
#pragma GCC unroll 16
      for (int r = 0; r < RV; ++r) {
        if constexpr (Masked) a[r][i] = V::mask_fma(valid[r][j], wj[r], vv, a[r][i]);
        else a[r][i] = V::fma(wj[r], vv, a[r][i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RV; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < DB; ++i) V::store(acc + (int64_t(r) * D + d0 + i) * W, a[r][i]);
}

// Which of the tile's keys the lanes of row vector v see.
template <class V>
inline void validity(const Layout& L, const float* sc, int v, int64_t tlo, typename V::M* valid) {
  const typename V::T fv = V::load(sc + L.firstv + v * V::W), lv = V::load(sc + L.lastv + v * V::W);
#pragma GCC unroll 16
  for (int j = 0; j < kKeyTile; ++j) {
    const typename V::T pos = V::set1(float(tlo + j));
    valid[j] = V::mand(V::le(fv, pos), V::le(pos, lv));
  }
}

// The scaled scores of one key tile for row vector v (QK product done, in `s`): -inf for keys the
// lane does not see when Masked (their validity in `valid`).
template <class V, bool Masked>
inline void scores(const Layout& L, const float* sc, float scale, float softcap, int v, int64_t tlo, const float* s,
                   typename V::T* x, typename V::M* valid) {
  const typename V::T sv = V::set1(scale);
#pragma GCC unroll 16
  for (int j = 0; j < kKeyTile; ++j) x[j] = V::mul(V::load(s + j * V::W), sv);
  if (softcap > 0.0f)
    for (int j = 0; j < kKeyTile; ++j) x[j] = vsoftcap<V>(x[j], softcap);
  if constexpr (Masked) {
    validity<V>(L, sc, v, tlo, valid);
#pragma GCC unroll 16
    for (int j = 0; j < kKeyTile; ++j) x[j] = V::select(valid[j], x[j], V::set1(-kInf));
  }
}

// Pass 1 on one key tile for RV row vectors from vector v0: the running max and sum of the chunk.
template <class V, int RV, bool Masked>
void tile_stats(const Layout& L, float* sc, const TileArgs& a, int v0, int64_t tlo, const float* const* kp,
                float* cache) {
  using T = typename V::T;
  const int W = V::W;
  float* s = sc + L.sp + int64_t(v0) * kKeyTile * W;
  qk<V, RV>(sc + L.qt + int64_t(v0) * L.d * W, L.d, kp, s);
  float* st = sc + L.st;
  for (int r = 0; r < RV; ++r) {
    const int v = v0 + r;
    T x[kKeyTile];
    typename V::M valid[kKeyTile];
    scores<V, Masked>(L, sc, a.scale, a.softcap, v, tlo, s + r * kKeyTile * W, x, valid);
    if (cache)
#pragma GCC unroll 16
      for (int j = 0; j < kKeyTile; ++j) V::store(cache + (int64_t(v) * kKeyTile + j) * W, x[j]);
    const T mt = tree<V>(x, [](T p, T q) { return V::max(p, q); });
    const T m = V::load(st + v * W);
    const T mn = V::max(m, mt);
    T e[kKeyTile / 2];  // tree's first level as the exps are made: 8 vectors live, not 16
#pragma GCC unroll 8
    for (int j = 0; j < kKeyTile / 2; ++j) e[j] = V::add(vexp<V>(V::sub(x[j], mn)), vexp<V>(V::sub(x[j + 8], mn)));
    const T psum = tree_from_halves<V>(e, [](T p, T q) { return V::add(p, q); });
    V::store(st + v * W, mn);
    V::store(st + (L.nv + v) * W, V::fma(V::load(st + (L.nv + v) * W), vexp<V>(V::sub(m, mn)), psum));
  }
}

// Pass 2 on one key tile for RV row vectors from vector v0: the weights exp(s - M) / L (rounded to
// F16 with an F16 cache) times V, added to the chunk's sum. The scores are those pass 1 kept in
// `cache`, or are computed again (the same operations, so the same values).
template <class V, int RV, bool Masked>
void tile_values(const Layout& L, float* sc, const TileArgs& a, int v0, int64_t tlo, const float* const* kp,
                 const float* const* vp, const float* cache) {
  using T = typename V::T;
  const int W = V::W, D = L.d;
  float* s = sc + L.sp + int64_t(v0) * kKeyTile * W;
  if (!cache) qk<V, RV>(sc + L.qt + int64_t(v0) * D * W, D, kp, s);
  const float* run = sc + L.run;
  typename V::M valid[RV][kKeyTile];
  for (int r = 0; r < RV; ++r) {
    const int v = v0 + r;
    T x[kKeyTile];
    if (cache) {
#pragma GCC unroll 16
      for (int j = 0; j < kKeyTile; ++j) x[j] = V::load(cache + (int64_t(v) * kKeyTile + j) * W);
      if constexpr (Masked) validity<V>(L, sc, v, tlo, valid[r]);
    } else {
      scores<V, Masked>(L, sc, a.scale, a.softcap, v, tlo, s + r * kKeyTile * W, x, valid[r]);
    }
    const T m = V::load(run + v * W), inv = V::load(sc + L.inv + v * W);
#pragma GCC unroll 16
    for (int j = 0; j < kKeyTile; ++j) {
      const T wj = V::mul(vexp<V>(V::sub(x[j], m)), inv);
      V::store(s + (r * kKeyTile + j) * W, a.half ? V::f16_round(wj) : wj);
    }
  }
  float* acc = acc_of(sc + L.st, L) + int64_t(v0) * D * W;
  constexpr int DB = 8;
  int d0 = 0;
  for (; d0 + DB <= D; d0 += DB) pv_block<V, RV, DB, Masked>(acc, s, vp, D, d0, valid);
  for (; d0 < D; ++d0) pv_block<V, RV, 1, Masked>(acc, s, vp, D, d0, valid);
}

// Single-query tiles (a decode step): every row sees the same keys, so pass 2 can put the head's
// dimensions in the lanes instead of the rows: accT[r][d] += w[r][j] * v_j[d] for the tile's keys
// j0 .. j1 in order, RB rows x DV vectors of dimensions in registers. Each (r, d) gets the same fused
// multiply-adds in the same order as in pv_block (keys a row does not see are skipped, as the masked
// FMAs leave them), so the sums are the same bits; with G rows of D dimensions it takes G x D / W
// FMAs per key where the rows in lanes take D (0.5B: 7 x 64 / 16 = 28 against 64).
// w(r, j) is where weights_single left the weight: s[r * kKeyTile + j] of its tile.
template <class V, int RB, int DV, class R>
inline void pv_rows(float* acct, const float* s, const R* const* vp, int D, int r0, int dv0, int j0, int j1) {
  using T = typename V::T;
  const int W = V::W;
  T acc[RB][DV];
#pragma GCC unroll 4
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 4
    for (int k = 0; k < DV; ++k) acc[i][k] = V::load(acct + int64_t(r0 + i) * D + (dv0 + k) * W);
  for (int j = j0; j <= j1; ++j) {
    T vv[DV];
#pragma GCC unroll 4
    for (int k = 0; k < DV; ++k) vv[k] = V::load(vp[j] + (dv0 + k) * W);
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
      const int r = r0 + i;
      const T w = V::set1(s[r * kKeyTile + j]);
#pragma GCC unroll 4
      for (int k = 0; k < DV; ++k) acc[i][k] = V::fma(w, vv[k], acc[i][k]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 4
    for (int k = 0; k < DV; ++k) V::store(acct + int64_t(r0 + i) * D + (dv0 + k) * W, acc[i][k]);
}

template <class V, int RB, class R>
inline void pv_rows_dims(float* acct, const float* s, const R* const* vp, int D, int r0, int j0, int j1) {
  constexpr int DVMax = V::kPvDims;
  const int nvec = D / V::W;
  int dv = 0;
  for (; dv + DVMax <= nvec; dv += DVMax) pv_rows<V, RB, DVMax>(acct, s, vp, D, r0, dv, j0, j1);
  for (; dv < nvec; ++dv) pv_rows<V, RB, 1>(acct, s, vp, D, r0, dv, j0, j1);
}

// vp: the tile's V rows as floats, or (R = uint16_t) an F16 cache's rows, converted as they are loaded
// (V::load of F16: exact, so the same values).
template <class V, class R>
void pv_single(const Layout& L, float* sc, const float* s, const R* const* vp, int j0, int j1) {
  float* acct = sc + L.acct;
  constexpr int RBMax = V::kPvRows;
  int r = 0;
  for (; r + RBMax <= L.rows; r += RBMax) pv_rows_dims<V, RBMax>(acct, s, vp, L.d, r, j0, j1);
  switch (L.rows - r) {  // the rest in one call: each value vector loaded once for all of them
    case 0: break;
    case 1: pv_rows_dims<V, 1>(acct, s, vp, L.d, r, j0, j1); break;
    case 2: if constexpr (RBMax > 2) pv_rows_dims<V, 2>(acct, s, vp, L.d, r, j0, j1); break;
    case 3: if constexpr (RBMax > 3) pv_rows_dims<V, 3>(acct, s, vp, L.d, r, j0, j1); break;
  }
  static_assert(RBMax <= 4);
}

// The scores of rows r0 .. r0 + RB - 1 from their QK sums (acc[i][k]: keys k * W .. of row r0 + i):
// scaled, soft-capped, -inf outside the tile's keys [j0, j1], into S[r][j].
template <class V, int RB, int KW>
inline void finish_scores(typename V::T (&acc)[RB][KW], const TileArgs& a, int r0, int j0, int j1, float* S) {
  using T = typename V::T;
  alignas(64) static constexpr float kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const T sv = V::set1(a.scale), lo = V::set1(float(j0)), hi = V::set1(float(j1));
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 2
    for (int k = 0; k < KW; ++k) {
      T x = V::mul(acc[i][k], sv);
      if (a.softcap > 0.0f) x = vsoftcap<V>(x, a.softcap);
      const T j = V::load(kIota + k * V::W);
      x = V::select(V::mand(V::le(lo, j), V::le(j, hi)), x, V::set1(-kInf));
      V::store(S + (r0 + i) * kKeyTile + k * V::W, x);
    }
}

// Keys in lanes for a single-query tile (pass 1, and pass 2's weights): its keys' rows transposed
// (V::transpose_keys) so that a vector holds one dimension of W keys; the scores of row r are then
// S[r] = (sum_d q_rd * Kt[d], fused in order d = 0, 1, ...) * scale, the same operations per (row, key)
// as qk and scores do with rows in lanes, in G x D / W FMAs per tile-vector of keys instead of D. The
// softmax's exponentials then run on G rows x 16 keys, not 16 keys x one vector of rows, and the tile's
// max and sum are lane_trees (the same pairs as tree). Keys outside [j0, j1] get -inf.
template <class V, int RB>
inline void scores_rows(const Layout& L, const float* sc, const TileArgs& a, const float* kt, int r0, int j0, int j1,
                        float* S) {
  using T = typename V::T;
  const int W = V::W, D = L.d;
  constexpr int KW = kKeyTile / V::W;
  T acc[RB][KW];
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 2
    for (int k = 0; k < KW; ++k) acc[i][k] = V::zero();
  const float* qt = sc + L.qt;
  for (int d = 0; d < D; ++d) {
    T kv[KW];
#pragma GCC unroll 2
    for (int k = 0; k < KW; ++k) kv[k] = V::load(kt + d * kKeyTile + k * W);
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i) {
      const int r = r0 + i;
      const T q = V::set1(qt[(int64_t(r / W) * D + d) * W + r % W]);
#pragma GCC unroll 2
      for (int k = 0; k < KW; ++k) acc[i][k] = V::fma(q, kv[k], acc[i][k]);
    }
  }
  finish_scores<V, RB, KW>(acc, a, r0, j0, j1, S);
}

// scores_rows for all the tile's rows at once (RB = rows, W = kKeyTile), with the keys transposed 16
// dimensions at a time in registers (V::key_block) instead of through the scratch: per (row, key) the
// same fused multiply-adds in the same order.
template <class V, int RB, class Row>
inline void scores_rows_in_registers(const Layout& L, const float* sc, const TileArgs& a, const Row* const* rows,
                                     int j0, int j1, float* S) {
  using T = typename V::T;
  static_assert(V::W == kKeyTile);
  const int W = V::W, D = L.d;
  T acc[RB][1];
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i) acc[i][0] = V::zero();
  const float* qt = sc + L.qt;
  for (int d0 = 0; d0 < D; d0 += 16) {
    T kv[16];
    V::key_block(rows, d0, kv);
#pragma GCC unroll 16
    for (int e = 0; e < 16; ++e)
#pragma GCC unroll 8
      for (int i = 0; i < RB; ++i) acc[i][0] = V::fma(V::set1(qt[(int64_t(i / W) * D + d0 + e) * W + i % W]), kv[e], acc[i][0]);
  }
  finish_scores<V, RB, 1>(acc, a, 0, j0, j1, S);
}

// A tile's K rows: as floats, or (an F16 cache, single-query tiles) the cache's rows, converted as
// they are transposed; keys outside the tile's range read a row of F16 zeros.
constexpr int kMaxZeroHalves = 1024;
alignas(64) inline const uint16_t kZeroHalves[kMaxZeroHalves] = {};
struct KeyRows {
  const float* const* f;
  const uint16_t* const* h;  // non-null: F16 rows
};

// S[r][j] for the tile's rows (S: rows x kKeyTile floats).
template <class V>
void scores_single(const Layout& L, float* sc, const TileArgs& a, KeyRows kp, int j0, int j1, float* S) {
  if constexpr (V::kKeysInRegisters) {
    if (L.rows <= V::kQkRows && L.d % 16 == 0) {
      auto rows = [&]<int RB>() {
        if (kp.h) scores_rows_in_registers<V, RB>(L, sc, a, kp.h, j0, j1, S);
        else scores_rows_in_registers<V, RB>(L, sc, a, kp.f, j0, j1, S);
      };
      switch (L.rows) {
#define SERVAL_ROWS_CASE(n) \
  case n: if constexpr (n <= V::kQkRows) rows.template operator()<n>(); return;
        SERVAL_ROWS_CASE(1) SERVAL_ROWS_CASE(2) SERVAL_ROWS_CASE(3) SERVAL_ROWS_CASE(4)
        SERVAL_ROWS_CASE(5) SERVAL_ROWS_CASE(6) SERVAL_ROWS_CASE(7) SERVAL_ROWS_CASE(8)
#undef SERVAL_ROWS_CASE
      }
    }
  }
  float* kt = sc + L.ktt;
  if (kp.h) V::transpose_keys(kp.h, L.d, kt);
  else V::transpose_keys(kp.f, L.d, kt);
  constexpr int RB = V::kQkRows;
  int r = 0;
  for (; r + RB <= L.rows; r += RB) scores_rows<V, RB>(L, sc, a, kt, r, j0, j1, S);
  switch (L.rows - r) {  // the rest at once: each row an accumulator chain of its own
    case 0: break;
#define SERVAL_ROWS_CASE(n) \
  case n: if constexpr (n < RB) scores_rows<V, n>(L, sc, a, kt, r, j0, j1, S); break;
    SERVAL_ROWS_CASE(1) SERVAL_ROWS_CASE(2) SERVAL_ROWS_CASE(3) SERVAL_ROWS_CASE(4)
    SERVAL_ROWS_CASE(5) SERVAL_ROWS_CASE(6) SERVAL_ROWS_CASE(7)
#undef SERVAL_ROWS_CASE
  }
}

// Pass 1's statistics of a single-query tile over key tiles t0 .. t0 + nt - 1 of a chunk, from their
// scores (keys in lanes; tile t0 + i's at at(i), rows x kKeyTile floats): per tile as tile_stats,
// m' = max(m, T(s)) and l' = l exp(m - m') + T(exp(s - m')), done in phases over all the tiles (their
// maxima, the running maxima, the sums of exponentials, the running sums), so that the tiles' trees
// and exponentials are independent work rather than one chain per tile. Per row the operations and
// their order are those of one tile after another: the same bits.
template <class V, class At>
void stats_single(const Layout& L, float* sc, int nt, At at) {
  using T = typename V::T;
  const int W = V::W, G = L.rows, nvw = L.nv * V::W;
  constexpr int KW = kKeyTile / V::W;
  float* mt = sc + L.red;                       // [tile][row] (padding rows: kNegBig): the tile's max
  float* mn = mt + int64_t(kTilesPerChunk) * nvw;  // [tile][row]: the running max after the tile
  float* ps = mn + int64_t(kTilesPerChunk) * nvw;  // [tile][row]: the tile's sum of exponentials
  auto vmax = [](T p, T q) { return V::max(p, q); };
  auto vadd = [](T p, T q) { return V::add(p, q); };
  for (int i = 0; i < nt; ++i)
    for (int r = 0; r < nvw; ++r) {
      T x[KW];
      for (int k = 0; k < KW; ++k) x[k] = r < G ? V::load(at(i) + r * kKeyTile + k * W) : V::set1(kNegBig);
      mt[i * nvw + r] = lane_tree<V>(x, vmax);
    }
  float* st = sc + L.st;
  for (int v = 0; v < L.nv; ++v) {
    T m = V::load(st + v * W);
    for (int i = 0; i < nt; ++i) {
      m = V::max(m, V::load(mt + i * nvw + v * W));
      V::store(mn + i * nvw + v * W, m);
    }
  }
  for (int i = 0; i < nt; ++i)
    for (int r = 0; r < nvw; ++r) {
      T e[KW];
      const T m = V::set1(mn[i * nvw + r]);
      for (int k = 0; k < KW; ++k) e[k] = r < G ? vexp<V>(V::sub(V::load(at(i) + r * kKeyTile + k * W), m)) : V::zero();
      ps[i * nvw + r] = lane_tree<V>(e, vadd);
    }
  for (int v = 0; v < L.nv; ++v) {
    T m = V::load(st + v * W), l = V::load(st + (L.nv + v) * W);
    for (int i = 0; i < nt; ++i) {
      const T n = V::load(mn + i * nvw + v * W);
      l = V::fma(l, vexp<V>(V::sub(m, n)), V::load(ps + i * nvw + v * W));
      m = n;
    }
    V::store(st + v * W, m);
    V::store(st + (L.nv + v) * W, l);
  }
}

// Pass 2's weights of a single-query tile over nt key tiles, in place of their scores:
// w[r][j] = exp(S[r][j] - M_r) * (1 / L_r), rounded to F16 with an F16 cache (as tile_values).
template <class V, class At>
void weights_single(const Layout& L, const float* sc, const TileArgs& a, int nt, At at) {
  using T = typename V::T;
  const int W = V::W;
  constexpr int KW = kKeyTile / V::W;
  const float* run = sc + L.run;
  const float* inv = sc + L.inv;
  for (int i = 0; i < nt; ++i)
    for (int r = 0; r < L.rows; ++r) {
      const T m = V::set1(run[r]), iv = V::set1(inv[r]);
      for (int k = 0; k < KW; ++k) {
        float* p = at(i) + r * kKeyTile + k * W;
        const T x = V::mul(vexp<V>(V::sub(V::load(p), m)), iv);
        V::store(p, a.half ? V::f16_round(x) : x);
      }
    }
}

// Byte offsets of the K (or V) row parts of kv head `a.kv_head` at positions [p, p + n): one division
// for the run, then the block table followed slot by slot.
inline void row_offsets(const TileArgs& a, int64_t p, int n, int64_t* off) {
  int64_t b = p / a.block_size, r = p % a.block_size;
  const int64_t head = int64_t(a.kv_head) * a.head_bytes;
  for (int j = 0; j < n; ++j) {
    off[j] = (int64_t(a.blocks[b]) * a.block_size + r) * a.slot_bytes + head;
    if (++r == a.block_size) r = 0, ++b;
  }
}

// Row j of the tile as floats: F32 in place; otherwise converted into `tmp`.
template <class V>
const float* tile_row(const TileArgs& a, const uint8_t* src, float* tmp, int D) {
  switch (a.kind) {
    case KvKind::F32: return reinterpret_cast<const float*>(src);
    case KvKind::F16: V::cvt_f16_row(reinterpret_cast<const uint16_t*>(src), tmp, D); return tmp;
    case KvKind::Fp8: V::cvt_fp8_row(src, tmp, D, a.head_scale); return tmp;
    case KvKind::Dequant: a.dequant(src, tmp, D, a.head_scale); return tmp;
  }
  return tmp;
}

// Points kp (or kh: F16 rows read in place, for single-query tiles) and vp at key tile t's rows
// (want_k, want_v), converted into the scratch where they are not read in place; positions outside
// [lo, hi] read a zero row. First the rows kPrefetchTiles tiles ahead are fetched (blocks are scattered
// in the pool, beyond what the hardware prefetcher follows); at the first tile of a run, from it on.
struct Want {  // which of a tile's rows tile_rows looks up, and which an F16 cache gives in place
  bool k = false, raw_k = false, v = false, raw_v = false;
};
struct TileRowPtrs {  // a key tile's rows: as floats, or (raw) the F16 cache's own
  const float* kp[kKeyTile];
  const uint16_t* kh[kKeyTile];
  const float* vp[kKeyTile];
  const uint16_t* vh[kKeyTile];
};

template <class V>
void tile_rows(const Layout& L, float* sc, const TileArgs& a, int64_t t, int64_t lo, int64_t hi, int64_t uhi,
               Want want, TileRowPtrs& rows) {
  const bool want_k = want.k, raw_k = want.raw_k, want_v = want.v, raw_v = want.raw_v;
  const float** kp = rows.kp;
  const uint16_t** kh = rows.kh;
  const float** vp = rows.vp;
  const uint16_t** vh = rows.vh;
  const int D = L.d;
  const int64_t tlo = t * kKeyTile;
  {
    const int64_t from = t == lo / kKeyTile ? tlo : tlo + kPrefetchTiles * kKeyTile;
    const int64_t to = tlo + (kPrefetchTiles + 1) * kKeyTile - 1 < uhi ? tlo + (kPrefetchTiles + 1) * kKeyTile - 1 : uhi;
    for (int64_t p = from; p <= to; p += kKeyTile) {
      const int n = to - p + 1 < kKeyTile ? int(to - p + 1) : kKeyTile;
      int64_t off[kKeyTile];
      row_offsets(a, p, n, off);
      for (int j = 0; j < n; ++j)
        for (int64_t b = 0; b < a.head_bytes; b += 64) {
          if (want_k) V::prefetch(a.k + off[j] + b);
          if (want_v) V::prefetch(a.v + off[j] + b);
        }
    }
  }
  int64_t off[kKeyTile];
  row_offsets(a, tlo, hi - tlo + 1 < kKeyTile ? int(hi - tlo + 1) : kKeyTile, off);  // not beyond the table
  for (int j = 0; j < kKeyTile; ++j) {
    const int64_t p = tlo + j;
    if (p < lo || p > hi) {
      kp[j] = vp[j] = sc + L.zrow;
      kh[j] = vh[j] = kZeroHalves;
      continue;
    }
    if (want_k && raw_k) kh[j] = reinterpret_cast<const uint16_t*>(a.k + off[j]);
    else if (want_k) kp[j] = tile_row<V>(a, a.k + off[j], sc + L.kt + int64_t(j) * D, D);
    if (want_v && raw_v) vh[j] = reinterpret_cast<const uint16_t*>(a.v + off[j]);
    else if (want_v) vp[j] = tile_row<V>(a, a.v + off[j], sc + L.vt + int64_t(j) * D, D);
  }
}

// A single-query tile's pass over chunk c's keys [lo, hi] (a decode step): keys in lanes for the
// scores and the softmax, dimensions in lanes for weights x V (pv_single, into accT, moved into the
// chunk state's layout at the end). Each phase runs over all the chunk's key tiles before the next:
// the scores (kept by pass 1 for pass 2 in `cache_c`, or made here again), then pass 1's statistics,
// or pass 2's weights (in place of the scores) and weights x V.
template <class V, bool Values>
void chunk_single(const Layout& L, float* sc, const TileArgs& a, int64_t c, int64_t lo, int64_t hi, int64_t uhi,
                  float* cache_c) {
  const int D = L.d;
  const int64_t t0 = lo / kKeyTile, nt = lo <= hi ? hi / kKeyTile - t0 + 1 : 0;
  float* S = (cache_c ? cache_c : sc + L.skc) + (t0 - c * kTilesPerChunk) * int64_t(L.nv) * kKeyTile * L.w;
  auto at = [&](int64_t i) { return S + i * int64_t(L.nv) * kKeyTile * L.w; };
  auto span = [&](int64_t i, int& j0, int& j1) {  // the tile's keys in [lo, hi]
    const int64_t tlo = (t0 + i) * kKeyTile, thi = tlo + kKeyTile - 1;
    j0 = int((lo > tlo ? lo : tlo) - tlo), j1 = int((hi < thi ? hi : thi) - tlo);
  };
  TileRowPtrs rows;
  // An F16 cache's rows are read in place: K converted as it is transposed, V as it is loaded.
  const bool raw = a.kind == KvKind::F16 && D <= kMaxZeroHalves;
  int j0, j1;
  if (!(Values && cache_c))
    for (int64_t i = 0; i < nt; ++i) {
      tile_rows<V>(L, sc, a, t0 + i, lo, hi, uhi, {.k = true, .raw_k = raw}, rows);
      span(i, j0, j1);
      scores_single<V>(L, sc, a, KeyRows{rows.kp, raw ? rows.kh : nullptr}, j0, j1, at(i));
    }
  if constexpr (!Values) {
    stats_single<V>(L, sc, int(nt), at);
  } else {
    weights_single<V>(L, sc, a, int(nt), at);
    std::memset(sc + L.acct, 0, sizeof(float) * size_t(L.rows) * size_t(D));
    for (int64_t i = 0; i < nt; ++i) {
      tile_rows<V>(L, sc, a, t0 + i, lo, hi, uhi, {.v = true, .raw_v = raw}, rows);
      span(i, j0, j1);
      if (raw) pv_single<V>(L, sc, at(i), rows.vh, j0, j1);
      else pv_single<V>(L, sc, at(i), rows.vp, j0, j1);
    }
    float* acc = acc_of(sc + L.st, L);  // accT into the chunk state's layout (acc of vector v, dimension d, lane)
    const float* acct = sc + L.acct;
    for (int r = 0; r < L.rows; ++r)
      for (int d = 0; d < D; ++d) acc[(int64_t(r / L.w) * D + d) * L.w + r % L.w] = acct[int64_t(r) * D + d];
  }
}

// Runs pass 1 (Values = false) or pass 2 over the keys of chunk c that any row of the tile sees,
// into the chunk state (already reset).
template <class V, bool Values>
void chunk(const Layout& L, float* sc, const TileArgs& a, int64_t c, int64_t ulo, int64_t uhi) {
  const int64_t lo = c * kChunk > ulo ? c * kChunk : ulo;
  const int64_t hi = c * kChunk + kChunk - 1 < uhi ? c * kChunk + kChunk - 1 : uhi;
  // Pass 1 keeps the scores of the chunk's tiles here, pass 2 reads them (when there is room).
  float* cache_c = a.scores ? a.scores + (c - a.c_begin) * scores_floats(L.rows, L.w) : nullptr;
  // A single-query tile with whole vectors of dimensions: keys in lanes (chunk_single).
  if (a.n_q == 1 && L.d % V::W == 0) return chunk_single<V, Values>(L, sc, a, c, lo, hi, uhi, cache_c);
  const bool need_k = !(Values && cache_c);
  TileRowPtrs rows;
  const float* const* kp = rows.kp;
  const float* const* vp = rows.vp;
  for (int64_t t = lo / kKeyTile; lo <= hi && t <= hi / kKeyTile; ++t) {
    const int64_t tlo = t * kKeyTile, thi = tlo + kKeyTile - 1;
    float* cache = cache_c ? cache_c + (t - c * kTilesPerChunk) * int64_t(L.nv) * kKeyTile * L.w : nullptr;
    tile_rows<V>(L, sc, a, t, lo, hi, uhi, {.k = need_k, .v = Values}, rows);
    for (int v = 0; v < L.nv; v += V::kRowVectors) {
      const int n = L.nv - v < V::kRowVectors ? L.nv - v : V::kRowVectors;
      bool full = true;
      for (int i = 0; i < n; ++i)
        full = full && sc[L.rvfirst + v + i] <= float(tlo) && float(thi) <= sc[L.rvlast + v + i];
      auto run = [&]<int RV>(int v0) {
        if constexpr (Values) {
          if (full) tile_values<V, RV, false>(L, sc, a, v0, tlo, kp, vp, cache);
          else tile_values<V, RV, true>(L, sc, a, v0, tlo, kp, vp, cache);
        } else {
          if (full) tile_stats<V, RV, false>(L, sc, a, v0, tlo, kp, cache);
          else tile_stats<V, RV, true>(L, sc, a, v0, tlo, kp, cache);
        }
      };
      if (n == V::kRowVectors) run.template operator()<V::kRowVectors>(v);
      else
        for (int i = 0; i < n; ++i) run.template operator()<1>(v + i);
    }
  }
}

// Writes the running sum (the outputs) to the tile's output rows.
template <class V>
void write_out(const Layout& L, const float* r, const TileArgs& a) {
  const int W = V::W, D = L.d, G = a.group;
  const float* acc = acc_of(r, L);
  for (int v = 0; v < L.nv; ++v)
    for (int lane = 0; lane < W; ++lane) {
      const int row = v * W + lane;
      if (row >= L.rows) break;
      float* out = a.out[row / G] + (int64_t(a.kv_head) * G + row % G) * D;
      for (int d = 0; d < D; ++d) out[d] = acc[(int64_t(v) * D + d) * W + lane];
    }
}

// Merged statistics of chunks [a.c_begin, a.c_end) from their stored states, and 1 / L per lane.
template <class V>
void merged_stats(const Layout& L, float* sc, const TileArgs& a) {
  float* run = sc + L.run;
  stats_reset<V>(run, L);
  for (int64_t c = a.c_begin; c < a.c_end; ++c) stats_merge<V>(run, a.partial + (c - a.c_begin) * L.state, sc, L, c);
}

// Attention sinks: each row's sink joins its merged statistics as one more score (a state of m = sink,
// l = 1 merged like a chunk's), so it adds exp(sink - M) to L and moves M if larger.
template <class V>
void merge_sinks(const Layout& L, float* sc, const TileArgs& a) {
  using T = typename V::T;
  const int W = V::W;
  float* r = sc + L.run;
  alignas(64) float lanes[64];
  for (int v = 0; v < L.nv; ++v) {
    for (int lane = 0; lane < W; ++lane) {
      const int row = v * W + lane;
      lanes[lane] = row < L.rows ? a.sinks[a.kv_head * a.group + row % a.group] : kNegBig;
    }
    const T ms = V::load(lanes), m = V::load(r + v * W), l = V::load(r + (L.nv + v) * W);
    const T mn = V::max(m, ms);
    const T x = vexp<V>(V::sub(m, mn)), y = vexp<V>(V::sub(ms, mn));
    V::store(r + v * W, mn);
    V::store(r + (L.nv + v) * W, V::fma(V::set1(1.0f), y, V::mul(l, x)));
  }
}

template <class V>
void inverse_sums(const Layout& L, float* sc, const TileArgs& a) {
  if (a.sinks) merge_sinks<V>(L, sc, a);
  for (int v = 0; v < L.nv; ++v)
    V::store(sc + L.inv + v * V::W, V::div(V::set1(1.0f), V::load(sc + L.run + (L.nv + v) * V::W)));
}

template <class V>
void run_tile(const TileArgs& a) {
  const int W = V::W, D = a.d_head, G = a.group;
  const Layout L = layout(a.n_q * G, D, W);
  float* sc = a.scratch;

  // Positions per lane; Q rows (rounded to F16 with an F16 cache), transposed: Qt[v][d][lane].
  int64_t ulo = a.first[0], uhi = a.last[0];
  for (int q = 1; q < a.n_q; ++q) {
    ulo = a.first[q] < ulo ? a.first[q] : ulo;
    uhi = a.last[q] > uhi ? a.last[q] : uhi;
  }
  const bool need_q = a.mode != Mode::Sum;
  for (int v = 0; v < L.nv; ++v) {
    float fmax = -kInf, lmin = kInf;
    for (int lane = 0; lane < W; ++lane) {
      const int row = v * W + lane;
      float* qt = sc + L.qt + int64_t(v) * D * W + lane;
      if (row < L.rows) {
        const int q = row / G, h = row % G;
        const float* src = a.q[q] + (int64_t(a.kv_head) * G + h) * D;
        if (need_q)
          for (int d = 0; d < D; ++d) qt[int64_t(d) * W] = src[d];
        sc[L.firstv + v * W + lane] = float(a.first[q]);
        sc[L.lastv + v * W + lane] = float(a.last[q]);
        fmax = float(a.first[q]) > fmax ? float(a.first[q]) : fmax;
        lmin = float(a.last[q]) < lmin ? float(a.last[q]) : lmin;
      } else {
        if (need_q)
          for (int d = 0; d < D; ++d) qt[int64_t(d) * W] = 0.0f;
        sc[L.firstv + v * W + lane] = kInf;  // never valid
        sc[L.lastv + v * W + lane] = -kInf;
      }
    }
    sc[L.rvfirst + v] = fmax;
    sc[L.rvlast + v] = lmin;
    if (a.half && need_q)
      for (int d = 0; d < D; ++d) {
        float* p = sc + L.qt + (int64_t(v) * D + d) * W;
        V::store(p, V::f16_round(V::load(p)));
      }
  }
  for (int d = 0; d < D; ++d) sc[L.zrow + d] = 0.0f;

  float* st = sc + L.st;
  float* run = sc + L.run;
  switch (a.mode) {
    case Mode::Full:
      stats_reset<V>(run, L);
      for (int64_t c = a.c_begin; c < a.c_end; ++c) {
        stats_reset<V>(st, L);
        chunk<V, false>(L, sc, a, c, ulo, uhi);
        stats_merge<V>(run, st, sc, L, c);
      }
      inverse_sums<V>(L, sc, a);
      acc_reset<V>(run, L);
      for (int64_t c = a.c_begin; c < a.c_end; ++c) {
        acc_reset<V>(st, L);
        chunk<V, true>(L, sc, a, c, ulo, uhi);
        acc_add<V>(run, st, sc, L, c);
      }
      write_out<V>(L, run, a);
      break;
    case Mode::Stats:
      for (int64_t c = a.chunk; c < a.chunk_end; ++c) {
        stats_reset<V>(st, L);
        chunk<V, false>(L, sc, a, c, ulo, uhi);
        std::memcpy(a.partial + (c - a.c_begin) * L.state, st, size_t(2 * L.nv * W) * sizeof(float));
      }
      break;
    case Mode::Values:
      merged_stats<V>(L, sc, a);
      inverse_sums<V>(L, sc, a);
      for (int64_t c = a.chunk; c < a.chunk_end; ++c) {
        acc_reset<V>(st, L);
        chunk<V, true>(L, sc, a, c, ulo, uhi);
        std::memcpy(acc_of(a.partial + (c - a.c_begin) * L.state, L), acc_of(st, L),
                    size_t(int64_t(L.nv) * D * W) * sizeof(float));
      }
      break;
    case Mode::Sum:
      acc_reset<V>(run, L);
      for (int64_t c = a.c_begin; c < a.c_end; ++c) acc_add<V>(run, a.partial + (c - a.c_begin) * L.state, sc, L, c);
      write_out<V>(L, run, a);
      break;
  }
}

}  // namespace
}  // namespace serval::cpu::attn
