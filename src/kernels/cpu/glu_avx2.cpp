// cpu::glu at the AVX2 level: 8 lanes, the tail with masked loads and stores (a lane's result does
// not depend on n or on its position).
//
// act(x) = x * sigmoid(z), z = x (SiLU) or z = x (A + B x^2) (GELU, tanh form: glu_levels.h), written
// so that nothing cancels or overflows: with m = e^-|z|,
//   z >= 0:  act = x / (1 + m)          z < 0:  act = x e^z / (1 + m)   (x e^z = (x p) 2^n, see below)
// e^a (a = -|z|, clamped at -110) = p * 2^n: n = round(a / ln2), r = a - n ln2 (ln2 in two parts,
// FMA), p = Taylor polynomial of degree 7 on |r| <= ln2 / 2, Horner with FMA.
//
// Error budget (u = 2^-24), while the result and x e^z are normal floats: r carries ~u |r| <= 0.35u
// absolute error (relative error of e^r), truncation < 0.1u, Horner rounding ~1.5u: p within ~2.5u;
// x p (1 rounding), 1 + m (1 rounding; m's error enters scaled by m / (1 + m) <= 1/2), the division
// and the product with up (1 rounding each): at most ~7.75u in all. GELU adds the error of z (float
// constants A and B, x^2, the FMA, the product: <= 4u |z|), which moves act by (1 - sigmoid(z)) times
// it. tests/unit/test_glu.cpp asserts 10u + 4u |z| (1 - sigmoid(z)) against the exact formula.
// Special values: act(+-0) = +-0, act(+inf) = +inf, act(-inf) = -0 (the limit: x is clamped at -128
// in the z < 0 numerator), act(NaN) = NaN; then act * up in IEEE arithmetic.
#include <immintrin.h>

#include "kernels/cpu/glu_levels.h"

namespace serval::cpu {
namespace {

// 2^k for integer lanes -126 <= k <= 127.
inline __m256 pow2(__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }

// e^a for lanes a <= 0 (clamped at -110; NaN stays NaN) as p * s1 * s2 (see the top of the file).
struct Exp8 {
  __m256 p, s1, s2;
};
inline Exp8 exp_nonpositive(__m256 z) {
  // VMAXPS returns its second operand when one is NaN: a NaN stays NaN.
  const __m256 a = _mm256_max_ps(_mm256_set1_ps(-110.0f), _mm256_or_ps(z, _mm256_set1_ps(-0.0f)));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), a);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n in [-159, 0]: 2^n as 2^n1 * 2^n2 with both factors normal; only the second product can round
  // (when the result is subnormal).
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  return {p, pow2(n1), pow2(n2)};
}

template <bool kGelu>
inline __m256 glu8(__m256 x, __m256 up) {
  __m256 z = x;
  if constexpr (kGelu) z = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(float(kGeluB)), _mm256_mul_ps(x, x),
                                                           _mm256_set1_ps(float(kGeluA))));
  const __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
  const auto [p, s1, s2] = exp_nonpositive(z);
  const __m256 m = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-128.0f), x);
  const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(xc, p), s1), s2), neg);
  const __m256 act = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), m));
  return _mm256_mul_ps(act, up);
}

// GELU in its erf form, 0.5 x (1 + erf(x / sqrt 2)), with erf from Abramowitz & Stegun 7.1.26 (as
// PyTorch's vectorized erf): for z = |x| / sqrt 2, t = 1 / (1 + 0.3275911 z),
// 1 - erf(z) = (a1 t + ... + a5 t^5) e^(-z^2) = q, |error| <= 1.5e-7. Then 1 + erf(x / sqrt 2) is 2 - q
// for x >= 0 and q itself for x < 0 (no cancellation). So |result - gelu(x)| <= 0.5 |x| 1.5e-7 plus
// float rounding (tests/unit/test_glu.cpp).
inline __m256 gelu_erf8(__m256 x) {
  const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(0.70710678118654752f));
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), z, _mm256_set1_ps(1.0f)));
  __m256 poly = _mm256_set1_ps(1.061405429f);
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(-1.453152027f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(1.421413741f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(-0.284496736f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(0.254829592f));
  poly = _mm256_mul_ps(poly, t);
  const auto [p, s1, s2] = exp_nonpositive(_mm256_mul_ps(z, z));
  const __m256 q = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(poly, p), s1), s2);
  const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 one_plus_erf = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.0f), q), q, neg);
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), one_plus_erf);
}

template <bool kGelu>
void run(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, glu8<kGelu>(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 g = _mm256_maskload_ps(gate + i, k), u = _mm256_maskload_ps(up + i, k);
    _mm256_maskstore_ps(out + i, k, glu8<kGelu>(g, u));
  }
}

}  // namespace

void gelu_erf_avx2(float* x, int64_t n, const float* bias) {
  int64_t i = 0;
  const auto with_bias = [&](__m256 v, __m256 b) { return bias ? _mm256_add_ps(v, b) : v; };
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, gelu_erf8(with_bias(_mm256_loadu_ps(x + i), bias ? _mm256_loadu_ps(bias + i) : __m256())));
  if (i < n) {
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 b = bias ? _mm256_maskload_ps(bias + i, k) : _mm256_setzero_ps();
    _mm256_maskstore_ps(x + i, k, gelu_erf8(with_bias(_mm256_maskload_ps(x + i, k), b)));
  }
}

void glu_avx2(GluKind kind, const float* gate, const float* up, float* out, int64_t n) {
  if (kind == GluKind::GeluTanh) run<true>(gate, up, out, n);
  else run<false>(gate, up, out, n);
}

}  // namespace serval::cpu
