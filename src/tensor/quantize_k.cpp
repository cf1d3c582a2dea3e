#include "tensor/quantize_k.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tensor/dequant.h"

namespace serval::kquant {

const int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

namespace {

constexpr float kTiny = 1e-15f;  // a group whose largest magnitude is below this is all zeros

// Round to nearest, ties to even, by adding 1.5 * 2^23 (valid for |f| < 2^22; ggml's way, which also
// fixes what NaN and huge values give).
inline int nearest_int(float f) {
  const float v = f + 12582912.f;
  int i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

inline int clamp(int v, int lo, int hi) { return std::max(lo, std::min(hi, v)); }

void put_half(uint8_t* p, float v) {
  const uint16_t h = f32_to_fp16(v);
  std::memcpy(p, &h, 2);
}

float get_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_f32(h);
}

// The value of largest magnitude of x[0..n) (the first of equal magnitudes), signed; and its magnitude.
float signed_max(int n, const float* x, float& amax) {
  float max = 0;
  amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) amax = ax, max = x[i];
  }
  return max;
}

// Sums of w*x*l and w*l*l over levels l = round(iscale * x) clamped to [-nmax, nmax); w = qw, or x^2
// without importance weights.
struct SymFit {
  float sumlx = 0, suml2 = 0;
};
SymFit fit_symmetric(int n, int nmax, const float* x, const float* qw, float iscale, int8_t* L) {
  SymFit f;
  for (int i = 0; i < n; ++i) {
    const int l = clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1);
    if (L) L[i] = int8_t(l + nmax);
    const float w = qw ? qw[i] : x[i] * x[i];
    f.sumlx += w * x[i] * l;
    f.suml2 += w * l * l;
  }
  return f;
}

// Symmetric levels (Q6_K; with importance also Q3_K, Q4_0, Q5_0 and Q3_K's scales): the scale
// minimizing the weighted error (weights qw, or x^2) over 19 trial scales around -nmax / max; L gets
// levels + nmax. Returns the scale (0 for an all-zero group).
float symmetric_search(int n, int nmax, const float* x, int8_t* L, const float* qw = nullptr) {
  float amax;
  const float max = signed_max(n, x, amax);
  if (amax < kTiny) {
    std::fill(L, L + n, 0);
    return 0.f;
  }
  SymFit f = fit_symmetric(n, nmax, x, qw, -nmax / max, L);
  float scale = f.suml2 ? f.sumlx / f.suml2 : 0.0f;
  float best = scale * f.sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    const float iscale = -(nmax + 0.1f * is) / max;
    f = fit_symmetric(n, nmax, x, qw, iscale, nullptr);
    if (f.suml2 > 0 && f.sumlx * f.sumlx > best * f.suml2) {
      fit_symmetric(n, nmax, x, qw, iscale, L);
      scale = f.sumlx / f.suml2;
      best = scale * f.sumlx;
    }
  }
  return scale;
}

// Symmetric levels for Q3_K: start from -nmax / max, then up to five passes that move single levels
// when that lowers the x^2-weighted error; L gets levels + nmax.
float symmetric_refine(int n, int nmax, const float* x, int8_t* L) {
  float amax;
  const float max = signed_max(n, x, amax);
  if (amax < kTiny) {
    std::fill(L, L + n, 0);
    return 0.f;
  }
  const float iscale = -nmax / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1);
    L[i] = int8_t(l);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * L[i];
      if (!(slx > 0)) continue;
      float sl2 = suml2 - w * L[i] * L[i];
      const int nl = clamp(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1);
      if (nl == L[i]) continue;
      slx += w * x[i] * nl;
      sl2 += w * nl * nl;
      if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
        L[i] = int8_t(nl), sumlx = slx, suml2 = sl2;
        ++changed;
      }
    }
    if (!changed) break;
  }
  for (int i = 0; i < n; ++i) L[i] = int8_t(L[i] + nmax);
  return sumlx / suml2;
}

// Affine levels 0..nmax with a minimum (Q2_K, Q4_K, Q5_K): from the group's range, then nstep+1 trial
// scales (rmin + rdelta * k + nmax) / range, each refitting scale and minimum by weighted least
// squares and kept when its weighted error (absolute or squared) is lower. Returns the scale; *neg_min
// gets the minimum negated (>= 0).
struct AffineSearch {
  int nmax;
  float rmin, rdelta;
  int nstep;
  bool abs_error;
};
float affine_search(int n, const float* x, const float* weights, uint8_t* L, float* neg_min, const AffineSearch& s) {
  uint8_t Laux[32];
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::fill(L, L + n, 0);
    *neg_min = -min;
    return 0.f;
  }
  float iscale = s.nmax / (max - min);
  float scale = 1 / iscale;
  float best_err = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = uint8_t(clamp(l, 0, s.nmax));
    float diff = scale * L[i] + min - x[i];
    diff = s.abs_error ? std::fabs(diff) : diff * diff;
    const float w = weights[i];
    best_err += w * diff;
  }
  for (int is = 0; is <= s.nstep; ++is) {
    iscale = (s.rmin + s.rdelta * is + s.nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = clamp(nearest_int(iscale * (x[i] - min)), 0, s.nmax);
      Laux[i] = uint8_t(l);
      const float w = weights[i];
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (!(D > 0)) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    float err = 0;
    for (int i = 0; i < n; ++i) {
      float diff = this_scale * Laux[i] + this_min - x[i];
      diff = s.abs_error ? std::fabs(diff) : diff * diff;
      const float w = weights[i];
      err += w * diff;
    }
    if (err < best_err) {
      std::copy(Laux, Laux + n, L);
      best_err = err;
      scale = this_scale;
      min = this_min;
    }
  }
  *neg_min = -min;
  return scale;
}

// Non-negative levels 0..nmax for a super-block's sub-block scales or minimums, with importance:
// the best of nine trial scales by weighted error, then up to five passes moving single levels.
float positive_search(int n, int nmax, const float* x, uint8_t* L, const float* qw) {
  float max = 0;
  for (int i = 0; i < n; ++i) max = std::max(max, x[i]);
  if (!max) {
    std::fill(L, L + n, 0);
    return 0.f;
  }
  float iscale = nmax / max;
  for (int i = 0; i < n; ++i) L[i] = uint8_t(nearest_int(iscale * x[i]));
  const float scale = 1 / iscale;
  float best_mse = 0;
  for (int i = 0; i < n; ++i) {
    const float diff = x[i] - scale * L[i];
    best_mse += qw[i] * diff * diff;
  }
  for (int is = -4; is <= 4; ++is) {
    if (is == 0) continue;
    const float iscale_is = (0.1f * is + nmax) / max, scale_is = 1 / iscale_is;
    float mse = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::min(nmax, nearest_int(iscale_is * x[i]));
      const float diff = x[i] - scale_is * l;
      mse += qw[i] * diff * diff;
    }
    if (mse < best_mse) best_mse = mse, iscale = iscale_is;
  }
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::min(nmax, nearest_int(iscale * x[i]));
    L[i] = uint8_t(l);
    sumlx += qw[i] * x[i] * l;
    suml2 += qw[i] * l * l;
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = qw[i];
      float slx = sumlx - w * x[i] * L[i];
      float sl2 = suml2 - w * L[i] * L[i];
      if (!(slx > 0 && sl2 > 0)) continue;
      const int nl = std::min(nmax, nearest_int(x[i] * sl2 / slx));
      if (nl == L[i]) continue;
      slx += w * x[i] * nl;
      sl2 += w * nl * nl;
      if (slx * slx * suml2 > sumlx * sumlx * sl2) {
        L[i] = uint8_t(nl), sumlx = slx, suml2 = sl2;
        ++changed;
      }
    }
    if (!changed) break;
  }
  return sumlx / suml2;
}

// Importance weights of a group: qw * sqrt(sigma2 + x^2).
void importance_weights(int n, const float* x, const float* qw, float sigma2, float* w) {
  for (int l = 0; l < n; ++l) w[l] = qw[l] * std::sqrt(sigma2 + x[l] * x[l]);
}

float sum_of(int n, const float* v) {
  float s = 0;
  for (int l = 0; l < n; ++l) s += v[l];
  return s;
}

// Four 2-bit values per byte: byte l of each 32-byte group holds elements l, l+32, l+64, l+96 of its
// 128 elements.
void pack_2bit(const uint8_t* L, uint8_t* qs) {
  for (int j = 0; j < 256; j += 128)
    for (int l = 0; l < 32; ++l)
      qs[j / 4 + l] = uint8_t(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

// Q4_K / Q5_K's 6-bit scales and minimums (ls, lm) with the super-block's d and dmin: packed in 12
// bytes after d and dmin; then every value is rounded again against the stored scales (L: 0..nmax).
void q45_k_finish(const float* x, uint8_t* out, int nmax, const uint8_t* ls, const uint8_t* lm, float d, float dmin,
                  uint8_t* L) {
  uint8_t* sc = out + 4;
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = ls[j], sc[j + 4] = lm[j];
    } else {
      sc[j + 4] = uint8_t((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      sc[j - 4] |= uint8_t((ls[j] >> 4) << 6);
      sc[j] |= uint8_t((lm[j] >> 4) << 6);
    }
  }
  put_half(out, d);
  put_half(out + 2, dmin);
  const float d_all = get_half(out), dmin_all = get_half(out + 2);
  for (int j = 0; j < 8; ++j) {
    const int s = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
    const int m = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    const float dj = d_all * s;
    if (!dj) continue;
    const float dm = dmin_all * m;
    for (int i = 0; i < 32; ++i) L[32 * j + i] = uint8_t(clamp(nearest_int((x[32 * j + i] + dm) / dj), 0, nmax));
  }
}

// Q4_K / Q5_K: eight sub-blocks of 32, each with an affine search. Without importance: weights
// rms(x) + |x|, scales and minimums rounded on 63 levels of the largest. With importance qw: weights
// qw * sqrt(sigma2 + x^2), a finer search, and the 6-bit levels searched too (positive_search).
void q45_k_levels(const float* x, uint8_t* out, int nmax, const float* qw, uint8_t* L) {
  float scales[8], mins[8], weights[32], sw[8];
  uint8_t ls[8], lm[8];
  float sum_x2 = 0;
  if (qw)
    for (int l = 0; l < 256; ++l) sum_x2 += x[l] * x[l];
  const float sigma2 = 2 * sum_x2 / 256;
  const AffineSearch search = qw ? AffineSearch{nmax, -0.9f, 0.05f, 36, false}
                                 : nmax == 15 ? AffineSearch{15, -1.f, 0.1f, 20, false} : AffineSearch{31, -0.5f, 0.1f, 15, false};
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    if (qw) {
      importance_weights(32, xs, qw + 32 * j, sigma2, weights);
      sw[j] = sum_of(32, weights);
    } else {
      float sx2 = 0;
      for (int l = 0; l < 32; ++l) sx2 += xs[l] * xs[l];
      const float av_x = std::sqrt(sx2 / 32);
      for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    }
    scales[j] = affine_search(32, xs, weights, L + 32 * j, &mins[j], search);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  if (qw) {
    const float d = positive_search(8, 63, scales, ls, sw), dmin = positive_search(8, 63, mins, lm, sw);
    return q45_k_finish(x, out, nmax, ls, lm, d, dmin, L);
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < 8; ++j) {
    ls[j] = std::min<uint8_t>(63, uint8_t(nearest_int(inv_scale * scales[j])));
    lm[j] = std::min<uint8_t>(63, uint8_t(nearest_int(inv_min * mins[j])));
  }
  q45_k_finish(x, out, nmax, ls, lm, max_scale / 63.f, max_min / 63.f, L);
}

// IQ4_NL's index of the level nearest to v (the lower one on a tie).
int nearest_level(float v) {
  const int8_t* val = iq4nl_values;
  if (v <= val[0]) return 0;
  if (v >= val[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (v < val[mid]) hi = mid;
    else lo = mid;
  }
  return v - val[hi - 1] < val[hi] - v ? hi - 1 : hi;
}

// Q2_K's sub-block searches; with importance, the 4-bit scales and minimums are searched too.
void q2_k_scales(const float* x, const float* qw, uint8_t* sc, float& d, float& dmin, uint8_t* L) {
  float scales[16], mins[16], weights[16], sw[16];
  float sigma2 = 0;
  if (qw) {
    float sumx2 = 0;
    for (int j = 0; j < 256; ++j) sumx2 += x[j] * x[j];
    sigma2 = sumx2 / 256;
  }
  const AffineSearch search = qw ? AffineSearch{3, -0.9f, 0.05f, 36, false} : AffineSearch{3, -0.5f, 0.1f, 15, true};
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 16; ++j) {
    if (qw) importance_weights(16, x + 16 * j, qw + 16 * j, sigma2, weights), sw[j] = sum_of(16, weights);
    else for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
    scales[j] = affine_search(16, x + 16 * j, weights, L + 16 * j, &mins[j], search);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  if (qw) {
    uint8_t Ls[16], Lm[16];
    d = positive_search(16, 15, scales, Ls, sw), dmin = positive_search(16, 15, mins, Lm, sw);
    for (int j = 0; j < 16; ++j) sc[j] = uint8_t(Ls[j] | (Lm[j] << 4));
    return;
  }
  std::fill(sc, sc + 16, 0);
  if (max_scale > 0)
    for (int j = 0; j < 16; ++j) sc[j] = uint8_t(nearest_int(15.f / max_scale * scales[j]));
  if (max_min > 0)
    for (int j = 0; j < 16; ++j) sc[j] |= uint8_t(nearest_int(15.f / max_min * mins[j]) << 4);
  d = max_scale > 0 ? max_scale / 15.f : 0.f, dmin = max_min > 0 ? max_min / 15.f : 0.f;
}

}  // namespace

void q2_k(const float* x, uint8_t* out, const float* qw) {  // scales[16], qs[64], d, dmin
  uint8_t L[256];
  uint8_t* sc = out;
  float d, dmin;
  q2_k_scales(x, qw, sc, d, dmin, L);
  put_half(out + 80, d);
  put_half(out + 82, dmin);
  const float d_all = get_half(out + 80), dmin_all = get_half(out + 82);
  for (int j = 0; j < 16; ++j) {
    const float dj = d_all * (sc[j] & 0xF);
    if (!dj) continue;
    const float dm = dmin_all * (sc[j] >> 4);
    for (int i = 0; i < 16; ++i) L[16 * j + i] = uint8_t(clamp(nearest_int((x[16 * j + i] + dm) / dj), 0, 3));
  }
  pack_2bit(L, out + 16);
}

namespace {

// Q3_K's signed 6-bit sub-block scales (stored + 32) and d. Without importance: each sub-block's
// refined levels, the scales rounded on the largest; with importance qw: weighted searches for the
// levels and for the scales.
float q3_k_scales(const float* x, const float* qw, int8_t* L, uint8_t* ls) {
  float scales[16];
  if (qw) {
    float sumx2 = 0, weight[16], sw[16];
    for (int j = 0; j < 256; ++j) sumx2 += x[j] * x[j];
    const float sigma2 = 2 * sumx2 / 256;
    for (int j = 0; j < 16; ++j) {
      importance_weights(16, x + 16 * j, qw + 16 * j, sigma2, weight);
      sw[j] = sum_of(16, weight);
      scales[j] = symmetric_search(16, 4, x + 16 * j, L + 16 * j, weight);
    }
    int8_t Ls[16];
    const float d = symmetric_search(16, 32, scales, Ls, sw);
    for (int j = 0; j < 16; ++j) ls[j] = uint8_t(Ls[j]);
    return d;
  }
  float max_scale = 0, amax = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = symmetric_refine(16, 4, x + 16 * j, L + 16 * j);
    const float a = std::fabs(scales[j]);
    if (a > amax) amax = a, max_scale = scales[j];
  }
  std::fill(ls, ls + 16, 0);
  if (!max_scale) return 0.f;
  const float iscale = -32.f / max_scale;
  for (int j = 0; j < 16; ++j) ls[j] = uint8_t(clamp(int8_t(nearest_int(iscale * scales[j])), -32, 31) + 32);
  return 1 / iscale;
}

}  // namespace

void q3_k(const float* x, uint8_t* out, const float* qw) {  // hmask[32], qs[64], scales[12], d
  int8_t L[256];
  uint8_t ls[16];
  const float d = q3_k_scales(x, qw, L, ls);
  uint8_t* sc = out + 96;
  std::fill(sc, sc + 12, 0);
  for (int j = 0; j < 16; ++j) {
    const int l = ls[j];
    if (j < 8) sc[j] = uint8_t(l & 0xF);
    else sc[j - 8] |= uint8_t((l & 0xF) << 4);
    sc[j % 4 + 8] |= uint8_t((l >> 4) << (2 * (j / 4)));
  }
  put_half(out + 108, d);
  const float d_all = get_half(out + 108);
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4;
    const int s = (low | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
    const float dj = d_all * s;
    if (!dj) continue;
    for (int i = 0; i < 16; ++i) L[16 * j + i] = int8_t(clamp(nearest_int(x[16 * j + i] / dj), -4, 3) + 4);
  }
  uint8_t* hmask = out;
  std::fill(hmask, hmask + 32, 0);
  uint8_t U[256];
  for (int j = 0; j < 256; ++j) {  // the third bit of element j goes to bit j / 32 of byte j % 32
    U[j] = uint8_t(L[j]);
    if (U[j] > 3) hmask[j % 32] |= uint8_t(1 << (j / 32)), U[j] -= 4;
  }
  pack_2bit(U, out + 32);
}

void q4_k(const float* x, uint8_t* out, const float* qw) {  // d, dmin, scales[12], qs[128]
  uint8_t L[256];
  q45_k_levels(x, out, 15, qw, L);
  uint8_t* q = out + 16;
  for (int j = 0; j < 256; j += 64, q += 32)
    for (int l = 0; l < 32; ++l) q[l] = uint8_t(L[j + l] | (L[j + l + 32] << 4));
}

void q5_k(const float* x, uint8_t* out, const float* qw) {  // d, dmin, scales[12], qh[32], qs[128]
  uint8_t L[256];
  q45_k_levels(x, out, 31, qw, L);
  uint8_t* qh = out + 16;
  uint8_t* ql = out + 48;
  std::fill(qh, qh + 32, 0);
  for (int n = 0, bit = 0; n < 256; n += 64, bit += 2, ql += 32)
    for (int j = 0; j < 32; ++j) {
      int l1 = L[n + j], l2 = L[n + j + 32];
      if (l1 > 15) l1 -= 16, qh[j] |= uint8_t(1 << bit);
      if (l2 > 15) l2 -= 16, qh[j] |= uint8_t(2 << bit);
      ql[j] = uint8_t(l1 | (l2 << 4));
    }
}

void q6_k(const float* x, uint8_t* out, const float* qw) {  // ql[128], qh[64], scales[16] (int8), d
  int8_t L[256];
  float scales[16];
  float max_scale = 0, max_abs = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = symmetric_search(16, 32, x + 16 * j, L + 16 * j, qw ? qw + 16 * j : nullptr);
    const float a = std::fabs(scales[j]);
    if (a > max_abs) max_abs = a, max_scale = scales[j];
  }
  if (max_abs < kTiny) {
    std::memset(out, 0, 210);
    return;
  }
  const float iscale = -128.f / max_scale;
  put_half(out + 208, 1 / iscale);
  int8_t* sc = reinterpret_cast<int8_t*>(out + 192);
  for (int j = 0; j < 16; ++j) sc[j] = int8_t(std::min(127, nearest_int(iscale * scales[j])));
  const float d_all = get_half(out + 208);
  for (int j = 0; j < 16; ++j) {
    const float d = d_all * sc[j];
    if (!d) continue;
    for (int i = 0; i < 16; ++i) L[16 * j + i] = int8_t(clamp(nearest_int(x[16 * j + i] / d), -32, 31) + 32);
  }
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  for (int j = 0; j < 256; j += 128, ql += 64, qh += 32)
    for (int l = 0; l < 32; ++l) {
      const int a = L[j + l], b = L[j + l + 32], c = L[j + l + 64], e = L[j + l + 96];
      ql[l] = uint8_t((a & 0xF) | ((c & 0xF) << 4));
      ql[l + 32] = uint8_t((b & 0xF) | ((e & 0xF) << 4));
      qh[l] = uint8_t((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
    }
}

// IQ4_NL as llama-quantize writes it (seven trial scales each side; weights x^2, or with importance
// qw * sqrt(sigma2 + x^2)): the scale that best fits the levels by weighted least squares, then each
// value to its nearest level.
void iq4_nl(const float* x, uint8_t* out, const float* qw) {
  constexpr int kTry = 7;
  const int8_t* val = iq4nl_values;
  float weight[32];
  if (qw) {
    float sigma2 = 0;
    for (int j = 0; j < 32; ++j) sigma2 += x[j] * x[j];
    sigma2 *= 2.f / 32;
    importance_weights(32, x, qw, sigma2, weight);
  } else {
    for (int j = 0; j < 32; ++j) weight[j] = x[j] * x[j];
  }
  float amax;
  const float max = signed_max(32, x, amax);
  float d = 0;
  if (amax >= kTiny) {
    const float id0 = 1 / (-max / val[0]);
    float sumqx = 0, sumq2 = 0;
    for (int j = 0; j < 32; ++j) {
      const float q = val[nearest_level(id0 * x[j])];
      const float w = weight[j];
      sumqx += w * q * x[j];
      sumq2 += w * q * q;
    }
    d = sumqx / sumq2;
    float best = d * sumqx;
    for (int t = -kTry; t <= kTry; ++t) {
      const float id = (t + val[0]) / max;
      sumqx = sumq2 = 0;
      for (int j = 0; j < 32; ++j) {
        const float q = val[nearest_level(id * x[j])];
        const float w = weight[j];
        sumqx += w * q * x[j];
        sumq2 += w * q * q;
      }
      if (sumq2 > 0 && sumqx * sumqx > best * sumq2) d = sumqx / sumq2, best = d * sumqx;
    }
  }
  put_half(out, d);
  const float id = d ? 1 / d : 0;
  uint8_t L[32];
  for (int j = 0; j < 32; ++j) L[j] = uint8_t(nearest_level(id * x[j]));
  for (int j = 0; j < 16; ++j) out[2 + j] = uint8_t(L[j] | (L[16 + j] << 4));
}

void legacy_row(const float* x, uint8_t* out, size_t n, const float* qw, int bits, bool with_min) {
  float sum_x2 = 0;
  for (size_t j = 0; j < n; ++j) sum_x2 += x[j] * x[j];
  const float sigma2 = sum_x2 / float(n);
  const size_t bytes = with_min ? (bits == 5 ? 24 : 20) : (bits == 5 ? 22 : 18);
  float weight[32];
  for (size_t b = 0; b < n / 32; ++b, x += 32, qw += 32, out += bytes) {
    importance_weights(32, x, qw, sigma2, weight);
    uint8_t L[32];
    if (with_min) {
      float neg_min;
      const float d = affine_search(32, x, weight, L, &neg_min, {(1 << bits) - 1, -0.9f, 0.05f, 36, false});
      put_half(out, d);
      put_half(out + 2, -neg_min);
    } else {
      int8_t S[32];
      put_half(out, symmetric_search(32, 1 << (bits - 1), x, S, weight));
      for (int j = 0; j < 32; ++j) L[j] = uint8_t(S[j]);
    }
    uint8_t* qs = out + (with_min ? 4 : 2) + (bits == 5 ? 4 : 0);
    uint32_t qh = 0;
    for (int j = 0; j < 16; ++j) {
      qs[j] = uint8_t((L[j] & 0x0F) | ((L[j + 16] & 0x0F) << 4));
      qh |= uint32_t((L[j] & 0x10u) >> 4) << j | uint32_t((L[j + 16] & 0x10u) >> 4) << (j + 16);
    }
    if (bits == 5) std::memcpy(out + (with_min ? 4 : 2), &qh, 4);
  }
}

}  // namespace serval::kquant
