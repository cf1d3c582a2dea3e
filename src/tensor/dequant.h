// Dequantization of every supported tensor type to float, exactly per the GGUF block definitions.
#pragma once
#include <cstddef>
#include <cstdint>

#include "io/ggml_types.h"

namespace serval {

// IEEE half and bfloat16 to float (exact).
float fp16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t h);
// Float to IEEE half, round to nearest even.
uint16_t f32_to_fp16(float f);

// Dequantizes `n` elements (a multiple of the type's block size) from `src` into `dst`.
void dequantize_row(DType type, const uint8_t* src, float* dst, size_t n);

}  // namespace serval
