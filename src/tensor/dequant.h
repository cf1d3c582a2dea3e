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

// FP8 E4M3FN (bias 7, max 448, no infinities, NaN 0x7F / 0xFF) to float (exact), and float to it:
// round to nearest even, saturating to +-448 (infinities included); NaN gives 0x7F or 0xFF.
float fp8_e4m3_to_f32(uint8_t x);
uint8_t f32_to_fp8_e4m3(float f);
// The 256 values of fp8_e4m3_to_f32, by code.
const float* fp8_e4m3_table();

// Dequantizes `n` elements (a multiple of the type's block size) from `src` into `dst`.
void dequantize_row(DType type, const uint8_t* src, float* dst, size_t n);

}  // namespace serval
