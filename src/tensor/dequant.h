// Dequantization of every supported tensor type to float, exactly per the GGUF block definitions.
#pragma once
#include <cstddef>
#include <cstdint>

#include "io/ggml_types.h"

namespace serval {

// IEEE half and bfloat16 to float (exact). Uses the CPU's F16C instructions where the build has
// them; the portable versions give identical results (tested exhaustively against F16C).
float fp16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t h);
// Float to IEEE half, round to nearest even.
uint16_t f32_to_fp16(float f);
float fp16_to_f32_portable(uint16_t h);
uint16_t f32_to_fp16_portable(float f);
// Row conversions (vectorized with F16C where available).
void fp16_to_f32_row(const uint16_t* src, float* dst, size_t n);
void f32_to_fp16_row(const float* src, uint16_t* dst, size_t n);

// Dequantizes `n` elements (a multiple of the type's block size) from `src` into `dst`.
void dequantize_row(DType type, const uint8_t* src, float* dst, size_t n);

}  // namespace serval
