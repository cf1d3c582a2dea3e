// Integer view of quantized blocks: each block unpacked to its integer values and scales, exactly as
// the GGUF block layouts define them. Dequantization and the integer dot products are built on this.
#pragma once
#include <cstdint>

#include "io/ggml_types.h"

namespace serval {

// A 32-element block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4): value i is d * q[i] + m. MXFP4's q
// are its E2M1 values doubled (0, +-1, +-2, +-3, +-4, +-6, +-8, +-12) and d = 2^(e - 128), half its scale.
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

// The inverse for the values alone: rewrites the codes of a packed block with `q` (as unpack gives
// them: signed for Q4_0 / Q5_0 / Q8_0 / Q3_K / Q6_K, IQ4_NL's level values), keeping its scales. Used
// by GPTQ-style rounding (quant/gptq.h), which picks each value on a grid the scales fix.
void pack_codes32(DType type, uint8_t* block, const int8_t* q);
void pack_codes_k(DType type, uint8_t* block, const int8_t* q);
// The codes a type's blocks can hold: [lo, hi] (for IQ4_NL, its levels -127..113; any value there is
// rounded to the nearest level by pack_codes32).
struct CodeRange {
  int lo, hi;
};
CodeRange code_range(DType type);
// IQ4_NL's sixteen levels, ascending.
const int8_t* iq4nl_levels();
// MXFP4's sixteen codes as values (doubled E2M1: 0 1 2 3 4 6 8 12, then 0 and the negatives).
const int8_t* mxfp4_values();
// 2^(e - 128) for an E8M0 exponent byte, as ggml's ggml_e8m0_to_fp32_half.
float e8m0_half(uint8_t e);

}  // namespace serval
