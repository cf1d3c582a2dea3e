// Weights repacked once at load for the quantized GEMM, and activations quantized once per call.
//
// Rows are interleaved in groups of kPackRows = 16 and K is cut into blocks of 32. For one group and
// one block, the 16 x 32 integer weights are stored as 8 vectors of 64 bytes; vector k4 holds, for
// each row r, its 4 values 4*k4 .. 4*k4+3 at bytes 4r .. 4r+3: one VPDPBUSD with a broadcast of 4
// activation bytes adds 4 products to each of the 16 rows' sums. Types of up to 4 bits keep two values
// per byte (256 bytes per group and block: vector j carries k4 = j in its low nibbles, k4 = j + 4 in
// its high nibbles). 5-bit types add a bit plane after the nibbles, 64 bytes in one of two orders
// (PlaneLayout below; 320 bytes per group and block), and 6-bit types two (bit 4, then bit 5; 384
// bytes). 8-bit types keep one value per byte (512 bytes). Every value is unsigned (u); the type's
// meaning is restored by an offset, integer sub-scales and mins.
//
// Blocks form super-blocks of `sb` blocks (1, or 8 for the k-quants, whose GGUF blocks hold 256
// values) with one float scale (and float min scale) per (row, super-block; MXFP4 keeps its E8M0 byte
// instead, scale_e8m0 below). Inside a super-block the
// k-quants have small integer sub-scales and mins, per block or, for `split` types, per 16-value half
// h. Per (row, token, block b, half h) the integer sum S = sum(u * x) is exact, and for each
// super-block the arithmetic is fixed:
//   I = sum over b, h of sub(b,h) * (S(b,h) - offset * sum_h(x))      (sub = 1 without sub-scales)
//   M = sum over b, h of min(b,h) * sum_h(x)                          (with mins; min = 1 for Q4_1/Q5_1)
//   acc = fma(scale * xd, float(I), acc)                              then, with mins:
//   acc = fma(neg_min * xd, float(M), acc)
// in super-block order, acc starting at 0 (xd is the activation scale of the super-block; I and M
// cannot overflow int32 for the packed types). Integer sums are exact in any order, and every ISA
// level and the scalar code do exactly these float operations, so they agree bitwise, and a token's
// result never depends on the other tokens of the call.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>
#include <xmmintrin.h>  // _mm_prefetch: SSE, every x86-64
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "base/huge_pages.h"

#include "io/ggml_types.h"

namespace serval {
struct WeightMatrix;

namespace cpu {

constexpr int kPackRows = 16;
constexpr int kPackBlock = 32;
// Calls with fewer tokens than this run the AVX-512 kernel at the AMX level (tiles do not pay): with
// weights prefetched and one-block types in tiles of up to 10 tokens, AVX-512 VNNI is ahead up to 24
// tokens and level at 28-32 on the Qwen 0.5B and 1.5B (docs/kernels.md).
constexpr int64_t kAmxMinTokens = 28;

// Weights every forward pass streams through live on huge pages (base/huge_pages.h).
using WeightsDeleter = HugeDeleter;
inline HugeBuffer alloc_weights(size_t bytes) { return alloc_huge(bytes); }
using serval::kHugePage;

// The order of a block's 64 bytes of fifth bits (5-bit types; 6-bit types have a second plane of sixth
// bits in the same order). Both hold, for each step k4 and each byte j of vector k4, that value's bit:
//  - StepMasks: 8 64-bit masks, bit j of mask k4. AVX-512 and AMX load a mask into a mask register
//    and add 16 (32 for the sixth bits) under it: one operation per vector and plane.
//  - ValueBytes: 64 bytes, bit k4 of byte j. AVX2 has no mask registers; it loads a half's 32 bytes
//    once per block and takes step k4's bits with a shift and an AND (2 operations per vector, against
//    5 to spread a mask's bits into bytes).
// ForThisCpu: ValueBytes on a CPU without AVX-512 (whose kernels cannot run there), StepMasks
// otherwise. The scalar and AVX2 levels read both; AVX-512 and AMX read StepMasks only.
enum class PlaneLayout { ForThisCpu, StepMasks, ValueBytes };

// MXFP4 (gpt-oss's experts) keeps its 4-bit codes as nibbles, and the kernels look each code's
// unsigned value up here with one byte shuffle per vector: MXFP4's values (doubled E2M1, -12..12,
// tensor/blocks.h) plus the offset 12. Its kPlanes in with_layout is kFp4Codes (no planes).
inline constexpr uint8_t kFp4Table[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
constexpr int kFp4Codes = -1;

struct PackedWeights {
  DType source = DType::F32;  // the GGUF type the values came from
  bool nibbles = false;       // two values of up to 4 bits per byte; otherwise one byte per value
  int planes = 0;             // with nibbles: bit planes above them (1: a fifth bit per value, 2: a sixth too)
  bool fp4_codes = false;     // with nibbles: each is an MXFP4 code, whose value kFp4Table gives
  bool plane_by_value = false;  // the plane is in PlaneLayout::ValueBytes order (else StepMasks)
  bool has_sub = false;       // integer sub-scales inside a super-block (k-quants)
  bool split = false;         // sub-scales and mins per 16-value half rather than per block
  bool mins = false;          // a float min scale per (row, super-block) and integer mins
  int offset = 0;             // subtracted from every value (in integers)
  int sb = 1;                 // blocks per super-block
  int64_t rows = 0, cols = 0, n_groups = 0, n_blocks = 0, n_super = 0;
  std::unique_ptr<uint8_t[], WeightsDeleter> q;  // [group][block][block_bytes()], 64-byte aligned
  std::vector<float> scale;                   // [group][super][16]; empty for MXFP4, which has:
  std::vector<uint8_t> scale_e8m0;            // [group][block][16] E8M0 bytes, each the scale 2^(e - 128)
  std::vector<float> neg_min;                 // [group][super][16] when mins
  std::vector<int8_t> sub;                    // [group][block][halves()][16] when has_sub
  std::vector<int8_t> min;                    // [group][block][halves()][16] when mins

  int halves() const { return split ? 2 : 1; }
  size_t block_bytes() const { return nibbles ? 256 + 64 * size_t(planes) : 512; }
  const uint8_t* block(int64_t g, int64_t b) const { return q.get() + (g * n_blocks + b) * block_bytes(); }
  // Offsets of a (group, block)'s 16 x halves() sub-scales or mins, and of a (group, super)'s floats.
  size_t int_index(int64_t g, int64_t b) const { return size_t(g * n_blocks + b) * kPackRows * halves(); }
  size_t super_index(int64_t g, int64_t s) const { return size_t(g * n_super + s) * kPackRows; }
  size_t bytes() const;
};

// Whether `type` has a packed layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).
bool packable(DType type);
// Repacks a matrix of a packable type; rows need not be a multiple of 16 (the last group is padded
// with zero scales). Runs on the compute pool. `plane` is for tests, which pack both orders.
std::shared_ptr<const PackedWeights> pack_weights(const WeightMatrix& w, PlaneLayout plane = PlaneLayout::ForThisCpu);

// Activations of n_tok rows, quantized as the weight type is multiplied with (act_quant.h: Q8_0 for
// the 32-blocks types (Q8_1 has the same values), Q8_K for k-quants), in the layout the packed kernels
// read.
struct PackedActs {
  int64_t n_tok = 0, cols = 0, n_blocks = 0;
  std::vector<int8_t> qs;      // [n_tok rounded up to 16][cols]: rows past n_tok are zero (AMX tiles)
  std::vector<float> d;        // [n_tok][n_blocks]
  std::vector<int32_t> sums;   // [n_tok][n_blocks][2]: sums of the two 16-value halves of each block
  std::vector<int32_t> pairs;  // [n_tok][n_blocks]: the two sums as int16 (low half first), for VPDPWSSD
  // At the AMX level (and at least kAmxMinTokens tokens): qs again as [tile of 16 tokens][block][16][32],
  // so that a tile's A operand is 512 contiguous bytes. Empty otherwise.
  std::vector<int8_t> tiled;

  const int8_t* row(int64_t t) const { return qs.data() + t * cols; }
};
// Quantizes at the active ISA level; every level gives the bytes of quantize_act_row (act_quant.h).
void quantize_packed_acts(DType weight_type, const float* x, int64_t cols, int64_t n_tok, PackedActs& out);
// One row at the AVX-512 level: Q8_0 (`k_quant` false) or Q8_K scales; qs [cols], d [cols / 32],
// sums [cols / 16].
void quantize_act_row_avx512(bool k_quant, const float* x, int64_t cols, int8_t* qs, float* d, int32_t* sums);
// The same at the AVX2 level.
void quantize_act_row_avx2(bool k_quant, const float* x, int64_t cols, int8_t* qs, float* d, int32_t* sums);

// Calls f.template operator()<kNib, kPlanes, kSub, kMins>() with the compile-time layout of a packed
// type (the table in packed.cpp; kPlanes: bit planes above the nibbles, or kFp4Codes; kSub: 0 no
// sub-scales, 1 one per block, 2 one per half), so each SIMD
// level instantiates its kernel once per layout from one list. Types pack_weights does not pack abort.
template <class F>
void with_layout(DType t, F&& f) {
  switch (t) {
    case DType::Q4_0: return f.template operator()<true, 0, 0, false>();
    case DType::Q4_1: return f.template operator()<true, 0, 0, true>();
    case DType::Q5_0: return f.template operator()<true, 1, 0, false>();
    case DType::MXFP4: return f.template operator()<true, kFp4Codes, 0, false>();
    case DType::Q5_1: return f.template operator()<true, 1, 0, true>();
    case DType::Q8_0: case DType::IQ4_NL: return f.template operator()<false, 0, 0, false>();
    case DType::Q2_K: return f.template operator()<true, 0, 2, true>();
    case DType::Q3_K: return f.template operator()<true, 0, 2, false>();
    case DType::Q4_K: return f.template operator()<true, 0, 1, true>();
    case DType::Q5_K: return f.template operator()<true, 1, 1, true>();
    case DType::Q6_K: return f.template operator()<true, 2, 2, false>();
    default: std::abort();
  }
}

// MXFP4's scales stay the file's E8M0 bytes (1 byte per 32 values instead of a 4-byte float): e stands
// for 2^(e - 128) (ggml's doubled values take half its power of two), e8m0_half of tensor/blocks.h, whose
// bits are (e - 1) << 23 for e >= 2 and the denormals 0x200000 << e for e = 0, 1. Every level makes the
// same floats: the scalar one calls e8m0_half, the SIMD ones below (internal linkage: each level's file
// compiles its own with its own flags).
#if defined(__AVX512F__)
static inline __m512 e8m0_half16(const uint8_t* e8) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e8)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i denormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x200000), e);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, denormal));
}
// The 16 float scales of a group's super-block at `f` (PackedWeights::super_index); `e8m0` is
// w.fp4_codes, a constant where the kernel knows its layout at compile time.
static inline __m512 group_scales16(const PackedWeights& w, size_t f, bool e8m0) {
  return e8m0 ? e8m0_half16(w.scale_e8m0.data() + f) : _mm512_loadu_ps(w.scale.data() + f);
}
#endif
#if defined(__AVX2__)
static inline __m256 e8m0_half8(const uint8_t* e8) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e8)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x200000), e);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, small));
}
// 8 rows' float scales at `f` (PackedWeights::super_index plus the half's first row); `e8m0` as above.
static inline __m256 group_scales8(const PackedWeights& w, size_t f, bool e8m0) {
  return e8m0 ? e8m0_half8(w.scale_e8m0.data() + f) : _mm256_loadu_ps(w.scale.data() + f);
}
#endif

// The SIMD levels prefetch a block's weights this far ahead of the block they multiply: 2 KiB, 4 to 8
// blocks (a group's blocks are contiguous and the next group's follow). The hardware prefetcher alone
// leaves loads waiting: 0.5B decode went from 46.6 to 51.7 tok/s with AVX-512 and from 34.9 to 41.2
// with AVX2 (docs/kernels.md); 1 and 4 KiB were no better, 8 KiB worse.
constexpr int64_t kPrefetchBytes = 2048;

template <bool kNib, int kPlanes>
inline void prefetch_ahead(const uint8_t* blk) {
  constexpr int kLines = kNib ? 4 + (kPlanes > 0 ? kPlanes : 0) : 8;  // PackedWeights::block_bytes() / 64
  // An address, not a pointer into the weights: near their end it lies past them (a prefetch never faults).
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(blk) + kPrefetchBytes;
  for (int l = 0; l < kLines; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * l), _MM_HINT_T0);
}

// Tokens [t0, t1) in register tiles of at most `max_tile`, as even as possible: 9 tokens in tiles of 8
// are 5 + 4, not 8 + 1, whose lone token is one dependent chain of products that reads every weight
// again. Calls f(first token, tile size); each token's products are the same in any tiling.
template <class F>
void for_even_tiles(int64_t t0, int64_t t1, int64_t max_tile, F&& f) {
  const int64_t n_tiles = (t1 - t0 + max_tile - 1) / max_tile;
  for (int64_t i = 0, t = t0; i < n_tiles; ++i) {
    const int64_t n = (t1 - t + (n_tiles - i) - 1) / (n_tiles - i);
    f(t, n);
    t += n;
  }
}

// y[t * w.rows + r] for groups [g0, g1) and tokens [t0, t1): one function per ISA level, all with the
// arithmetic above. A level's function may only be called when the CPU runs that level.
using PackedGemmFn = void (*)(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0,
                              int64_t t1, float* y);
void packed_gemm_scalar(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                        float* y);
void packed_gemm_avx2(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                      float* y);
void packed_gemm_avx512(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                        float* y);
void packed_gemm_amx(const PackedWeights& w, const PackedActs& x, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                     float* y);

}  // namespace cpu
}  // namespace serval
