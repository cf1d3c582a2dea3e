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
// Tasks of (row groups x tokens): token chunks small enough that their activations stay in L2, and
// enough tasks per thread that a thread slowed by another process hands its share to the others. The
// AMX kernels take a task's groups in pairs (two groups x two token tiles at once) and longer token
// chunks: the int8 one widens its groups' weights once per call, for all the call's tokens (256 tokens
// rather than 128: Q5_0 +25-40 %, Q4_K +15-22 % in serval_bench_gemm); the BF16 tiles have nothing to
// widen and keep more tasks (128; 256 was 3-8 % slower on MiniLM's matrices).
struct GemmSplit {
  int64_t tok_chunk = 64, group_step = 1;
};
constexpr GemmSplit kFloatSplit{64, 1}, kInt8TileSplit{256, 2}, kBf16TileSplit{128, 2};

struct GemmTasks {
  int64_t n_groups, n_tok, tok_chunk, n_tchunks, per_task, n_gchunks;
  GemmTasks(int64_t n_groups, int64_t n_tok, int64_t share, GemmSplit split)
      : n_groups(n_groups), n_tok(n_tok), tok_chunk(split.tok_chunk), n_tchunks((n_tok + tok_chunk - 1) / tok_chunk) {
    const int64_t step = split.group_step;
    per_task = std::max<int64_t>(1, n_groups * n_tchunks / share);
    per_task = (per_task + step - 1) / step * step;
    n_gchunks = (n_groups + per_task - 1) / per_task;
  }
  int64_t count() const { return n_gchunks * n_tchunks; }
  // Calls f(g0, g1, t0, t1) for task `task`.
  template <class F>
  void run(int64_t task, F&& f) const {
    const int64_t gc = task % n_gchunks, tc = task / n_gchunks;
    const int64_t g0 = gc * per_task, t0 = tc * tok_chunk;
    f(g0, std::min(n_groups, g0 + per_task), t0, std::min(n_tok, t0 + tok_chunk));
  }
};

// Each product's tasks, about 8 per thread over all of them in proportion to their groups, in one job:
// run(m, g0, g1, t0, t1) computes product m's part.
template <class Groups, class Run>
void gemm_job(size_t n_products, Groups&& groups, int64_t n_tok, GemmSplit split, Run&& run) {
  int64_t total_groups = 0;
  for (size_t m = 0; m < n_products; ++m) total_groups += groups(m);
  std::vector<GemmTasks> tasks;
  std::vector<int64_t> start{0};
  for (size_t m = 0; m < n_products; ++m) {
    const int64_t share = std::max<int64_t>(1, pool_threads() * 8 * groups(m) / total_groups);
    tasks.emplace_back(groups(m), n_tok, share, split);
    start.push_back(start.back() + tasks.back().count());
  }
  parallel_for(start.back(), [&](int64_t task) {
    const size_t m = size_t(std::upper_bound(start.begin(), start.end(), task) - start.begin()) - 1;
    tasks[m].run(task - start[m], [&](int64_t g0, int64_t g1, int64_t t0, int64_t t1) { run(m, g0, g1, t0, t1); });
  });
}

void matmul_packed_float(const WeightMatrix& w, const float* x, float* y, int64_t n_tok) {
  thread_local FloatActs buffers;  // the calling thread's, reused across calls
  FloatActs& acts = buffers;
  const PackedFloatWeights& p = *w.packed_float;
  prepare_float_acts(p.source, x, p.cols, n_tok, acts);
  const FloatGemmFn gemm = float_gemm_for(active_isa());
  gemm_job(
      1, [&](size_t) { return p.n_groups; }, n_tok, kFloatSplit,
      [&](size_t, int64_t g0, int64_t g1, int64_t t0, int64_t t1) { gemm(p, acts, g0, g1, t0, t1, y); });
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

// A product's bias and activation for rows of groups [g0, g1) (of `group_rows`) and tokens [t0, t1),
// applied by the task that computed those values (still in its cache): elementwise, so the same bits
// as a pass over the whole output.
void finish_rows(const MatmulOut& o, int64_t group_rows, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
  if (!o.bias && !o.gelu_erf) return;
  const int64_t rows = o.w->rows, r0 = g0 * group_rows, r1 = std::min(rows, g1 * group_rows);
  for (int64_t t = t0; t < t1; ++t) {
    float* y = o.y + t * rows + r0;
    const float* b = o.bias ? o.bias + r0 : nullptr;
    if (o.gelu_erf) {
      gelu_erf_inplace(y, r1 - r0, b);
    } else {
      for (int64_t r = 0; r < r1 - r0; ++r) y[r] += b[r];
    }
  }
}

// Products of matrices kept in BF16 tiles (prepare_bf16_tiles) with the same activations, rounded once.
void matmul_bf16_tiles(std::span<const MatmulOut> outs, const float* x, int64_t n_tok) {
#if defined(SERVAL_X86_KERNELS)
  thread_local FloatActs buffers;
  FloatActs& acts = buffers;
  const int64_t cols = outs[0].w->cols, kpad = outs[0].w->tiles_bf16->kpad, n_pad = (n_tok + 15) / 16 * 16;
  acts.source = DType::BF16, acts.n_tok = n_tok, acts.cols = cols, acts.kpad = kpad;
  acts.x.clear();
  if (acts.pairs.size() < size_t(n_pad * kpad / 2)) acts.pairs.resize(size_t(n_pad * kpad / 2));
  parallel_for(n_pad, [&](int64_t t) {
    uint32_t* row = acts.pairs.data() + t * (kpad / 2);
    if (t < n_tok) bf16_tile_row_amx(x + t * cols, cols, kpad, row);
    else std::fill(row, row + kpad / 2, 0u);  // the last tile's rows past n_tok
  });
  gemm_job(
      outs.size(), [&](size_t m) { return outs[m].w->tiles_bf16->n_groups; }, n_tok, kBf16TileSplit,
      [&](size_t m, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
        bf16_tile_gemm_amx(*outs[m].w->tiles_bf16, acts, g0, g1, t0, t1, outs[m].y);
        finish_rows(outs[m], kFloatRows, g0, g1, t0, t1);
      });
#else
  (void)outs, (void)x, (void)n_tok;
  fail("BF16 tiles are x86-64 only");
#endif
}

bool runs_bf16_tiles(const WeightMatrix& w) { return w.tiles_bf16 && active_isa() == Isa::Amx; }

// Products of packed matrices whose activations have one format, quantized once, in one job.
void matmul_packed(std::span<const MatmulOut> outs, const float* x, int64_t n_tok) {
  thread_local PackedActs buffers;  // the calling thread's, reused across calls
  PackedActs& acts = buffers;       // (a lambda names a thread_local of the thread it runs on)
  const PackedWeights& first = *outs[0].w->packed;
  quantize_packed_acts(first.source, x, first.cols, n_tok, acts);
  const Isa level = active_isa();
  const PackedGemmFn gemm = packed_gemm_for(level);
  for (const auto& o : outs)
    check(!o.w->packed->plane_by_value || int(level) <= int(Isa::Avx2),  // packed.h: PlaneLayout
          "weights packed with the AVX2 plane order run at the avx2 level or below, not {}", isa_name(level));
  gemm_job(
      outs.size(), [&](size_t m) { return outs[m].w->packed->n_groups; }, n_tok,
      level == Isa::Amx ? kInt8TileSplit : kFloatSplit,
      [&](size_t m, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
        gemm(*outs[m].w->packed, acts, g0, g1, t0, t1, outs[m].y);
        finish_rows(outs[m], kPackRows, g0, g1, t0, t1);
      });
}

void prepare_weights(WeightMatrix& w) {
  if (!w.empty() && !w.packed && packable(w.type)) w.packed = pack_weights(w);
  if (!w.empty() && !w.packed_float && float_packable(w.type)) w.packed_float = pack_float_weights(w);
}

void prepare_bf16_tiles(WeightMatrix& w) {
  if (!w.empty() && !w.tiles_bf16 && w.type != DType::F32 && has_amx_bf16() && has_avx512_bf16())
    w.tiles_bf16 = pack_bf16_tiles(w);
}

void matmul(const WeightMatrix& w, const float* x, float* y, int64_t n_tok) {
  if (runs_bf16_tiles(w)) {
    const MatmulOut out{&w, y};
    return matmul_bf16_tiles(std::span(&out, 1), x, n_tok);
  }
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
    if (runs_bf16_tiles(w)) {
      while (j < outs.size() && runs_bf16_tiles(*outs[j].w) && outs[j].w->cols == w.cols) ++j;
      matmul_bf16_tiles(outs.subspan(i, j - i), x, n_tok);
      i = j;
      continue;
    }
    if (w.packed)
      while (j < outs.size() && outs[j].w->packed && outs[j].w->cols == w.cols &&
             act_type_for(outs[j].w->type) == act_type_for(w.type))
        ++j;
    if (w.packed) {
      matmul_packed(outs.subspan(i, j - i), x, n_tok);
    } else {
      matmul(w, x, outs[i].y, n_tok);
      parallel_for(n_tok, [&](int64_t t) { finish_rows(outs[i], w.rows, 0, 1, t, t + 1); });
    }
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

// Sums in 16 float lanes (a loop the compiler vectorises; a fixed order), the lanes then added in double;
// the deviations from the mean rounded to float.
void layer_norm(const float* x, const float* w, const float* b, float* out, int64_t n, float eps) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  const auto total = [&] {
    double t = 0;
    for (float& l : lane) t += l, l = 0;
    return t;
  };
  const int64_t body = n - n % kLanes;
  for (int64_t i = 0; i < body; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += x[i + l];
  for (int64_t i = body; i < n; ++i) lane[i - body] += x[i];
  const float m = float(total() / double(n));
  for (int64_t i = 0; i < body; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += (x[i + l] - m) * (x[i + l] - m);
  for (int64_t i = body; i < n; ++i) lane[i - body] += (x[i] - m) * (x[i] - m);
  const float inv = float(1.0 / std::sqrt(total() / double(n) + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - m) * inv * w[i] + b[i];
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
