// Roofline probe, AVX512_BF16: independent VDPBF16PS chains on registers only. Compiled with
// -mavx512bf16 on top of the AVX-512 flags; called only when the CPU reports AVX512_BF16.
#include <immintrin.h>

#include "kernels/cpu/probe_loops.h"

namespace serval::cpu::probe {

uint64_t bf16_loop(int64_t iters, uint64_t* sink) {
  alignas(64) static const float vals[16] = {0.5f, 0.25f, -0.125f, 1.0f, 0.75f, -0.5f, 0.375f, 0.0625f,
                                             -0.25f, 0.5f, 0.125f, -1.0f, 0.25f, 0.5f, -0.75f, 0.125f};
  const __m512 f = _mm512_load_ps(vals);
  const __m512bh a = _mm512_cvtne2ps_pbh(f, _mm512_mul_ps(f, f)), b = _mm512_cvtne2ps_pbh(_mm512_sub_ps(f, f), f);
  __m512 c[16];
  for (int i = 0; i < 16; ++i) c[i] = _mm512_set1_ps(float(i));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) c[i] = _mm512_dpbf16_ps(c[i], a, b);
  }
  __m512 s = c[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, c[i]);
  *sink += uint64_t(_mm512_reduce_add_ps(s) != 0.0f);
  return uint64_t(iters) * 16 * 32 * 2;  // 32 bf16 products (each a multiply and an add) per instruction
}

}  // namespace serval::cpu::probe
