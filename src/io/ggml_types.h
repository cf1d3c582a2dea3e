// Tensor element types as GGUF numbers them, with their block geometry.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace serval {

enum class DType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, BF16 = 30,
  MXFP4 = 39,  // OCP microscaling FP4: an E8M0 power-of-two scale and 32 E2M1 values (gpt-oss's experts)
  // Serval's own, never read from or written to a GGUF file: FP8 E4M3FN (the KV cache's fp8_e4m3).
  F8_E4M3 = 1000,
  // Serval's own: raw bytes of a safetensors U8 tensor (gpt-oss's MXFP4 blocks and scales), never computed with.
  U8 = 1001,
};

struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t block_elems;  // elements per block
  size_t block_bytes;  // bytes per block
};

// Geometry of a supported GGUF type, or nullopt for a type number Serval does not support (F8_E4M3,
// Serval's own, is not a GGUF type).
std::optional<DTypeInfo> dtype_info(uint32_t type_id);
// Geometry of a supported type.
const DTypeInfo& dtype_info(DType type);
// Human name of a GGUF type number, including ones Serval does not support ("IQ2_XXS", "type 99").
std::string dtype_name(uint32_t type_id);
// Bytes per element (block bytes / block elements: 34 / 32 for Q8_0).
double bytes_per_elem(DType type);
// Bytes of one row of `n` elements; throws when n is not a multiple of the block size.
size_t row_bytes(DType type, size_t n);

}  // namespace serval
