// The per-level inner loops behind cpu::lora_update (ops.h); lora.cpp is the one place that picks
// among them and splits the work over the compute pool.
#pragma once
#include <cstdint>

namespace serval::cpu {

// A LoRA update's first product for one token: the dot of a row of A with the token's activations.
float lora_dot_scalar(const float* a, const float* x, int64_t n);
float lora_dot_avx2(const float* a, const float* x, int64_t n);  // also the AVX-512 and AMX levels'
// Its second product over outputs [0, n): y[i] += f * sum_r m[r] * bt[r * ld + i], r = 0 .. rank - 1 in
// order (vectorized over i).
void lora_expand_scalar(const float* bt, int64_t ld, int64_t rank, const float* m, float f, float* y, int64_t n);
void lora_expand_avx2(const float* bt, int64_t ld, int64_t rank, const float* m, float f, float* y, int64_t n);

}  // namespace serval::cpu
