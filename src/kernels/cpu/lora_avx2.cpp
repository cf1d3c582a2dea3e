// cpu::lora_update's inner loops at the AVX2 level (also run at the AVX-512 and AMX levels: the
// products are small, and their cost is the reading of A and B). FMA throughout; lane sums reduced
// in a fixed order, so a token's result depends only on its row and the shapes.
#include <immintrin.h>

#include "kernels/cpu/lora_levels.h"

namespace serval::cpu {

// Four 8-lane partial sums over blocks of 32, then the tail in one more 8-lane sum (masked), then a
// fixed reduction.
float lora_dot_avx2(const float* a, const float* x, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(x + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(x + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(x + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(x + i + 24), s3);
  }
  for (; i < n; i += 8) {
    const int64_t left = n - i < 8 ? n - i : 8;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    s0 = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(x + i, mask), s0);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// 32 outputs at a time in four registers, the rank summed in order; the tail 8 (then 1) at a time,
// the same order per output.
void lora_expand_avx2(const float* bt, int64_t ld, int64_t rank, const float* m, float f, float* y, int64_t n) {
  const __m256 vf = _mm256_set1_ps(f);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 mr = _mm256_set1_ps(m[r]);
      const float* b = bt + r * ld + i;
      a0 = _mm256_fmadd_ps(mr, _mm256_loadu_ps(b), a0);
      a1 = _mm256_fmadd_ps(mr, _mm256_loadu_ps(b + 8), a1);
      a2 = _mm256_fmadd_ps(mr, _mm256_loadu_ps(b + 16), a2);
      a3 = _mm256_fmadd_ps(mr, _mm256_loadu_ps(b + 24), a3);
    }
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vf, a0, _mm256_loadu_ps(y + i)));
    _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(vf, a1, _mm256_loadu_ps(y + i + 8)));
    _mm256_storeu_ps(y + i + 16, _mm256_fmadd_ps(vf, a2, _mm256_loadu_ps(y + i + 16)));
    _mm256_storeu_ps(y + i + 24, _mm256_fmadd_ps(vf, a3, _mm256_loadu_ps(y + i + 24)));
  }
  for (; i + 8 <= n; i += 8) {
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) a0 = _mm256_fmadd_ps(_mm256_set1_ps(m[r]), _mm256_loadu_ps(bt + r * ld + i), a0);
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vf, a0, _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) {
    float acc = 0;
    for (int64_t r = 0; r < rank; ++r) acc = __builtin_fmaf(m[r], bt[r * ld + i], acc);
    y[i] = __builtin_fmaf(f, acc, y[i]);
  }
}

}  // namespace serval::cpu
