// cpu::glu (ops.h): the one dispatch by ISA level, and the scalar level (evaluated in double with
// std::exp, then rounded: the reference the SIMD levels are measured against).
#include <algorithm>
#include <cmath>
#include <vector>
#include <limits>

#include "kernels/cpu/glu_levels.h"
#include "kernels/isa.h"

namespace serval::cpu {
namespace {

// act(x) = x * sigmoid(z), z = x (SiLU) or the GELU argument, in the form that never cancels:
// x / (1 + e^-z) for z >= 0, x e^z / (1 + e^z) for z < 0. act(-inf) = -0 (the limit), act(+inf) = +inf,
// act(NaN) = NaN.
double act(GluKind kind, double x) {
  if (std::isnan(x)) return x;
  if (x == -std::numeric_limits<double>::infinity()) return -0.0;
  const double z = kind == GluKind::GeluTanh ? x * (kGeluA + kGeluB * x * x) : x;
  if (z >= 0) return x / (1 + std::exp(-z));
  const double e = std::exp(z);
  return x * e / (1 + e);
}

}  // namespace

void glu_scalar(GluKind kind, const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(act(kind, gate[i])) * up[i];
}

void gelu_erf_scalar(float* x, int64_t n, const float* bias) {
  for (int64_t i = 0; i < n; ++i) x[i] = gelu_erf(bias ? x[i] + bias[i] : x[i]);
}

void gelu_erf_inplace(float* x, int64_t n, const float* bias) {
#if defined(SERVAL_X86_KERNELS)
  if (active_isa() >= Isa::Avx512) return gelu_erf_avx512(x, n, bias);
  if (active_isa() == Isa::Avx2) return gelu_erf_avx2(x, n, bias);
#endif
  gelu_erf_scalar(x, n, bias);
}

void glu(GluKind kind, const float* gate, const float* up, float* out, int64_t n) {
  switch (active_isa()) {
#if defined(SERVAL_X86_KERNELS)
    case Isa::Amx:
    case Isa::Avx512: return glu_avx512(kind, gate, up, out, n);
    case Isa::Avx2: return glu_avx2(kind, gate, up, out, n);
#endif
    default: return glu_scalar(kind, gate, up, out, n);
  }
}

void glu_oai(const float* gate, const float* up, float* out, int64_t n, float alpha, float limit) {
  thread_local std::vector<float> g, u;
  g.resize(size_t(n)), u.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    g[size_t(i)] = std::min(gate[i], limit) * alpha;
    u[size_t(i)] = (std::clamp(up[i], -limit, limit) + 1.0f) / alpha;
  }
  glu(GluKind::Silu, g.data(), u.data(), out, n);
}

}  // namespace serval::cpu
