// Integer view of quantized blocks: each block unpacked to its integer values and scales, exactly as
// the GGUF block layouts define them. Dequantization and the integer dot products are built on this.
#pragma once
#include <cstdint>

#include "io/ggml_types.h"

namespace serval {

// A 32-element block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): value i is d * q[i] + m.
struct Block32 {
  int8_t q[32];  // signed for Q4_0 / Q5_0 / Q8_0 (offset removed) and IQ4_NL (its level), unsigned 0..31 for Q4_1 / Q5_1
  float d;
  float m;  // 0 for the types without a minimum
};

// A 256-element k-quant super-block: value i of sub-block s is d * scale[s] * q[i] - dmin * min[s].
struct BlockK {
  int8_t q[256];
  int n_sub;    // 16 sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 8 of 32 (Q4_K, Q5_K)
  int sub_len;  // 16 or 32
  int16_t scale[16];
  int16_t min[16];  // all 0 for Q3_K and Q6_K
  float d;
  float dmin;
};

// True for the 256-element k-quant types.
bool is_kquant(DType type);
void unpack_block32(DType type, const uint8_t* block, Block32& out);
void unpack_block_k(DType type, const uint8_t* block, BlockK& out);

}  // namespace serval
