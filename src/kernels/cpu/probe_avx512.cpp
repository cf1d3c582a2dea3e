// Roofline probe, AVX-512 VNNI level: independent VPDPBUSD chains on registers only.
#include <immintrin.h>

#include "kernels/cpu/probe_loops.h"

namespace serval::cpu::probe {

uint64_t vnni_loop(int64_t iters, uint64_t* sink) {
  // Operands from memory once (not constants the compiler could fold); 16 accumulators cover the
  // instruction's latency times its throughput (5 cycles x 2 per cycle on recent cores).
  alignas(64) static const uint8_t bytes[64] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3,
                                                2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5};
  const __m512i a = _mm512_load_si512(bytes), b = _mm512_ror_epi32(a, 7);
  __m512i c[16];
  for (int i = 0; i < 16; ++i) c[i] = _mm512_set1_epi32(i);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) c[i] = _mm512_dpbusd_epi32(c[i], a, b);
  }
  __m512i s = c[0];
  for (int i = 1; i < 16; ++i) s = _mm512_xor_si512(s, c[i]);
  *sink += uint64_t(_mm512_reduce_add_epi32(s));
  return uint64_t(iters) * 16 * 64 * 2;  // 64 byte products (each a multiply and an add) per instruction
}

}  // namespace serval::cpu::probe
