// Fast CPU ops: the packed GEMM for quantized types, row-blocked dequantization and dot products for
// the others, on the compute pool.
#include <algorithm>
#include <cmath>
#include <vector>

#include "base/error.h"
#include "base/thread_pool.h"
#include "kernels/act_quant.h"
#include "kernels/cpu/gemm_float.h"
#include "kernels/cpu/packed.h"
#include "kernels/cpu/vec_dot_isa.h"
#include "kernels/isa.h"
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
    parallel_for(n_tok, [&](int64_t t) {
      if (!floats) return quantize_act_row(type, x + t * cols, cols, quantized.data() + t * row_bytes);
      std::vector<uint8_t> tmp(row_bytes);
      quantize_act_row(type, x + t * cols, cols, tmp.data());
      dequantize_row(type == ActType::F16 ? DType::F16 : DType::BF16, tmp.data(), rounded.data() + t * cols, cols);
    });
  }
};

// F16 / BF16 weights repacked for the float GEMM (gemm_float.h): activations rounded once, then tasks
// of (row groups x up to 64 tokens), as matmul_packed splits its products.
void matmul_packed_float(const WeightMatrix& w, const float* x, float* y, int64_t n_tok) {
  thread_local FloatActs buffers;  // the calling thread's, reused across calls
  FloatActs& acts = buffers;
  const PackedFloatWeights& p = *w.packed_float;
  prepare_float_acts(p.source, x, p.cols, n_tok, acts);
  const FloatGemmFn gemm = float_gemm_for(active_isa());
  constexpr int64_t kTokChunk = 64;
  const int64_t n_tchunks = (n_tok + kTokChunk - 1) / kTokChunk;
  const int64_t per_task = std::max<int64_t>(1, p.n_groups * n_tchunks / (int64_t(pool_threads()) * 8));
  const int64_t n_gchunks = (p.n_groups + per_task - 1) / per_task;
  parallel_for(n_gchunks * n_tchunks, [&](int64_t task) {
    const int64_t gc = task % n_gchunks, tc = task / n_gchunks;
    const int64_t g0 = gc * per_task, g1 = std::min(p.n_groups, g0 + per_task);
    const int64_t t0 = tc * kTokChunk, t1 = std::min(n_tok, t0 + kTokChunk);
    gemm(p, acts, g0, g1, t0, t1, y);
  });
}

// Float weights: F16 / BF16 prepared for the float GEMM take it (`x` as given: it rounds them);
// otherwise dequantize a tile of rows once, dot with every token's (rounded) activations.
void matmul_float(const WeightMatrix& w, const float* x, float* y, int64_t n_tok) {
  if (w.packed_float) return matmul_packed_float(w, x, y, n_tok);
  constexpr int64_t kRowsPerTile = 4;
  const int64_t n_tiles = (w.rows + kRowsPerTile - 1) / kRowsPerTile;
  const bool direct = w.type == DType::F32;
  parallel_for(n_tiles, [&](int64_t tile) {
    thread_local std::vector<float> buf;
    if (!direct) buf.resize(kRowsPerTile * w.cols);
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
  });
}

// Quantized types without a packed layout: each weight block unpacked once per group of tokens.
void matmul_rows(const WeightMatrix& w, const PreparedActivations& act, float* y, int64_t n_tok) {
  constexpr int64_t kRowsPerTile = 8;
  const int64_t n_tiles = (w.rows + kRowsPerTile - 1) / kRowsPerTile;
  parallel_for(n_tiles, [&](int64_t tile) {
    const int64_t r0 = tile * kRowsPerTile, r1 = std::min(w.rows, r0 + kRowsPerTile);
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
  });
}

void vec_dot_rows(DType t, const uint8_t* w, const uint8_t* const* acts, int n_rows, int64_t n, float* out) {
#if defined(SERVAL_X86_KERNELS)
  if (active_isa() >= Isa::Avx512 && vec_dot_rows_avx512(t, w, acts, n_rows, n, out)) return;
#endif
  for (int r = 0; r < n_rows; ++r) out[r] = ref::vec_dot(t, w, acts[r], n);
}

float vec_dot(DType t, const uint8_t* w, const uint8_t* act, int64_t n) {
  float out;
  vec_dot_rows(t, w, &act, 1, n, &out);
  return out;
}

PackedGemmFn packed_gemm_for(Isa isa) {
#if defined(SERVAL_X86_KERNELS)
  switch (isa) {
    case Isa::Amx: return packed_gemm_amx;
    case Isa::Avx512: return packed_gemm_avx512;
    case Isa::Avx2: return packed_gemm_avx2;
    case Isa::Scalar: return packed_gemm_scalar;
  }
#endif
  return packed_gemm_scalar;
}

// Tasks of (row groups x tokens): token chunks small enough that their activations stay in L2, and
// enough tasks per thread that a thread slowed by another process hands its share to the others.
struct PackedTasks {
  static constexpr int64_t kTokChunk = 64;
  int64_t n_tok, n_tchunks, per_task, n_gchunks;
  PackedTasks(const PackedWeights& p, int64_t n_tok, int64_t share)
      : n_tok(n_tok), n_tchunks((n_tok + kTokChunk - 1) / kTokChunk) {
    per_task = std::max<int64_t>(1, p.n_groups * n_tchunks / share);
    n_gchunks = (p.n_groups + per_task - 1) / per_task;
  }
  int64_t count() const { return n_gchunks * n_tchunks; }
  void run(PackedGemmFn gemm, const PackedWeights& p, const PackedActs& acts, float* y, int64_t task) const {
    const int64_t gc = task % n_gchunks, tc = task / n_gchunks;
    const int64_t g0 = gc * per_task, g1 = std::min(p.n_groups, g0 + per_task);
    const int64_t t0 = tc * kTokChunk, t1 = std::min(n_tok, t0 + kTokChunk);
    gemm(p, acts, g0, g1, t0, t1, y);
  }
};

// Products of packed matrices whose activations have one format, quantized once, in one job.
void matmul_packed(std::span<const MatmulOut> outs, const float* x, int64_t n_tok) {
  thread_local PackedActs buffers;  // the calling thread's, reused across calls
  PackedActs& acts = buffers;       // (a lambda names a thread_local of the thread it runs on)
  const PackedWeights& first = *outs[0].w->packed;
  quantize_packed_acts(first.source, x, first.cols, n_tok, acts);
  const Isa level = active_isa();
  const PackedGemmFn gemm = packed_gemm_for(level);
  int64_t total_groups = 0;
  for (const auto& o : outs) {
    total_groups += o.w->packed->n_groups;
    check(!o.w->packed->plane_by_value || int(level) <= int(Isa::Avx2),  // packed.h: PlaneLayout
          "weights packed with the AVX2 plane order run at the avx2 level or below, not {}", isa_name(level));
  }
  std::vector<PackedTasks> tasks;
  std::vector<int64_t> start{0};
  for (const auto& o : outs) {
    const int64_t share = std::max<int64_t>(1, pool_threads() * 8 * o.w->packed->n_groups / total_groups);
    tasks.emplace_back(*o.w->packed, n_tok, share);
    start.push_back(start.back() + tasks.back().count());
  }
  parallel_for(start.back(), [&](int64_t task) {
    const size_t m = size_t(std::upper_bound(start.begin(), start.end(), task) - start.begin()) - 1;
    tasks[m].run(gemm, *outs[m].w->packed, acts, outs[m].y, task - start[m]);
  });
}

void prepare_weights(WeightMatrix& w) {
  if (!w.empty() && !w.packed && packable(w.type)) w.packed = pack_weights(w);
  if (!w.empty() && !w.packed_float && float_packable(w.type)) w.packed_float = pack_float_weights(w);
}

void matmul(const WeightMatrix& w, const float* x, float* y, int64_t n_tok) {
  if (w.packed) {
    const MatmulOut out{&w, y};
    return matmul_packed(std::span(&out, 1), x, n_tok);
  }
  if (w.packed_float) return matmul_float(w, x, y, n_tok);  // rounds the activations itself
  if (act_type_for(w.type) == ActType::F32) return matmul_float(w, x, y, n_tok);  // no copy needed
  const PreparedActivations act(w.type, x, w.cols, n_tok);
  if (act.quantized.empty()) return matmul_float(w, act.rounded.data(), y, n_tok);
  matmul_rows(w, act, y, n_tok);
}

void matmul_many(std::span<const MatmulOut> outs, const float* x, int64_t n_tok) {
  // Runs of packed matrices with one activation format share a quantization and a job.
  for (size_t i = 0; i < outs.size();) {
    size_t j = i + 1;
    const WeightMatrix& w = *outs[i].w;
    if (w.packed)
      while (j < outs.size() && outs[j].w->packed && outs[j].w->cols == w.cols &&
             act_type_for(outs[j].w->type) == act_type_for(w.type))
        ++j;
    if (w.packed) matmul_packed(outs.subspan(i, j - i), x, n_tok);
    else matmul(w, x, outs[i].y, n_tok);
    i = j;
  }
}

}  // namespace cpu

void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float scale = float(1.0 / std::sqrt(ss / double(n) + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

void layer_norm(const float* x, const float* w, const float* b, float* out, int64_t n, float eps) {
  double sum = 0, ss = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const double mean = sum / double(n);
  for (int64_t i = 0; i < n; ++i) ss += (x[i] - mean) * (x[i] - mean);
  const double inv = 1.0 / std::sqrt(ss / double(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = float((x[i] - mean) * inv) * w[i] + b[i];
}

float gelu_erf(float x) { return float(0.5 * x * std::erfc(-double(x) * 0.7071067811865476)); }

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
  dequantize_row(type, pool + row_bytes(type, size_t(int64_t(slot) * kv_dim + offset)), out, size_t(n));
  if (type != DType::F8_E4M3 || !head_scale) return;
  const float s = head_scale[offset / d_head];
  for (int64_t i = 0; i < n; ++i) out[i] *= s;
}

void hadamard_rotate(float* x, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1)
    for (int64_t i = 0; i < n; i += 2 * len)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b, x[j + len] = a - b;
      }
  const float s = 1.0f / std::sqrt(float(n));
  for (int64_t j = 0; j < n; ++j) x[j] *= s;
}

void get_row(const WeightMatrix& w, int64_t row, float* out) {
  dequantize_row(w.type, w.data + row * w.row_stride, out, w.cols);
}

}  // namespace serval
