// The float GEMM's portable parts: repacking F16 / BF16 weights at load, rounding the activations per
// call, the scalar kernel (the arithmetic of gemm_float.h written out element by element: the oracle
// the SIMD levels are compared with bit for bit), and the choice of kernel per level.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "base/error.h"
#include "base/thread_pool.h"
#include "kernels/act_quant.h"
#include "kernels/cpu/gemm_float.h"
#include "kernels/ops.h"
#include "tensor/dequant.h"

namespace serval::cpu {
namespace {

int64_t padded_cols(int64_t cols) { return std::max<int64_t>(1, (cols + kFloatKAlign - 1) / kFloatKAlign) * kFloatKAlign; }

// A BF16 denormal becomes a zero of its sign (VDPBF16PS reads denormal inputs as zeros).
uint16_t bf16_daz(uint16_t h) { return (h & 0x7f80) == 0 ? uint16_t(h & 0x8000) : h; }

float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A result below FLT_MIN in magnitude becomes a zero of its sign (VDPBF16PS's output flush, MXCSR.FTZ).
float ftz(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0f, v) : v; }

}  // namespace

bool float_packable(DType type) { return type == DType::F16 || type == DType::BF16; }

std::shared_ptr<const PackedFloatWeights> pack_float_weights(const WeightMatrix& w) {
  check(float_packable(w.type), "pack_float_weights: {} is not F16 or BF16", dtype_info(w.type).name);
  auto p = std::make_shared<PackedFloatWeights>();
  p->source = w.type;
  p->rows = w.rows;
  p->cols = w.cols;
  p->kpad = padded_cols(w.cols);
  p->n_groups = (w.rows + kFloatRows - 1) / kFloatRows;
  const size_t bytes = std::max<size_t>(p->bytes(), 64);
  p->w = alloc_weights(bytes);  // on huge pages from 2 MiB, as the quantized weights (packed.h)
  check(p->w != nullptr, "pack_float_weights: out of memory ({} bytes)", bytes);
  const bool bf16 = w.type == DType::BF16;
  const int64_t kpad = p->kpad;
  uint16_t* base = p->values();
  parallel_for(p->n_groups, [&](int64_t g) {
    uint16_t* dst = base + g * kpad * kFloatRows;
    std::fill(dst, dst + kpad * kFloatRows, uint16_t(0));
    for (int r = 0; r < kFloatRows && g * kFloatRows + r < w.rows; ++r) {
      const uint8_t* src = w.data + (g * kFloatRows + r) * w.row_stride;
      for (int64_t k = 0; k < w.cols; ++k) {
        uint16_t h;
        std::memcpy(&h, src + 2 * k, 2);  // rows may start anywhere
        if (bf16) dst[(k / 2) * 2 * kFloatRows + r * 2 + (k & 1)] = bf16_daz(h);
        else dst[k * kFloatRows + r] = h;
      }
    }
  });
  return p;
}

std::shared_ptr<const PackedFloatWeights> pack_bf16_tiles(const WeightMatrix& w) {
  auto p = std::make_shared<PackedFloatWeights>();
  p->source = DType::BF16;
  p->rows = w.rows;
  p->cols = w.cols;
  p->kpad = padded_cols(w.cols);
  p->n_groups = (w.rows + kFloatRows - 1) / kFloatRows;
  const size_t bytes = std::max<size_t>(p->bytes(), 64);
  p->w = alloc_weights(bytes);
  check(p->w != nullptr, "pack_bf16_tiles: out of memory ({} bytes)", bytes);
  const int64_t kpad = p->kpad;
  uint16_t* base = p->values();
  parallel_for(p->n_groups, [&](int64_t g) {
    thread_local std::vector<float> row;
    thread_local std::vector<uint16_t> h;
    row.resize(size_t(w.cols));
    h.resize(size_t(w.cols));
    uint16_t* dst = base + g * kpad * kFloatRows;
    std::fill(dst, dst + kpad * kFloatRows, uint16_t(0));
    for (int r = 0; r < kFloatRows && g * kFloatRows + r < w.rows; ++r) {
      dequantize_row(w.type, w.data + (g * kFloatRows + r) * w.row_stride, row.data(), size_t(w.cols));
      quantize_act_row(ActType::BF16, row.data(), w.cols, reinterpret_cast<uint8_t*>(h.data()));
      for (int64_t k = 0; k < w.cols; ++k) dst[(k / 2) * 2 * kFloatRows + r * 2 + (k & 1)] = bf16_daz(h[size_t(k)]);
    }
  });
  return p;
}

void prepare_float_acts(DType weight_type, const float* x, int64_t cols, int64_t n_tok, FloatActs& out) {
  check(float_packable(weight_type), "prepare_float_acts: {} is not F16 or BF16", dtype_info(weight_type).name);
  const bool bf16 = weight_type == DType::BF16;
  out.source = weight_type;
  out.n_tok = n_tok;
  out.cols = cols;
  out.kpad = padded_cols(cols);
  out.x.assign(size_t(n_tok * out.kpad), 0.0f);
  if (bf16) out.pairs.assign(size_t(n_tok * out.kpad / 2), 0u);
  else out.pairs.clear();
  const ActType at = act_type_for(weight_type);
#if defined(SERVAL_X86_KERNELS)
  if (!bf16 && active_isa() >= Isa::Avx2) {
    parallel_for(n_tok, [&](int64_t t) { round_f16_row_avx2(x + t * cols, out.x.data() + t * out.kpad, cols); });
    return;
  }
#endif
  parallel_for(n_tok, [&](int64_t t) {
    thread_local std::vector<uint16_t> h;
    h.assign(size_t(cols) + 1, 0);  // one more: a last odd value's pair partner is zero
    quantize_act_row(at, x + t * cols, cols, reinterpret_cast<uint8_t*>(h.data()));
    float* xr = out.x.data() + t * out.kpad;
    if (!bf16) {
      fp16_to_f32_row(h.data(), xr, size_t(cols));
      return;
    }
    uint32_t* pr = out.pairs.data() + t * (out.kpad / 2);
    for (int64_t k = 0; k < cols; ++k) xr[k] = bf16_value(h[k] = bf16_daz(h[k]));
    for (int64_t s = 0; 2 * s < cols; ++s) pr[s] = uint32_t(h[2 * s]) | uint32_t(h[2 * s + 1]) << 16;
  });
}

void float_gemm_scalar(const PackedFloatWeights& w, const FloatActs& a, int64_t g0, int64_t g1, int64_t t0,
                       int64_t t1, float* y) {
  const bool bf16 = w.source == DType::BF16;
  const int64_t kpad = w.kpad;
  for (int64_t g = g0; g < g1; ++g) {
    const uint16_t* wg = w.group(g);
    const int n_rows = int(std::min<int64_t>(kFloatRows, w.rows - g * kFloatRows));
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = a.row(t);
      for (int r = 0; r < n_rows; ++r) {
        float acc[2] = {0.0f, 0.0f}, out;
        if (!bf16) {
          // Exact products (11-bit by 11-bit significands): a * b + acc rounds once, fused or not.
          for (int64_t k = 0; k < kpad; ++k) acc[k & 1] += fp16_to_f32(wg[k * kFloatRows + r]) * xr[k];
          out = acc[0] + acc[1];
        } else {
          for (int64_t s = 0; s < kpad / 2; ++s) {
            const uint16_t* p = wg + s * 2 * kFloatRows + r * 2;
            float& c = acc[s & 1];
            c = ftz(std::fma(bf16_value(p[1]), xr[2 * s + 1], c));  // the odd value first, as VDPBF16PS
            c = ftz(std::fma(bf16_value(p[0]), xr[2 * s], c));
          }
          out = ftz(acc[0] + acc[1]);
        }
        y[t * w.rows + g * kFloatRows + r] = out;
      }
    }
  }
}

FloatGemmFn float_gemm_for(Isa isa) {
#if defined(SERVAL_X86_KERNELS)
  if (int(isa) >= int(Isa::Avx512)) return has_avx512_bf16() ? float_gemm_avx512_bf16 : float_gemm_avx512;
  if (isa == Isa::Avx2) return float_gemm_avx2;
#endif
  return float_gemm_scalar;
}

}  // namespace serval::cpu
