// The packed GEMM at every ISA level this machine runs: against the scalar reference (ref::matmul, the
// GGUF-layout oracle) within a rounding bound derived from the sizes, bitwise against the portable
// level (all levels do the same float operations on exact integer sums), and batch invariance.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cerrno>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include "base/error.h"

#include "base/cpu.h"
#include "kernels/cpu/gemm_float.h"
#include "kernels/cpu/packed.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "tensor/blocks.h"
#include "random_blocks.h"
#include "test_support.h"

namespace serval {
namespace {

const std::vector<DType> kPackedTypes = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0,
                                         DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL,
                                         DType::MXFP4};
const std::vector<cpu::Isa> kLevels = {cpu::Isa::Scalar, cpu::Isa::Avx2, cpu::Isa::Avx512, cpu::Isa::Amx};

using test::IsaGuard;

// A matrix whose rows start one byte past an aligned address (as tensors in a mapped file may).
struct TestMatrix {
  std::vector<uint8_t> storage;
  WeightMatrix w;
  TestMatrix(DType t, int64_t rows, int64_t cols, uint32_t seed) {
    const auto bytes = test::random_rows(t, rows, cols, seed);
    storage.assign(bytes.size() + 1, 0);
    std::memcpy(storage.data() + 1, bytes.data(), bytes.size());
    w = WeightMatrix{t, rows, cols, storage.data() + 1, row_bytes(t, cols)};
    cpu::prepare_weights(w);
  }
};

// |error| of a sum of n_blocks float terms, each a product of rounded factors: a few ulps of the sum
// of magnitudes per term (the dequantized |w| . |x| bounds every partial sum).
float error_bound(const WeightMatrix& w, int64_t r, const float* x) {
  std::vector<float> row(w.cols);
  get_row(w, r, row.data());
  double mag = 0;
  for (int64_t k = 0; k < w.cols; ++k) mag += std::abs(double(row[k]) * x[k]);
  const double n_terms = double(w.cols / 32) * 2 + 8;
  double q8_1 = 0;  // the reference rounds Q8_1's d * sum(q) to F16 and multiplies it by the min
  if (w.type == DType::Q4_1 || w.type == DType::Q5_1)
    for (int64_t b = 0; b < w.cols / 32; ++b) {
      Block32 blk;
      unpack_block32(w.type, w.data + r * w.row_stride + b * dtype_info(w.type).block_bytes, blk);
      double ax = 0;
      for (int k = 0; k < 32; ++k) ax += std::abs(double(x[32 * b + k]));
      q8_1 += std::abs(double(blk.m)) * ax * std::ldexp(1.0, -10);
    }
  return float(n_terms * 4 * FLT_EPSILON * (mag + 1e-3) + q8_1 + 1e-6);
}

struct Shape {
  int64_t rows, blocks, n_tok;
};
// Token counts: every tile width of each level (the AVX-512 one-block tiles go to 10; 17 = 9 + 8, 20 = 10 +
// 10, 27 = 9 + 9 + 9) and the AMX level's (28 and up; pairs of groups and of 16-token tiles, with a
// partial second tile (28, 45), a lone last tile (45) and a lone last group (33, 100)).
const std::vector<Shape> kShapes = {{1, 1, 1},   {15, 1, 3},  {16, 2, 8},  {17, 3, 9},  {16, 1, 10},  {37, 2, 17},
                                    {20, 2, 20}, {18, 1, 27}, {33, 2, 28}, {49, 2, 45}, {100, 1, 70}};

class PackedGemm : public ::testing::TestWithParam<DType> {};

TEST_P(PackedGemm, EveryLevelMatchesReferenceAndScalarBitwise) {
  const DType t = GetParam();
  IsaGuard guard;
  ASSERT_TRUE(cpu::packable(t));
  for (const Shape& s : kShapes) {
    const int64_t cols = s.blocks * int64_t(dtype_info(t).block_elems);
    TestMatrix m(t, s.rows, cols, uint32_t(s.rows * 7 + cols));
    ASSERT_TRUE(m.w.packed) << "a packable type must be packed";
    const auto xs = test::random_floats(s.n_tok * cols + 1, 5);
    const float* x = xs.data() + 1;  // misaligned activations
    std::vector<float> want(s.n_tok * s.rows), scalar(want.size());
    ref::matmul(WeightMatrix{t, s.rows, cols, m.w.data, m.w.row_stride}, x, want.data(), s.n_tok);
    for (cpu::Isa level : kLevels) {
      if (int(level) > int(cpu::detected_isa())) {
        std::cout << "[ NOT RUN  ] " << cpu::isa_name(level) << ": this CPU does not run it\n";  // never silent
        continue;
      }
      cpu::force_isa(level);
      std::vector<float> got(want.size());
      cpu::matmul(m.w, x, got.data(), s.n_tok);
      for (int64_t tok = 0; tok < s.n_tok; ++tok)
        for (int64_t r = 0; r < s.rows; ++r) {
          const size_t i = tok * s.rows + r;
          ASSERT_NEAR(got[i], want[i], error_bound(m.w, r, x + tok * cols))
              << dtype_info(t).name << " " << cpu::isa_name(level) << " rows " << s.rows << " cols " << cols
              << " token " << tok << " row " << r;
        }
      if (level == cpu::Isa::Scalar) scalar = got;
      else ASSERT_EQ(got, scalar) << cpu::isa_name(level) << " differs from the scalar level, " << dtype_info(t).name;
    }
  }
}

// The 5- and 6-bit types' bit planes in both orders (packed.h: PlaneLayout): every level that reads an
// order gives the scalar level's bits on StepMasks, and the reference within its bound. AVX-512 and AMX
// read StepMasks only and must refuse ValueBytes rather than read it wrong.
TEST(PackedGemm, BothPlaneOrdersGiveTheSameBitsAtEveryLevelThatReadsThem) {
  IsaGuard guard;
  const bool have_avx512 = int(cpu::detected_isa()) >= int(cpu::Isa::Avx512);
  for (DType t : {DType::Q5_0, DType::Q5_1, DType::Q5_K, DType::Q6_K}) {
    const int64_t rows = 37, cols = 2 * int64_t(dtype_info(t).block_elems), n_tok = 9;
    TestMatrix m(t, rows, cols, 23);
    EXPECT_EQ(m.w.packed->plane_by_value, !have_avx512) << "the order for this CPU: ValueBytes without AVX-512";
    const auto xs = test::random_floats(n_tok * cols, 9);
    std::vector<float> want(n_tok * rows), scalar(want.size());
    ref::matmul(WeightMatrix{t, rows, cols, m.w.data, m.w.row_stride}, xs.data(), want.data(), n_tok);
    for (cpu::PlaneLayout order : {cpu::PlaneLayout::StepMasks, cpu::PlaneLayout::ValueBytes}) {
      WeightMatrix w{t, rows, cols, m.w.data, m.w.row_stride};
      w.packed = cpu::pack_weights(w, order);
      ASSERT_EQ(w.packed->plane_by_value, order == cpu::PlaneLayout::ValueBytes);
      for (cpu::Isa level : kLevels) {
        const char* name = cpu::isa_name(level);
        if (int(level) > int(cpu::detected_isa())) {
          std::cout << "[ NOT RUN  ] " << name << ": this CPU does not run it\n";
          continue;
        }
        cpu::force_isa(level);
        std::vector<float> got(want.size());
        if (w.packed->plane_by_value && int(level) > int(cpu::Isa::Avx2)) {
          EXPECT_THROW(cpu::matmul(w, xs.data(), got.data(), n_tok), Error) << name;
          continue;
        }
        cpu::matmul(w, xs.data(), got.data(), n_tok);
        for (int64_t tok = 0; tok < n_tok; ++tok)
          for (int64_t r = 0; r < rows; ++r)
            ASSERT_NEAR(got[tok * rows + r], want[tok * rows + r], error_bound(w, r, xs.data() + tok * cols))
                << dtype_info(t).name << " " << name << " token " << tok << " row " << r;
        if (level == cpu::Isa::Scalar && order == cpu::PlaneLayout::StepMasks) scalar = got;
        else ASSERT_EQ(got, scalar) << dtype_info(t).name << " " << name << " plane by value " << w.packed->plane_by_value;
      }
    }
  }
}

TEST_P(PackedGemm, TokenResultsDoNotDependOnTheBatchOrThreads) {
  const DType t = GetParam();
  const int64_t rows = 45, cols = 2 * int64_t(dtype_info(t).block_elems), n_tok = 70;
  TestMatrix m(t, rows, cols, 11);
  const auto x = test::random_floats(n_tok * cols, 3);
  std::vector<float> all(n_tok * rows), one(rows), single_thread(n_tok * rows);
  cpu::matmul(m.w, x.data(), all.data(), n_tok);
  for (int64_t tok = 0; tok < n_tok; ++tok) {
    cpu::matmul(m.w, x.data() + tok * cols, one.data(), 1);
    for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(one[r], all[tok * rows + r]) << "token " << tok << " row " << r;
  }
  const int threads = compute_threads();
  set_compute_threads(1);
  cpu::matmul(m.w, x.data(), single_thread.data(), n_tok);
  set_compute_threads(threads);
  EXPECT_EQ(single_thread, all);
}

INSTANTIATE_TEST_SUITE_P(Types, PackedGemm, ::testing::ValuesIn(kPackedTypes),
                         [](const auto& info) { return std::string(dtype_info(info.param).name); });

// Activations are quantized with SIMD at the higher levels: the bytes must be those of the scalar
// quantizer (act_quant.h), including ties for the largest magnitude and all-zero blocks.
TEST(PackedGemm, ActivationQuantizationIsTheSameAtEveryLevel) {
  IsaGuard guard;
  const int64_t cols = 512, n_tok = 5;
  auto x = test::random_floats(n_tok * cols, 9);
  std::fill(x.begin() + 256, x.begin() + 512, 0.0f);  // an all-zero super-block
  x[600] = 3.5f, x[700] = -3.5f;                      // a tie of magnitudes: the first one sets the sign
  for (DType t : {DType::Q8_0, DType::Q4_1, DType::Q4_K}) {
    cpu::force_isa(cpu::Isa::Scalar);
    cpu::PackedActs want, got;
    cpu::quantize_packed_acts(t, x.data(), cols, n_tok, want);
    for (cpu::Isa level : kLevels) {
      if (int(level) > int(cpu::detected_isa())) continue;
      cpu::force_isa(level);
      cpu::quantize_packed_acts(t, x.data(), cols, n_tok, got);
      EXPECT_EQ(got.qs, want.qs) << cpu::isa_name(level);
      EXPECT_EQ(got.d, want.d) << cpu::isa_name(level);
      EXPECT_EQ(got.sums, want.sums) << cpu::isa_name(level);
      EXPECT_EQ(got.pairs, want.pairs) << cpu::isa_name(level);
    }
  }
}

// The half sums as int16 pairs are what VPDPWSSD multiplies: low half first, negative sums kept.
TEST(PackedGemm, ActivationPairsHoldBothHalfSums) {
  std::vector<float> x(64, 0.0f);
  for (int i = 0; i < 16; ++i) x[i] = -1.0f, x[16 + i] = 0.5f, x[32 + i] = 1.0f;  // sums -16 * 127, 16 * 64, ...
  cpu::PackedActs a;
  cpu::quantize_packed_acts(DType::Q8_0, x.data(), 64, 1, a);
  ASSERT_EQ(a.pairs.size(), 2u);
  for (int b = 0; b < 2; ++b) {
    EXPECT_EQ(int16_t(a.pairs[b] & 0xFFFF), a.sums[2 * b]);
    EXPECT_EQ(int16_t(uint32_t(a.pairs[b]) >> 16), a.sums[2 * b + 1]);
  }
  EXPECT_EQ(a.sums[0], -16 * 127);
}

// Every value and sub-scale bit set (for most types the largest values, scales and mins) against
// activations at their largest magnitude: the super-block integer sums stay exact (packed.h bounds
// them), so the result agrees with the reference within the usual bound.
TEST_P(PackedGemm, AllBitsSetAgainstLargestActivations) {
  const DType t = GetParam();
  IsaGuard guard;
  const int64_t rows = 16, cols = 2 * int64_t(dtype_info(t).block_elems);
  auto bytes = test::random_rows(t, rows, cols, 2);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = 0xFF;  // every bit set: the largest values and scales
  for (size_t blk = 0; blk < bytes.size() / dtype_info(t).block_bytes; ++blk) {
    for (size_t off : test::half_fields(t)) {
      const uint16_t h = f32_to_fp16(0.01f);
      std::memcpy(&bytes[blk * dtype_info(t).block_bytes + off], &h, 2);
    }
    if (t == DType::MXFP4) bytes[blk * dtype_info(t).block_bytes] = 121;  // a scale of 2^-7 (not 2^127)
  }
  WeightMatrix w{t, rows, cols, bytes.data(), row_bytes(t, cols)};
  cpu::prepare_weights(w);
  ASSERT_TRUE(w.packed);
  // All at the activation maximum, of either sign; 32 tokens, so that the AMX level's tiles run too.
  constexpr int64_t kTok = 32;
  std::vector<float> x(kTok * cols, 1.0f);
  for (int64_t i = 0; i < kTok * cols; ++i)
    if ((i / cols) % 2) x[i] = -1.0f;
  std::vector<float> want(kTok * rows), got(want.size());
  ref::matmul(WeightMatrix{t, rows, cols, bytes.data(), w.row_stride}, x.data(), want.data(), kTok);
  for (cpu::Isa level : kLevels) {
    if (int(level) > int(cpu::detected_isa())) continue;
    cpu::force_isa(level);
    cpu::matmul(w, x.data(), got.data(), kTok);
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(got[i], want[i], error_bound(w, int64_t(i) % rows, x.data() + (int64_t(i) / rows) * cols))
          << dtype_info(t).name << " " << cpu::isa_name(level) << " output " << i;
  }
}

// The packed copy's size per weight, from the layout's arithmetic (packed.h): values (4 bits per
// nibble, 1 per bit plane, 8 per byte), int8 sub-scales and mins per block or half, float scales per
// super-block. Q6_K in nibbles and two planes is 6 + 0.5 + 0.125 = 6.625 bits against the file's 6.5625
// (it was 8.625 as bytes), so a model's resident copy stays near its file's size.
TEST(PackedGemm, PackedSizePerWeightIsTheLayoutsArithmetic) {
  const struct { DType t; double bits; } kCases[] = {
      {DType::Q4_0, 4 + 32.0 / 32}, {DType::Q5_0, 5 + 32.0 / 32}, {DType::Q8_0, 8 + 32.0 / 32},
      {DType::Q4_K, 4 + 8.0 / 32 + 8.0 / 32 + 64.0 / 256}, {DType::Q5_K, 5 + 8.0 / 32 + 8.0 / 32 + 64.0 / 256},
      {DType::Q6_K, 6 + 16.0 / 32 + 32.0 / 256}, {DType::Q3_K, 4 + 16.0 / 32 + 32.0 / 256},
      {DType::MXFP4, 4 + 8.0 / 32},
  };
  for (const auto& c : kCases) {
    const int64_t rows = 64, cols = 4 * 256;
    TestMatrix m(c.t, rows, cols, 5);
    ASSERT_TRUE(m.w.packed) << dtype_info(c.t).name;
    EXPECT_DOUBLE_EQ(double(m.w.packed->bytes()) * 8 / double(rows * cols), c.bits) << dtype_info(c.t).name;
  }
}

// The kernels' MXFP4 table is MXFP4's values (tensor/blocks.h, as ggml defines them) plus the offset.
TEST(PackedGemm, Fp4TableIsMxfp4sValuesPlusTheOffset) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(int(cpu::kFp4Table[c]), mxfp4_values()[c] + 12) << "code " << c;
}

// MXFP4 keeps its E8M0 scale bytes, and every level turns them into e8m0_half's floats: a matrix whose
// rows take every exponent 0..255 in turn (denormal, normal, the largest) against one token, at every
// level, bitwise against the scalar level and within the reference's bound. One value per row is set
// (code 2: 1.0 doubled), so each output is that value times the scale times the activation, and the
// finite ones are checked against e8m0_half directly.
TEST(PackedGemm, Mxfp4ScalesOfEveryExponentAtEveryLevel) {
  IsaGuard guard;
  const int64_t rows = 256, cols = 32;
  std::vector<uint8_t> bytes(size_t(rows) * 17, 0);
  for (int64_t r = 0; r < rows; ++r) {
    bytes[size_t(r) * 17] = uint8_t(r);        // the exponent
    bytes[size_t(r) * 17 + 1] = 0x02;          // value 0: code 2 (1.0, doubled: 2); the rest code 0
  }
  WeightMatrix w{DType::MXFP4, rows, cols, bytes.data(), 17};
  w.packed = cpu::pack_weights(w);
  ASSERT_EQ(w.packed->scale_e8m0.size(), size_t(rows)) << "one byte per row and block";
  std::vector<float> x(cols, 0.0f);
  x[0] = 1.0f;  // quantized to 127 with a scale of 1/127
  std::vector<float> scalar;
  for (cpu::Isa level : kLevels) {
    if (int(level) > int(cpu::detected_isa())) continue;
    cpu::force_isa(level);
    std::vector<float> got(rows);
    cpu::matmul(w, x.data(), got.data(), 1);
    if (level == cpu::Isa::Scalar) {
      scalar = got;
      for (int64_t r = 0; r < rows; ++r) {
        const double want = 2.0 * double(e8m0_half(uint8_t(r)));  // times x = 127 * (1/127 as F16)
        EXPECT_NEAR(got[r], want, std::abs(want) * 1e-3 + 1e-44) << "exponent " << r;
      }
    } else {
      EXPECT_EQ(got, scalar) << cpu::isa_name(level);
    }
  }
}

TEST(PackedGemm, UnpackableTypesAreLeftAsTheyAre) {
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    TestMatrix m(t, 3, int64_t(dtype_info(t).block_elems == 1 ? 64 : dtype_info(t).block_elems), 1);
    EXPECT_FALSE(m.w.packed) << dtype_info(t).name;
  }
}

TEST(Isa, LevelsParseAndCannotBeForcedAboveTheCpu) {
  IsaGuard guard;
  EXPECT_EQ(cpu::parse_isa("avx2"), cpu::Isa::Avx2);
  EXPECT_THROW(cpu::parse_isa("sse9"), Error);
  cpu::force_isa(cpu::Isa::Scalar);
  EXPECT_EQ(cpu::active_isa(), cpu::Isa::Scalar);
  if (cpu::detected_isa() != cpu::Isa::Amx) {
    EXPECT_THROW(cpu::force_isa(cpu::Isa::Amx), Error);
  }
}

TEST(PackedGemm, EvenTilesCoverTheTokensInBalancedTiles) {
  for (int64_t max_tile : {4, 8})
    for (int64_t n = 1; n <= 40; ++n) {
      std::vector<std::pair<int64_t, int64_t>> tiles;
      cpu::for_even_tiles(3, 3 + n, max_tile, [&](int64_t t, int64_t k) { tiles.emplace_back(t, k); });
      ASSERT_EQ(int64_t(tiles.size()), (n + max_tile - 1) / max_tile) << n;
      int64_t next = 3, lo = max_tile, hi = 0;
      for (auto [t, k] : tiles) {
        EXPECT_EQ(t, next) << "tiles are contiguous, in order";
        next += k, lo = std::min(lo, k), hi = std::max(hi, k);
      }
      EXPECT_EQ(next, 3 + n);
      EXPECT_LE(hi, max_tile);
      EXPECT_LE(hi - lo, 1) << n << " tokens in tiles of " << max_tile;
    }
}

// The /proc/self/smaps entry of the mapping that holds p: its lines ("" when none does) and its range.
struct Smaps {
  std::string lines;
  uintptr_t lo = 0, hi = 0;
};

Smaps smaps_of(const void* p) {
  std::ifstream in("/proc/self/smaps");
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::string line;
  Smaps found;
  bool inside = false;
  while (std::getline(in, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream header(line);
    if (header >> std::hex >> lo >> dash >> hi && dash == '-') {  // a mapping's first line
      if (inside) break;
      inside = a >= lo && a < hi;
      if (inside) found.lo = lo, found.hi = hi;
    } else if (inside) {
      found.lines += line + "\n";
    }
  }
  return found;
}

bool transparent_huge_pages_off() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(in, mode);
  return mode.empty() || mode.find("[never]") != std::string::npos;
}

// Weights of 2 MiB and more (quantized or float) lie in their own mapping, aligned to 2 MiB and open
// to transparent huge pages; smaller ones come from aligned_alloc (64-byte aligned).
TEST(PackedGemm, LargeWeightsAreMappedForHugePages) {
  auto small = cpu::alloc_weights(100000);
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small.get_deleter().mapped, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.get()) % 64, 0u);
  const size_t bytes = 3 * cpu::kHugePage + 100;
  auto big = cpu::alloc_weights(bytes);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.get()) % cpu::kHugePage, 0u);
  EXPECT_EQ(big.get_deleter().mapped, 3 * cpu::kHugePage + 4096) << "whole 4 KiB pages, head and tail unmapped";
  std::memset(big.get(), 7, bytes);
  EXPECT_EQ(big[bytes - 1], 7);
  const Smaps m = smaps_of(big.get());
  const std::string& smaps = m.lines;
  ASSERT_FALSE(smaps.empty());
  EXPECT_LE(m.lo, reinterpret_cast<uintptr_t>(big.get()));
  EXPECT_GE(m.hi, reinterpret_cast<uintptr_t>(big.get()) + big.get_deleter().mapped);
  // The extra 2 MiB mapped for the alignment is given back: the page after the buffer is unmapped
  // (madvise says ENOMEM), whatever mappings lie around it.
  void* after = big.get() + big.get_deleter().mapped;
  errno = 0;
  EXPECT_EQ(madvise(after, 4096, MADV_NORMAL), -1);
  EXPECT_EQ(errno, ENOMEM) << "the tail past the buffer is still mapped";
  // Packing: a Q8_0 matrix of 2048 x 1024 packs into exactly 2 MiB.
  const auto rows = test::random_rows(DType::Q8_0, 2048, 1024, 5);
  const auto packed = cpu::pack_weights(WeightMatrix{DType::Q8_0, 2048, 1024, rows.data(), row_bytes(DType::Q8_0, 1024)});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(packed->q.get()) % cpu::kHugePage, 0u);
  EXPECT_EQ(packed->q.get_deleter().mapped, cpu::kHugePage);
  // And the float GEMM's: an F16 matrix of 1024 x 1024 is 2 MiB too.
  const auto halves = test::random_rows(DType::F16, 1024, 1024, 6);
  const auto packed_f16 = cpu::pack_float_weights(WeightMatrix{DType::F16, 1024, 1024, halves.data(), 2048});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(packed_f16->w.get()) % cpu::kHugePage, 0u);
  EXPECT_EQ(packed_f16->w.get_deleter().mapped, cpu::kHugePage);
  if (transparent_huge_pages_off()) GTEST_SKIP() << "transparent huge pages are off on this machine";
  const size_t flags = smaps.find("VmFlags:"), eligible = smaps.find("THPeligible:");
  ASSERT_NE(flags, std::string::npos);
  EXPECT_NE(smaps.find(" hg", flags), std::string::npos) << "advised MADV_HUGEPAGE\n" << smaps;
  ASSERT_NE(eligible, std::string::npos);
  EXPECT_EQ(std::stoi(smaps.substr(eligible + 12)), 1) << smaps;
}

}  // namespace
}  // namespace serval
