// Activation quantization (hand-computed from its definition) and the integer dot products: the
// scalar reference against a double-precision sum of dequantized values, the SIMD versions against
// the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/act_quant.h"
#include "kernels/ops.h"
#include "random_blocks.h"
#include "tensor/dequant.h"

namespace serval {
namespace {

TEST(ActQuant, Q8_0ScaleAndRoundHalfToEven) {
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = 0.5f * float(j - 16);  // amax = 8
  BlockQ8_0 b;
  quantize_act_row(ActType::Q8_0, x.data(), 32, reinterpret_cast<uint8_t*>(&b));
  EXPECT_EQ(b.d, f32_to_fp16(8.0f / 127.0f));
  for (int j = 0; j < 32; ++j) EXPECT_EQ(b.qs[j], int8_t(std::nearbyint(x[j] * (127.0f / 8.0f)))) << j;
  EXPECT_EQ(b.qs[0], -127);
  // A value landing exactly on .5 rounds to even: 127/254 * 1 = 0.5 -> 0; 1.5 -> 2.
  std::vector<float> y(32, 0.0f);
  y[0] = 254.0f, y[1] = 1.0f, y[2] = 3.0f;
  quantize_act_row(ActType::Q8_0, y.data(), 32, reinterpret_cast<uint8_t*>(&b));
  EXPECT_EQ(b.qs[0], 127);
  EXPECT_EQ(b.qs[1], 0);
  EXPECT_EQ(b.qs[2], 2);
}

TEST(ActQuant, Q8_KUsesSignedMaxAndBlockSums) {
  std::vector<float> x(256);
  for (int j = 0; j < 256; ++j) x[j] = float(j % 7) - 2.0f;
  x[100] = -10.0f;  // largest magnitude, negative: iscale = -127 / -10 = 12.7
  BlockQ8_K b;
  quantize_act_row(ActType::Q8_K, x.data(), 256, reinterpret_cast<uint8_t*>(&b));
  EXPECT_FLOAT_EQ(b.d, 1.0f / 12.7f);
  EXPECT_EQ(b.qs[100], -127);
  for (int g = 0; g < 16; ++g) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += b.qs[g * 16 + j];
    EXPECT_EQ(b.bsums[g], sum);
  }
  // All zeros: scale 0, no division by zero.
  std::vector<float> z(256, 0.0f);
  quantize_act_row(ActType::Q8_K, z.data(), 256, reinterpret_cast<uint8_t*>(&b));
  EXPECT_EQ(b.d, 0.0f);
}

// The activation row as floats: what its quantized form represents.
std::vector<float> dequantized_act(ActType t, const std::vector<uint8_t>& a, int64_t n) {
  std::vector<float> out(n);
  if (t == ActType::Q8_0 || t == ActType::Q8_1) {
    const size_t stride = t == ActType::Q8_0 ? sizeof(BlockQ8_0) : sizeof(BlockQ8_1);
    for (int64_t b = 0; b < n / 32; ++b) {
      uint16_t d;
      std::memcpy(&d, a.data() + b * stride, 2);
      const int8_t* qs = reinterpret_cast<const int8_t*>(a.data() + b * stride + (t == ActType::Q8_0 ? 2 : 4));
      for (int j = 0; j < 32; ++j) out[b * 32 + j] = fp16_to_f32(d) * qs[j];
    }
  } else if (t == ActType::Q8_K) {
    const auto* blk = reinterpret_cast<const BlockQ8_K*>(a.data());
    for (int64_t b = 0; b < n / 256; ++b)
      for (int j = 0; j < 256; ++j) out[b * 256 + j] = blk[b].d * blk[b].qs[j];
  } else {
    dequantize_row(t == ActType::F32 ? DType::F32 : t == ActType::F16 ? DType::F16 : DType::BF16, a.data(), out.data(), n);
  }
  return out;
}

class VecDotTest : public ::testing::TestWithParam<DType> {};

TEST_P(VecDotTest, ReferenceEqualsDequantizedDotAndSimdEqualsReference) {
  const DType t = GetParam();
  const int64_t n = 4 * 256;
  std::mt19937 rng(static_cast<uint32_t>(t) + 5);
  std::normal_distribution<float> dist(0, 1);
  for (int trial = 0; trial < 20; ++trial) {
    const auto w = test::random_rows(t, 1, n, rng());
    std::vector<float> x(n), wf(n);
    for (auto& v : x) v = dist(rng) * (trial % 3 == 0 ? 30.0f : 1.0f);
    const ActType at = act_type_for(t);
    std::vector<uint8_t> act(act_row_bytes(at, n));
    quantize_act_row(at, x.data(), n, act.data());
    const auto xf = dequantized_act(at, act, n);
    dequantize_row(t, w.data(), wf.data(), n);
    double expected = 0, magnitude = 0;
    for (int64_t i = 0; i < n; ++i) expected += double(wf[i]) * xf[i], magnitude += std::abs(double(wf[i]) * xf[i]);
    const float ref_dot = ref::vec_dot(t, w.data(), act.data(), n);
    // Q8_1 carries d * sum(q) rounded to f16, so the minimum term is slightly off by design.
    const double tol = (at == ActType::Q8_1 ? 1e-3 : 1e-5) * (magnitude + 1e-6);
    EXPECT_NEAR(ref_dot, expected, tol) << dtype_info(t).name << " trial " << trial;
    EXPECT_NEAR(cpu::vec_dot(t, w.data(), act.data(), n), ref_dot, 1e-5 * (magnitude + 1e-6))
        << dtype_info(t).name << " trial " << trial;
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, VecDotTest, ::testing::ValuesIn(test::all_types()),
                         [](const auto& info) { return std::string(dtype_info(info.param).name); });

TEST(ActQuant, QuantizedMatmulStaysCloseToFloatMath) {
  for (DType t : test::all_types()) {
    const int64_t rows = 16, cols = 512;
    const auto w = test::random_rows(t, rows, cols, 77);
    const WeightMatrix m{t, rows, cols, w.data(), row_bytes(t, cols)};
    std::mt19937 rng(3);
    std::normal_distribution<float> dist(0, 1);
    std::vector<float> x(cols), y(rows), wf(cols);
    for (auto& v : x) v = dist(rng);
    cpu::matmul(m, x.data(), y.data(), 1);
    double err = 0, norm = 0;
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(t, w.data() + r * m.row_stride, wf.data(), cols);
      double exact = 0;
      for (int64_t c = 0; c < cols; ++c) exact += double(wf[c]) * x[c];
      err += (y[r] - exact) * (y[r] - exact);
      norm += exact * exact;
    }
    EXPECT_LT(std::sqrt(err / norm), 0.02) << dtype_info(t).name;  // 8-bit activations: ~0.5% typical
  }
}

}  // namespace
}  // namespace serval
