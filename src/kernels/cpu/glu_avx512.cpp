// cpu::glu at the AVX-512 level: 16 lanes, the tail with masked loads and stores (a lane's result does
// not depend on n or on its position). The arithmetic is glu_avx2.cpp's (see there for the error
// budget); 2^n is applied with VSCALEFPS, which rounds once, also into the subnormal range.
#include <immintrin.h>

#include "kernels/cpu/glu_levels.h"

namespace serval::cpu {
namespace {

// act(x) * up, lane by lane.
template <bool kGelu>
inline __m512 glu16(__m512 x, __m512 up) {
  __m512 z = x;
  if constexpr (kGelu) z = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_set1_ps(float(kGeluB)), _mm512_mul_ps(x, x),
                                                           _mm512_set1_ps(float(kGeluA))));
  const __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  // e^a for a = -|z| >= -110 (below, e^a * |x| rounds to 0 anyway); VMAXPS returns its second operand
  // when one is NaN, so a NaN stays NaN.
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

void glu_avx512(GluKind kind, const float* gate, const float* up, float* out, int64_t n) {
  if (kind == GluKind::GeluTanh) run<true>(gate, up, out, n);
  else run<false>(gate, up, out, n);
}

}  // namespace serval::cpu
