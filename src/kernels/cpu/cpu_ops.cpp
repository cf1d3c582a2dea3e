// Fast CPU ops: row-blocked dequantization, SIMD dot products (vectorized by the compiler for the
// build machine's ISA), OpenMP threads over output rows.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/act_quant.h"
#include "kernels/ops.h"
#include "tensor/dequant.h"

namespace serval {
namespace cpu {

// 16 independent partial sums in a fixed order, then a fixed pairwise reduction: the result
// depends only on the two vectors, never on the batch around them.
float dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}

// Activations as the weight type is multiplied with: quantized (Q8_0 / Q8_1 / Q8_K) once per token,
// or rounded to F16 / BF16 and kept as floats.
struct PreparedActivations {
  ActType type;
  size_t row_bytes;
  std::vector<uint8_t> quantized;  // [n_tok, row_bytes] for the Q8 types
  std::vector<float> rounded;      // [n_tok, cols] for F16 / BF16

  PreparedActivations(DType w_type, const float* x, int64_t cols, int64_t n_tok)
      : type(act_type_for(w_type)), row_bytes(act_row_bytes(type, cols)) {
    const bool floats = type == ActType::F32 || type == ActType::F16 || type == ActType::BF16;
    if (floats) rounded.assign(x, x + n_tok * cols);  // F16 / BF16: rounded in place below
    else quantized.resize(n_tok * row_bytes);
    std::vector<uint8_t> tmp(floats ? row_bytes : 0);
#pragma omp parallel for schedule(static) if (n_tok > 1) firstprivate(tmp)
    for (int64_t t = 0; t < n_tok; ++t) {
      if (!floats) { quantize_act_row(type, x + t * cols, cols, quantized.data() + t * row_bytes); continue; }
      quantize_act_row(type, x + t * cols, cols, tmp.data());
      dequantize_row(type == ActType::F16 ? DType::F16 : DType::BF16, tmp.data(), rounded.data() + t * cols, cols);
    }
  }
};

// Float weights: dequantize a tile of rows once, dot with every token's (rounded) activations.
void matmul_float(const WeightMatrix& w, const float* x, float* y, int64_t n_tok) {
  constexpr int64_t kRowsPerTile = 4;
  const int64_t n_tiles = (w.rows + kRowsPerTile - 1) / kRowsPerTile;
  const bool direct = w.type == DType::F32;
#pragma omp parallel
  {
    std::vector<float> buf(direct ? 0 : kRowsPerTile * w.cols);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < n_tiles; ++tile) {
      const int64_t r0 = tile * kRowsPerTile, r1 = std::min(w.rows, r0 + kRowsPerTile);
      const float* rows[kRowsPerTile];
      for (int64_t r = r0; r < r1; ++r) {
        if (direct) {
          rows[r - r0] = reinterpret_cast<const float*>(w.data + r * w.row_stride);
        } else {
          dequantize_row(w.type, w.data + r * w.row_stride, buf.data() + (r - r0) * w.cols, w.cols);
          rows[r - r0] = buf.data() + (r - r0) * w.cols;
        }
      }
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t r = r0; r < r1; ++r) y[t * w.rows + r] = dot(rows[r - r0], x + t * w.cols, w.cols);
    }
  }
}

void matmul(const WeightMatrix& w, const float* x, float* y, int64_t n_tok) {
  if (act_type_for(w.type) == ActType::F32) return matmul_float(w, x, y, n_tok);  // no copy needed
  const PreparedActivations act(w.type, x, w.cols, n_tok);
  if (act.quantized.empty()) return matmul_float(w, act.rounded.data(), y, n_tok);
  constexpr int64_t kRowsPerTile = 8;
  const int64_t n_tiles = (w.rows + kRowsPerTile - 1) / kRowsPerTile;
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < n_tiles; ++tile) {
    const int64_t r0 = tile * kRowsPerTile, r1 = std::min(w.rows, r0 + kRowsPerTile);
    // Tokens in groups: each weight block is unpacked once per group.
    for (int64_t t0 = 0; t0 < n_tok; t0 += kMaxDotRows) {
      const int n = int(std::min<int64_t>(kMaxDotRows, n_tok - t0));
      const uint8_t* acts[kMaxDotRows];
      for (int k = 0; k < n; ++k) acts[k] = act.quantized.data() + (t0 + k) * act.row_bytes;
      float out[kMaxDotRows];
      for (int64_t r = r0; r < r1; ++r) {
        vec_dot_rows(w.type, w.data + r * w.row_stride, acts, n, w.cols, out);
        for (int k = 0; k < n; ++k) y[(t0 + k) * w.rows + r] = out[k];
      }
    }
  }
}

}  // namespace cpu

void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float scale = float(1.0 / std::sqrt(ss / double(n) + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

void softmax_inplace(float* x, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
  for (int64_t i = 0; i < n; ++i) x[i] = float(x[i] / sum);
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }

float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + 0.044715f * x * x)));
}

void KvLayerView::load(const uint8_t* pool, int32_t slot, int64_t offset, int64_t n, float* out) const {
  const size_t elem = type == DType::F16 ? 2 : 4;
  dequantize_row(type, pool + (int64_t(slot) * kv_dim + offset) * elem, out, n);
}

void get_row(const WeightMatrix& w, int64_t row, float* out) {
  dequantize_row(w.type, w.data + row * w.row_stride, out, w.cols);
}

}  // namespace serval
