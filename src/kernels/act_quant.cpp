#include "kernels/act_quant.h"

#include <cmath>
#include <cstring>

#include "base/error.h"
#include "kernels/ops.h"
#include "tensor/dequant.h"

namespace serval {
namespace {

// Round half to even, as the x86 rounding instructions and llama.cpp's nearest_int do.
int round_even(float x) { return static_cast<int>(std::nearbyint(x)); }

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 64);  // quiet NaN
  return uint16_t((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

// One block of 32: scale amax / 127, values rounded half to even; returns the scale and the sum.
float quantize_block32(const float* x, int8_t* qs, int* sum) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(x[j]));
  const float id = amax != 0.0f ? 127.f / amax : 0.0f;
  *sum = 0;
  for (int j = 0; j < 32; ++j) *sum += (qs[j] = int8_t(round_even(x[j] * id)));
  return amax / 127.f;
}

void quantize_q8_0(const float* x, int64_t n, BlockQ8_0* y) {
  int sum;
  for (int64_t b = 0; b < n / 32; ++b) y[b].d = f32_to_fp16(quantize_block32(x + b * 32, y[b].qs, &sum));
}

void quantize_q8_1(const float* x, int64_t n, BlockQ8_1* y) {
  for (int64_t b = 0; b < n / 32; ++b) {
    int sum;
    const float d = quantize_block32(x + b * 32, y[b].qs, &sum);
    y[b].d = f32_to_fp16(d);
    y[b].s = f32_to_fp16(d * float(sum));
  }
}

void quantize_q8_k(const float* x, int64_t n, BlockQ8_K* y) {
  for (int64_t b = 0; b < n / 256; ++b, x += 256) {
    float max = 0, amax = 0;
    for (int j = 0; j < 256; ++j)
      if (std::abs(x[j]) > amax) amax = std::abs(x[j]), max = x[j];
    if (amax == 0) {
      std::memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < 256; ++j) y[b].qs[j] = int8_t(std::min(127, round_even(iscale * x[j])));
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += y[b].qs[g * 16 + j];
      y[b].bsums[g] = int16_t(sum);
    }
    y[b].d = 1 / iscale;
  }
}

}  // namespace

ActType act_type_for(DType t) {
  switch (t) {
    case DType::F32: return ActType::F32;
    case DType::F16: return ActType::F16;
    case DType::BF16: return ActType::BF16;
    case DType::Q4_0: case DType::Q5_0: case DType::Q8_0: case DType::IQ4_NL: case DType::MXFP4: return ActType::Q8_0;
    case DType::Q4_1: case DType::Q5_1: return ActType::Q8_1;
    default: return ActType::Q8_K;
  }
}

size_t act_row_bytes(ActType t, int64_t n) {
  switch (t) {
    case ActType::F32: return n * 4;
    case ActType::F16: case ActType::BF16: return n * 2;
    case ActType::Q8_0: return n / 32 * sizeof(BlockQ8_0);
    case ActType::Q8_1: return n / 32 * sizeof(BlockQ8_1);
    case ActType::Q8_K: return n / 256 * sizeof(BlockQ8_K);
  }
  return 0;
}

void quantize_act_row(ActType t, const float* x, int64_t n, uint8_t* out) {
  switch (t) {
    case ActType::F32: std::memcpy(out, x, n * 4); return;
    case ActType::F16: {
      auto* h = reinterpret_cast<uint16_t*>(out);
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_fp16(x[i]);
      return;
    }
    case ActType::BF16: {
      auto* h = reinterpret_cast<uint16_t*>(out);
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(x[i]);
      return;
    }
    case ActType::Q8_0: quantize_q8_0(x, n, reinterpret_cast<BlockQ8_0*>(out)); return;
    case ActType::Q8_1: quantize_q8_1(x, n, reinterpret_cast<BlockQ8_1*>(out)); return;
    case ActType::Q8_K: quantize_q8_k(x, n, reinterpret_cast<BlockQ8_K*>(out)); return;
  }
}

}  // namespace serval
