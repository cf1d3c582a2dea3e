// The register-tiled GEMM for F16 and BF16 weight matrices (docs/kernels.md, "The float GEMM").
//
// Layout. At load a matrix is repacked into groups of kFloatRows = 16 rows, K padded with zeros to a
// multiple of kFloatKAlign = 32 (kpad). A group is kpad * 16 half-words:
//   F16:  [k][16 rows]             one 32-byte vector per k: VCVTPH2PS gives the 16 rows' floats;
//   BF16: [k/2][16 rows][2]        one 64-byte vector per pair of k: row r's dword holds its values
//                                  2s (low half) and 2s+1 (high half), the order VDPBF16PS reads.
// Rows past `rows` in the last group are zero. BF16 denormals are stored as (signed) zeros, as
// VDPBF16PS treats them anyway.
//
// Activations are rounded once per call to the weight type's activation format (act_quant.h: F16 for
// F16 weights, BF16 for BF16), kept as floats [token][kpad] with zeros past `cols`, plus for BF16 the
// half-word pairs [token][kpad/2] that VDPBF16PS broadcasts. BF16 denormals are flushed as above.
//
// Arithmetic, per (row, token), the same at every level, so all levels agree bitwise and a token's
// result never depends on the other tokens of the call, the tile it falls in, or the thread count:
//   F16:  two chains; chain c sums the steps k with k % 2 == c in order:  acc[c] = acc[c] + w[k] * x[k]
//         (the product of two F16 values is exact in float, so FMA and multiply-add agree, and no
//         partial sum is ever a denormal); y = acc[0] + acc[1].
//   BF16: two chains over the pairs s (chain s % 2), each pair as one lane of VDPBF16PS does it:
//           acc[c] = ftz(fma(w[2s+1], x[2s+1], acc[c]));  acc[c] = ftz(fma(w[2s], x[2s], acc[c]))
//         (round to nearest even, a result below FLT_MIN in magnitude flushed to a signed zero);
//         y = ftz(acc[0] + acc[1]).
// The levels without VDPBF16PS run the same steps as FMAs with MXCSR.FTZ set; the scalar level with
// std::fma and an explicit flush.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "io/ggml_types.h"
#include "kernels/cpu/packed.h"
#include "kernels/isa.h"

namespace serval {
struct WeightMatrix;

namespace cpu {

constexpr int kFloatRows = 16;
constexpr int kFloatKAlign = 32;

struct PackedFloatWeights {
  DType source = DType::F16;  // F16 or BF16
  int64_t rows = 0, cols = 0, kpad = 0, n_groups = 0;
  std::unique_ptr<uint8_t[], WeightsDeleter> w;  // [group][kpad * 16] 16-bit values, from alloc_weights

  uint16_t* values() const { return reinterpret_cast<uint16_t*>(w.get()); }
  const uint16_t* group(int64_t g) const { return values() + g * kpad * kFloatRows; }
  size_t bytes() const { return size_t(n_groups * kpad * kFloatRows) * 2; }
};

// Whether `type` goes through the float GEMM (F16, BF16).
bool float_packable(DType type);
// Repacks an F16 or BF16 matrix (rows need not be a multiple of 16, nor cols of 32, nor the row
// stride of anything). Runs on the compute pool.
std::shared_ptr<const PackedFloatWeights> pack_float_weights(const WeightMatrix& w);

struct FloatActs {
  DType source = DType::F16;
  int64_t n_tok = 0, cols = 0, kpad = 0;
  std::vector<float> x;          // [n_tok][kpad]: the rounded values, zeros past cols
  std::vector<uint32_t> pairs;   // BF16 only: [n_tok][kpad / 2], bf16 values 2s | 2s+1 << 16 (for the BF16
                                 // tiles [n_tok rounded up to 16][kpad / 2], the rows past n_tok zero)

  const float* row(int64_t t) const { return x.data() + t * kpad; }
  const uint32_t* pair_row(int64_t t) const { return pairs.data() + t * (kpad / 2); }
};
// Rounds n_tok rows of `cols` activations for weights of `weight_type` (F16 or BF16) on the pool.
// F16: at the AVX2 level and above by VCVTPS2PH / VCVTPH2PS (round_f16_row_avx2), the same bits as
// the scalar f32_to_fp16 then fp16_to_f32 (NaNs made the quiet NaN of their sign, as it does).
void prepare_float_acts(DType weight_type, const float* x, int64_t cols, int64_t n_tok, FloatActs& out);
void round_f16_row_avx2(const float* x, float* out, int64_t n);

// y[t * w.rows + r] for groups [g0, g1) and tokens [t0, t1), with the arithmetic above. A function
// may only be called when the CPU runs its level (and, for the _bf16 one, has_avx512_bf16()).
using FloatGemmFn = void (*)(const PackedFloatWeights& w, const FloatActs& x, int64_t g0, int64_t g1, int64_t t0,
                             int64_t t1, float* y);
void float_gemm_scalar(const PackedFloatWeights& w, const FloatActs& x, int64_t g0, int64_t g1, int64_t t0,
                       int64_t t1, float* y);
void float_gemm_avx2(const PackedFloatWeights& w, const FloatActs& x, int64_t g0, int64_t g1, int64_t t0,
                     int64_t t1, float* y);
// BF16 by FMAs (as avx2): for AVX-512 CPUs without AVX512_BF16.
void float_gemm_avx512(const PackedFloatWeights& w, const FloatActs& x, int64_t g0, int64_t g1, int64_t t0,
                       int64_t t1, float* y);
// BF16 by VDPBF16PS; F16 as float_gemm_avx512.
void float_gemm_avx512_bf16(const PackedFloatWeights& w, const FloatActs& x, int64_t g0, int64_t g1, int64_t t0,
                            int64_t t1, float* y);

// BF16 matrix tiles (AMX-BF16; cpu::prepare_bf16_tiles in ops.h). A matrix of any type is rounded once
// to BF16 (round to nearest even, denormals to signed zeros) in the BF16 layout above, whose 32-deep K
// blocks (16 pairs x 16 rows x 2) are the B operand of TDPBF16PS as they lie; the activations are
// prepare_float_acts' BF16 pairs, whose rows of 16 pairs are the A operand. Each (row, token) sums its
// products over the whole K in the tile unit's float accumulator (its own order and rounding: not the
// arithmetic above, and tested against a double-precision sum of the same BF16 values within a bound),
// the same for every token count, tile and thread count. The activations are rounded by
// bf16_tile_row_amx (VCVTNEPS2BF16: to nearest even, denormal inputs read as zeros, as the tiles read
// them) into FloatActs::pairs alone.
std::shared_ptr<const PackedFloatWeights> pack_bf16_tiles(const WeightMatrix& w);
// One token's cols floats as kpad BF16 values (zeros past cols; kpad a multiple of 32). Amx level only.
void bf16_tile_row_amx(const float* x, int64_t cols, int64_t kpad, uint32_t* pairs);
// Callable only when has_amx_bf16() and the level is Amx; x.pairs has rows up to a multiple of 16.
void bf16_tile_gemm_amx(const PackedFloatWeights& w, const FloatActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                        float* y);

// The kernel matmul uses at `isa` (the _bf16 one at Avx512 and above when the CPU has AVX512_BF16).
FloatGemmFn float_gemm_for(Isa isa);

}  // namespace cpu
}  // namespace serval
