// The per-level kernels behind cpu::glu (ops.h); glu.cpp is the one place that picks among them.
#pragma once
#include <cstdint>

#include "kernels/ops.h"

namespace serval::cpu {

// The GELU (tanh form) argument z = 2 * sqrt(2 / pi) * (x + 0.044715 x^3), so that
// gelu_tanh(x) = 0.5 x (1 + tanh(z / 2)) = x / (1 + exp(-z)); written as x * (kGeluA + kGeluB * x^2).
constexpr double kGeluA = 1.5957691216057307117597842397375;  // 2 * sqrt(2 / pi)
constexpr double kGeluB = kGeluA * 0.044715;

void glu_scalar(GluKind kind, const float* gate, const float* up, float* out, int64_t n);
void glu_avx2(GluKind kind, const float* gate, const float* up, float* out, int64_t n);
void glu_avx512(GluKind kind, const float* gate, const float* up, float* out, int64_t n);
// gelu_erf_inplace per level; bias may be null.
void gelu_erf_scalar(float* x, int64_t n, const float* bias);
void gelu_erf_avx2(float* x, int64_t n, const float* bias);
void gelu_erf_avx512(float* x, int64_t n, const float* bias);  // also the AMX level's

}  // namespace serval::cpu
