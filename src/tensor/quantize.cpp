#include "tensor/quantize.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "base/error.h"
#include "io/tensor_ref.h"
#include "tensor/blocks.h"
#include "tensor/dequant.h"
#include "tensor/quantize_k.h"

namespace serval {

bool quantizable_tensor(const TensorRef& t) {
  static const char* const kKept[] = {"_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight", "time_mix_first.weight",
                                      "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_decay_w1.weight",
                                      "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight"};
  if (!t.name.ends_with("weight") || t.ne.size() < 2) return false;
  if (t.name == "position_embd.weight" || t.name == "token_types.weight") return false;
  return std::none_of(std::begin(kKept), std::end(kKept), [&](const char* k) { return t.name.find(k) != std::string::npos; });
}

namespace {

constexpr size_t kQk = 32;  // elements per block of the 32-element types

void put_fp16(uint8_t* out, float v) {
  const uint16_t h = f32_to_fp16(v);
  std::memcpy(out, &h, 2);
}

// The value of largest magnitude (the first of equal magnitudes), signed.
float signed_absmax(const float* x) {
  float amax = 0, max = 0;
  for (size_t j = 0; j < kQk; ++j)
    if (amax < std::fabs(x[j])) amax = std::fabs(x[j]), max = x[j];
  return max;
}

void min_max(const float* x, float& lo, float& hi) {
  lo = FLT_MAX, hi = -FLT_MAX;
  for (size_t j = 0; j < kQk; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
}

// Q8_0: d = absmax / 127 (F16), q = round(x / d).
void block_q8_0(const float* x, uint8_t* out) {
  float amax = 0;
  for (size_t j = 0; j < kQk; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
  put_fp16(out, d);
  for (size_t j = 0; j < kQk; ++j) out[2 + j] = uint8_t(int8_t(std::round(x[j] * id)));
}

// Q4_0 / Q5_0 (bits 4 or 5): d = the signed absmax / -2^(bits-1), q = trunc(x / d + 2^(bits-1) + 0.5)
// capped at 2^bits - 1; low nibbles of the first half, high nibbles of the second, Q5_0's fifth bits
// in a 32-bit mask after d.
void block_sym(const float* x, uint8_t* out, int bits) {
  const float half = float(1 << (bits - 1));
  const float d = signed_absmax(x) / -half, id = d != 0 ? 1.0f / d : 0.0f;
  const int top = (1 << bits) - 1;
  put_fp16(out, d);
  uint8_t* qs = out + (bits == 5 ? 6 : 2);
  uint32_t qh = 0;
  for (size_t j = 0; j < kQk / 2; ++j) {
    const float x0 = x[j] * id, x1 = x[kQk / 2 + j] * id;
    const uint8_t q0 = uint8_t(std::min(top, int(int8_t(x0 + (half + 0.5f)))));
    const uint8_t q1 = uint8_t(std::min(top, int(int8_t(x1 + (half + 0.5f)))));
    qs[j] = uint8_t((q0 & 0x0f) | (q1 & 0x0f) << 4);
    qh |= uint32_t(q0 >> 4 & 1) << j | uint32_t(q1 >> 4 & 1) << (j + kQk / 2);
  }
  if (bits == 5) std::memcpy(out + 2, &qh, 4);
}

// Q4_1 / Q5_1: d = (max - min) / (2^bits - 1) and m = min (both F16), q = trunc((x - min) / d + 0.5)
// (Q4_1 caps it at 15).
void block_affine(const float* x, uint8_t* out, int bits) {
  float lo, hi;
  min_max(x, lo, hi);
  const float d = (hi - lo) / float((1 << bits) - 1), id = d != 0 ? 1.0f / d : 0.0f;
  put_fp16(out, d);
  put_fp16(out + 2, lo);
  uint8_t* qs = out + (bits == 5 ? 8 : 4);
  uint32_t qh = 0;
  for (size_t j = 0; j < kQk / 2; ++j) {
    // Q4_1 caps at 15 (as ggml; values are in [0, 15.5] here, so the cap only meets rounding at the top).
    uint8_t q0 = uint8_t((x[j] - lo) * id + 0.5f), q1 = uint8_t((x[kQk / 2 + j] - lo) * id + 0.5f);
    if (bits == 4) q0 = std::min<uint8_t>(15, q0), q1 = std::min<uint8_t>(15, q1);
    qs[j] = uint8_t((q0 & 0x0f) | (q1 & 0x0f) << 4);
    qh |= uint32_t(q0 >> 4 & 1) << j | uint32_t(q1 >> 4 & 1) << (j + kQk / 2);
  }
  if (bits == 5) std::memcpy(out + 4, &qh, 4);
}

}  // namespace

namespace {
// ggml's quantize_row_mxfp4_ref: the exponent floor(log2(amax)) - 2 (so amax / d lies in [4, 8) of the
// doubled values' 12), each value the nearest of the sixteen (the lower code on a tie). An amax below
// 2^-125 takes the smallest exponent (0).
void block_mxfp4(const float* x, uint8_t* out) {
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(x[i]));
  const int e = amax > 0 ? int(std::floor(std::log2(amax))) - 2 + 127 : 0;
  out[0] = uint8_t(std::clamp(e, 0, 255));
  const float d = e8m0_half(out[0]);
  const int8_t* kv = mxfp4_values();
  auto best = [&](float v) {
    int b = 0;
    float err = std::abs(float(kv[0]) * d - v);
    for (int k = 1; k < 16; ++k)
      if (const float e2 = std::abs(float(kv[k]) * d - v); e2 < err) b = k, err = e2;
    return b;
  };
  for (int j = 0; j < 16; ++j) out[1 + j] = uint8_t(best(x[j]) | (best(x[j + 16]) << 4));
}

}  // namespace

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t(u >> 16 | 64);  // NaN: keep it, quiet
  return uint16_t((u + (0x7fff + (u >> 16 & 1))) >> 16);
}

bool can_quantize_to(DType type) {
  switch (type) {
    case DType::F32: case DType::F16: case DType::BF16: case DType::Q8_0:
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q2_K:
    case DType::Q3_K: case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: case DType::IQ4_NL: case DType::MXFP4:
      return true;
    default:
      return false;
  }
}

void quantize_row(DType type, const float* x, uint8_t* out, size_t n, const float* importance) {
  check(can_quantize_to(type), "cannot quantize to {}", dtype_info(type).name);
  const size_t bytes = dtype_info(type).block_bytes;
  check(n % dtype_info(type).block_elems == 0, "{} elements are not whole {} blocks", n, dtype_info(type).name);
  switch (type) {
    case DType::F32: std::memcpy(out, x, n * 4); return;
    case DType::F16: f32_to_fp16_row(x, reinterpret_cast<uint16_t*>(out), n); return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t b = f32_to_bf16(x[i]);
        std::memcpy(out + 2 * i, &b, 2);
      }
      return;
    case DType::Q4_0: case DType::Q5_0: case DType::Q4_1: case DType::Q5_1:
      if (!importance) break;
      return kquant::legacy_row(x, out, n, importance, type == DType::Q4_0 || type == DType::Q4_1 ? 4 : 5,
                                type == DType::Q4_1 || type == DType::Q5_1);
    default: break;
  }
  using BlockFn = void (*)(const float*, uint8_t*, const float*);
  BlockFn fn = nullptr;
  switch (type) {
    case DType::Q8_0: fn = [](const float* x, uint8_t* o, const float*) { block_q8_0(x, o); }; break;
    case DType::Q4_0: fn = [](const float* x, uint8_t* o, const float*) { block_sym(x, o, 4); }; break;
    case DType::Q5_0: fn = [](const float* x, uint8_t* o, const float*) { block_sym(x, o, 5); }; break;
    case DType::Q4_1: fn = [](const float* x, uint8_t* o, const float*) { block_affine(x, o, 4); }; break;
    case DType::Q5_1: fn = [](const float* x, uint8_t* o, const float*) { block_affine(x, o, 5); }; break;
    case DType::IQ4_NL: fn = kquant::iq4_nl; break;
    case DType::MXFP4: fn = [](const float* x, uint8_t* o, const float*) { block_mxfp4(x, o); }; break;
    case DType::Q2_K: fn = kquant::q2_k; break;
    case DType::Q3_K: fn = kquant::q3_k; break;
    case DType::Q4_K: fn = kquant::q4_k; break;
    case DType::Q5_K: fn = kquant::q5_k; break;
    case DType::Q6_K: fn = kquant::q6_k; break;
    default: fail("internal: no quantizer for {}", dtype_info(type).name);
  }
  const size_t elems = dtype_info(type).block_elems;
  for (size_t b = 0; b < n / elems; ++b) fn(x + b * elems, out + b * bytes, importance ? importance + b * elems : nullptr);
}

}  // namespace serval
