// Activation formats for quantized matrix products, as llama.cpp pairs them with weight types:
// the activation row is quantized once per token, then dotted with each weight row in integers.
//   F32 weights -> F32, F16 -> F16, BF16 -> BF16, Q4_0/Q5_0/Q8_0 -> Q8_0, Q4_1/Q5_1 -> Q8_1,
//   k-quants -> Q8_K.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "io/ggml_types.h"

namespace serval {

enum class ActType { F32, F16, BF16, Q8_0, Q8_1, Q8_K };

struct BlockQ8_0 {
  uint16_t d;  // f16 scale
  int8_t qs[32];
};
struct BlockQ8_1 {
  uint16_t d;  // f16 scale
  uint16_t s;  // f16 of d * sum(qs)
  int8_t qs[32];
};
struct BlockQ8_K {
  float d;  // scale (negative: the largest-magnitude value maps to -127)
  int8_t qs[256];
  int16_t bsums[16];  // sums of qs over each 16 values
};

// The activation format a weight type is multiplied with.
ActType act_type_for(DType weight_type);
// Bytes of `n` activation values in `type`.
size_t act_row_bytes(ActType type, int64_t n);
// Quantizes `n` floats into `out` (act_row_bytes(type, n) bytes): round-half-even, scales as
// llama.cpp's x86 code computes them.
void quantize_act_row(ActType type, const float* x, int64_t n, uint8_t* out);

namespace ref {
// Dot product of one weight row (`n` elements of `w_type`) with one quantized activation row, with
// integer sums inside each block and the block's scales applied in float (llama.cpp's semantics).
float vec_dot(DType w_type, const uint8_t* w, const uint8_t* act, int64_t n);
}  // namespace ref

namespace cpu {
// Same contract as ref::vec_dot; AVX-512 VNNI for Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K.
float vec_dot(DType w_type, const uint8_t* w, const uint8_t* act, int64_t n);
// The weight row dotted with `n_rows` (at most kMaxDotRows) activation rows, unpacking each weight
// block once; out[r] is bitwise what vec_dot(w, acts[r]) gives.
constexpr int kMaxDotRows = 4;
void vec_dot_rows(DType w_type, const uint8_t* w, const uint8_t* const* acts, int n_rows, int64_t n, float* out);
}  // namespace cpu

}  // namespace serval
