// BF16 matrix tiles (cpu::prepare_bf16_tiles; kernels/cpu/gemm_float.h): the products of a matrix of any
// type against a double-precision sum of the same BF16 values, rounded here by an implementation of
// our own (to nearest even; denormal inputs and results as zeros), within the float accumulator's
// bound; batch and thread invariance; biases; and only the level with the tiles using them. On a CPU
// without AMX-BF16 the tile checks are skipped, by name, and the preparation must be a no-op.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <iostream>

#include "base/cpu.h"
#include "base/thread_pool.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "random_blocks.h"
#include "test_support.h"
#include "tensor/dequant.h"

namespace serval {
namespace {

using test::IsaGuard;

// x rounded to BF16 (to nearest, ties to even), denormal inputs and results read as zeros.
double bf16_rne(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0) return 0.0;
  if ((u & 0x7fffffffu) > 0x7f800000u) return double(x);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return std::fabs(r) < FLT_MIN ? 0.0 : double(r);
}

struct Bf16Case {
  DType type;
  int64_t rows, cols;
};
// Groups of 16 rows in pairs and alone (17, 40, 100 rows), K with a padded last block (88 = 2.75
// blocks of 32; 40) and the k-quants' 256.
const Bf16Case kBf16Cases[] = {{DType::Q8_0, 40, 96}, {DType::F16, 17, 88}, {DType::Q4_K, 100, 256}, {DType::BF16, 33, 40}};
const int64_t kBf16Tokens[] = {1, 15, 16, 17, 33, 70};

struct Bf16Matrix {
  std::vector<uint8_t> bytes;
  WeightMatrix w;
  Bf16Matrix(const Bf16Case& c, uint32_t seed) : bytes(test::random_rows(c.type, c.rows, c.cols, seed)) {
    w = WeightMatrix{c.type, c.rows, c.cols, bytes.data(), row_bytes(c.type, c.cols)};
    cpu::prepare_weights(w);
    cpu::prepare_bf16_tiles(w);
  }
};

bool skip_without_tiles() {
  if (cpu::has_amx_bf16() && cpu::has_avx512_bf16()) return false;
  std::cout << "[ NOT RUN  ] BF16 tiles: this CPU has no AMX-BF16\n";  // never silent
  return true;
}

TEST(Bf16Tiles, PreparedOnlyWhereTheCpuHasThemAndNeverForF32) {
  Bf16Matrix q8({DType::Q8_0, 16, 32}, 1), f32({DType::F32, 16, 32}, 2);
  EXPECT_EQ(q8.w.tiles_bf16 != nullptr, cpu::has_amx_bf16() && cpu::has_avx512_bf16());
  EXPECT_EQ(f32.w.tiles_bf16, nullptr);
}

TEST(Bf16Tiles, MatchTheDoubleSumOfTheBf16ValuesWithinTheFloatBound) {
  if (skip_without_tiles()) GTEST_SKIP();
  IsaGuard guard;
  cpu::force_isa(cpu::Isa::Amx);
  for (const Bf16Case& c : kBf16Cases) {
    Bf16Matrix m(c, uint32_t(c.rows * 3 + c.cols));
    ASSERT_NE(m.w.tiles_bf16, nullptr);
    std::vector<float> wf(size_t(c.rows * c.cols));
    for (int64_t r = 0; r < c.rows; ++r)
      dequantize_row(c.type, m.w.data + r * m.w.row_stride, wf.data() + r * c.cols, size_t(c.cols));
    for (const int64_t n_tok : kBf16Tokens) {
      const auto x = test::random_floats(size_t(n_tok * c.cols), uint32_t(n_tok));
      std::vector<float> got(size_t(n_tok * c.rows));
      cpu::matmul(m.w, x.data(), got.data(), n_tok);
      const int64_t kpad = (c.cols + 31) / 32 * 32;
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t r = 0; r < c.rows; ++r) {
          double want = 0, mag = 0;
          for (int64_t k = 0; k < c.cols; ++k) {
            const double p = bf16_rne(wf[size_t(r * c.cols + k)]) * bf16_rne(x[size_t(t * c.cols + k)]);
            want += p, mag += std::fabs(p);
          }
          const double bound = double(kpad + 1) * std::ldexp(1.0, -24) * mag + 1e-30;
          ASSERT_NEAR(got[size_t(t * c.rows + r)], want, bound)
              << dtype_info(c.type).name << " rows " << c.rows << " tokens " << n_tok << " token " << t << " row " << r;
        }
    }
  }
}

TEST(Bf16Tiles, TokenResultsDoNotDependOnTheBatchOrThreads) {
  if (skip_without_tiles()) GTEST_SKIP();
  IsaGuard guard;
  cpu::force_isa(cpu::Isa::Amx);
  const int saved_threads = pool_threads();
  for (const Bf16Case& c : kBf16Cases) {
    Bf16Matrix m(c, 7);
    const int64_t n_tok = 70;
    const auto x = test::random_floats(size_t(n_tok * c.cols), 3);
    std::vector<float> all(size_t(n_tok * c.rows)), one(size_t(c.rows)), single(all.size());
    cpu::matmul(m.w, x.data(), all.data(), n_tok);
    for (int64_t t = 0; t < n_tok; ++t) {
      cpu::matmul(m.w, x.data() + t * c.cols, one.data(), 1);
      for (int64_t r = 0; r < c.rows; ++r) ASSERT_EQ(one[size_t(r)], all[size_t(t * c.rows + r)]) << t << " " << r;
    }
    set_compute_threads(1);
    cpu::matmul(m.w, x.data(), single.data(), n_tok);
    set_compute_threads(saved_threads);
    EXPECT_EQ(single, all) << dtype_info(c.type).name;
  }
}

// Below the Amx level a matrix with tiles runs as one without them; a product's bias gives the bits of
// the product plus the bias added afterwards, at every level (tiles, packed, float).
TEST(Bf16Tiles, OnlyTheTileLevelUsesThemAndBiasesAreAddedToTheProduct) {
  IsaGuard guard;
  for (const Bf16Case& c : kBf16Cases) {
    Bf16Matrix tiled(c, 5);
    WeightMatrix plain = tiled.w;
    plain.tiles_bf16.reset();
    const int64_t n_tok = 33;
    const auto x = test::random_floats(size_t(n_tok * c.cols), 8);
    const auto bias = test::random_floats(size_t(c.rows), 9);
    for (cpu::Isa level : {cpu::Isa::Scalar, cpu::Isa::Avx2, cpu::Isa::Avx512, cpu::Isa::Amx}) {
      if (int(level) > int(cpu::detected_isa())) continue;
      cpu::force_isa(level);
      std::vector<float> a(size_t(n_tok * c.rows)), b(a.size()), with_bias(a.size());
      cpu::matmul(tiled.w, x.data(), a.data(), n_tok);
      cpu::matmul(plain, x.data(), b.data(), n_tok);
      if (level != cpu::Isa::Amx || !tiled.w.tiles_bf16) EXPECT_EQ(a, b) << cpu::isa_name(level);
      else EXPECT_NE(a, b) << "the tiles were not used";
      const cpu::MatmulOut outs[] = {{&tiled.w, with_bias.data(), bias.data()}};
      cpu::matmul_many(outs, x.data(), n_tok);
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t r = 0; r < c.rows; ++r) a[size_t(t * c.rows + r)] += bias[size_t(r)];
      EXPECT_EQ(with_bias, a) << dtype_info(c.type).name << " " << cpu::isa_name(level);
    }
  }
}

}  // namespace
}  // namespace serval
