// Float rows to GGUF tensor types, as llama.cpp's reference quantizers write them (the bytes of
// `llama-quantize` without an importance matrix): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// IQ4_NL and the k-quants Q2_K .. Q6_K (tensor/quantize_k.h).
#pragma once
#include <cstddef>
#include <cstdint>

#include "io/ggml_types.h"

namespace serval {
struct TensorRef;

// Whether llama-quantize's rules quantize tensor `t` at all: a weight of two or more dimensions, but
// not a norm, an MoE router, a position or token-type embedding, or one of the recurrent models'
// small mixing tensors. `serval quantize` and the loader's requantization (LoadOptions::requant) ask this.
bool quantizable_tensor(const TensorRef& t);

// Whether quantize_row can write `type`.
bool can_quantize_to(DType type);
// Writes `n` elements of `x` (a multiple of the type's block size) as `type` into `out`
// (row_bytes(type, n) bytes); throws Error for a type can_quantize_to refuses. `importance` (n values,
// or null): each column's mean square activation from an imatrix, for llama.cpp's weighted searches
// (k-quants, IQ4_NL, Q4_0..Q5_1; F16/BF16/Q8_0 ignore it).
void quantize_row(DType type, const float* x, uint8_t* out, size_t n, const float* importance = nullptr);
// Float to bfloat16, round to nearest even; NaN stays a (quiet) NaN.
uint16_t f32_to_bf16(float f);

}  // namespace serval
