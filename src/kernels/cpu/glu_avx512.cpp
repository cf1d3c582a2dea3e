// cpu::glu at the AVX-512 level: 16 lanes, the tail with masked loads and stores (a lane's result does
// not depend on n or on its position). The arithmetic is glu_avx2.cpp's (see there for the error
// budget); 2^n is applied with VSCALEFPS, which rounds once, also into the subnormal range.
#include <immintrin.h>

#include "kernels/cpu/glu_levels.h"

namespace serval::cpu {
namespace {

// act(x) * up, lane by lane.
// e^-|z| as p * 2^n (p in [sqrt(1/2), sqrt(2)], n <= 0 an integer), the exponential of glu16.
struct Exp16 {
  __m512 p, n;
};
inline Exp16 exp_nonpositive(__m512 z) {
  // VMAXPS returns its second operand when one is NaN: a NaN stays NaN.
  const __m512 a = _mm512_max_ps(_mm512_set1_ps(-110.0f), _mm512_or_ps(z, _mm512_set1_ps(-0.0f)));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), a);  // a - n ln2, in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  // e^r on |r| <= ln2 / 2: Taylor to degree 7 (truncation < 2^-27 relative).
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return {p, n};
}

// GELU's erf form as glu_avx2.cpp's gelu_erf8 (Abramowitz & Stegun 7.1.26), 16 lanes; e^(-z^2) scaled
// by VSCALEFPS, which rounds once.
inline __m512 gelu_erf16(__m512 x) {
  const __m512 z = _mm512_mul_ps(_mm512_andnot_ps(_mm512_set1_ps(-0.0f), x), _mm512_set1_ps(0.70710678118654752f));
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), z, _mm512_set1_ps(1.0f)));
  __m512 poly = _mm512_set1_ps(1.061405429f);
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-1.453152027f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(1.421413741f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-0.284496736f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(0.254829592f));
  poly = _mm512_mul_ps(poly, t);
  const auto [p, n] = exp_nonpositive(_mm512_mul_ps(z, z));
  const __m512 q = _mm512_scalef_ps(_mm512_mul_ps(poly, p), n);
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 one_plus_erf = _mm512_mask_mov_ps(_mm512_sub_ps(_mm512_set1_ps(2.0f), q), neg, q);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), one_plus_erf);
}

template <bool kGelu>
inline __m512 glu16(__m512 x, __m512 up) {
  __m512 z = x;
  if constexpr (kGelu) z = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_set1_ps(float(kGeluB)), _mm512_mul_ps(x, x),
                                                           _mm512_set1_ps(float(kGeluA))));
  const __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  // e^a for a = -|z| >= -110 (below, e^a * |x| rounds to 0 anyway); VMAXPS returns its second operand
  // when one is NaN, so a NaN stays NaN.
  const auto [p, n] = exp_nonpositive(z);
  const __m512 m = _mm512_scalef_ps(p, n);  // e^-|z|
  // Numerator: x for z >= 0; x e^z for z < 0, with x >= -128 so that x = -inf gives -0 (the limit).
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-128.0f), x);
  const __m512 num = _mm512_mask_mov_ps(x, neg, _mm512_scalef_ps(_mm512_mul_ps(xc, p), n));
  const __m512 act = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), m));
  return _mm512_mul_ps(act, up);
}

template <bool kGelu>
void run(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, glu16<kGelu>(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(k, gate + i), u = _mm512_maskz_loadu_ps(k, up + i);
    _mm512_mask_storeu_ps(out + i, k, glu16<kGelu>(g, u));
  }
}

}  // namespace

void gelu_erf_avx512(float* x, int64_t n, const float* bias) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(x + i, gelu_erf16(bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias + i)) : v));
  }
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
    _mm512_mask_storeu_ps(x + i, k, gelu_erf16(bias ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + i)) : v));
  }
}

void glu_avx512(GluKind kind, const float* gate, const float* up, float* out, int64_t n) {
  if (kind == GluKind::GeluTanh) run<true>(gate, up, out, n);
  else run<false>(gate, up, out, n);
}

}  // namespace serval::cpu
