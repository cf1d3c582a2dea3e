// Scalar reference of the quantized dot products: unpack each block to integers, sum in integers
// inside the block, apply the scales in float. The oracle for the SIMD versions.
#include <vector>

#include "base/error.h"
#include "kernels/act_quant.h"
#include "tensor/blocks.h"
#include "tensor/dequant.h"

namespace serval::ref {
namespace {

double dot_float_types(DType t, const uint8_t* w, const uint8_t* act, int64_t n) {
  std::vector<float> wf(n), xf(n);
  dequantize_row(t, w, wf.data(), n);
  const ActType at = act_type_for(t);
  dequantize_row(at == ActType::F32 ? DType::F32 : at == ActType::F16 ? DType::F16 : DType::BF16, act, xf.data(), n);
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += double(wf[i]) * xf[i];
  return acc;
}

double dot_block32(DType t, const uint8_t* w, const uint8_t* act, int64_t n) {
  const size_t wb = dtype_info(t).block_bytes;
  const bool with_sum = act_type_for(t) == ActType::Q8_1;
  double acc = 0;
  Block32 blk;
  for (int64_t b = 0; b < n / 32; ++b) {
    unpack_block32(t, w + b * wb, blk);
    const int8_t* xq;
    float xd, xs = 0;
    if (with_sum) {
      const auto* x = reinterpret_cast<const BlockQ8_1*>(act) + b;
      xq = x->qs, xd = fp16_to_f32(x->d), xs = fp16_to_f32(x->s);
    } else {
      const auto* x = reinterpret_cast<const BlockQ8_0*>(act) + b;
      xq = x->qs, xd = fp16_to_f32(x->d);
    }
    int32_t sumi = 0;
    for (int j = 0; j < 32; ++j) sumi += int32_t(blk.q[j]) * xq[j];
    acc += double(blk.d * xd) * sumi + double(blk.m * xs);
  }
  return acc;
}

double dot_block_k(DType t, const uint8_t* w, const uint8_t* act, int64_t n) {
  const size_t wb = dtype_info(t).block_bytes;
  double acc = 0;
  BlockK blk;
  for (int64_t b = 0; b < n / 256; ++b) {
    unpack_block_k(t, w + b * wb, blk);
    const auto& x = reinterpret_cast<const BlockQ8_K*>(act)[b];
    int32_t sumi = 0, summ = 0;
    for (int s = 0; s < blk.n_sub; ++s) {
      int32_t dot = 0, xsum = 0;
      for (int l = 0; l < blk.sub_len; ++l) {
        dot += int32_t(blk.q[s * blk.sub_len + l]) * x.qs[s * blk.sub_len + l];
        xsum += x.qs[s * blk.sub_len + l];
      }
      sumi += blk.scale[s] * dot;
      summ += blk.min[s] * xsum;
    }
    acc += double(x.d * blk.d) * sumi - double(x.d * blk.dmin) * summ;
  }
  return acc;
}

}  // namespace

float vec_dot(DType t, const uint8_t* w, const uint8_t* act, int64_t n) {
  switch (act_type_for(t)) {
    case ActType::F32: case ActType::F16: case ActType::BF16: return float(dot_float_types(t, w, act, n));
    case ActType::Q8_0: case ActType::Q8_1: return float(dot_block32(t, w, act, n));
    case ActType::Q8_K: return float(dot_block_k(t, w, act, n));
  }
  return 0;
}

}  // namespace serval::ref
