// Every fast CPU op against the scalar reference (ref/), on many shapes and every type; and batch
// invariance: a row's result does not depend on how many other rows share the call.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/ops.h"
#include "random_blocks.h"

namespace serval {
namespace {

class MatmulTest : public ::testing::TestWithParam<DType> {};

TEST_P(MatmulTest, MatchesReferenceOnManyShapes) {
  const DType t = GetParam();
  const int64_t block = int64_t(dtype_info(t).block_elems);
  for (auto [rows, cols_blocks, n_tok] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 1, 1}, {3, 2, 5}, {17, 3, 1}, {64, 4, 3}, {5, 9, 16}}) {
    const int64_t cols = cols_blocks * (block == 1 ? 37 : block);
    const auto wbytes = test::random_rows(t, rows, cols, uint32_t(rows * 31 + cols));
    const WeightMatrix w{t, rows, cols, wbytes.data(), row_bytes(t, cols)};
    const auto x = test::random_floats(n_tok * cols, 7);
    std::vector<float> ref_y(n_tok * rows), cpu_y(n_tok * rows);
    ref::matmul(w, x.data(), ref_y.data(), n_tok);
    cpu::matmul(w, x.data(), cpu_y.data(), n_tok);
    for (size_t i = 0; i < ref_y.size(); ++i)
      ASSERT_NEAR(cpu_y[i], ref_y[i], 1e-4f * (1.0f + std::abs(ref_y[i])))
          << dtype_info(t).name << " rows " << rows << " cols " << cols << " i " << i;
  }
}

TEST_P(MatmulTest, BatchInvariant) {
  const DType t = GetParam();
  const int64_t rows = 13, cols = 2 * int64_t(dtype_info(t).block_elems == 1 ? 64 : dtype_info(t).block_elems);
  const auto wbytes = test::random_rows(t, rows, cols, 99);
  const WeightMatrix w{t, rows, cols, wbytes.data(), row_bytes(t, cols)};
  const int64_t n_tok = 9;
  const auto x = test::random_floats(n_tok * cols, 3);
  std::vector<float> all(n_tok * rows), one(rows);
  cpu::matmul(w, x.data(), all.data(), n_tok);
  for (int64_t tok = 0; tok < n_tok; ++tok) {
    cpu::matmul(w, x.data() + tok * cols, one.data(), 1);
    for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(one[r], all[tok * rows + r]) << "token " << tok << " row " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, MatmulTest, ::testing::ValuesIn(test::all_types()),
                         [](const auto& info) { return std::string(dtype_info(info.param).name); });

TEST(Attention, MatchesReferenceWithGqaAndScatteredSlots) {
  for (auto [n_head, n_head_kv, d_head, n_keys] :
       std::vector<std::tuple<int, int, int, int>>{{1, 1, 8, 1}, {8, 4, 8, 7}, {14, 2, 64, 33}, {4, 1, 256, 100}}) {
    const int64_t kv_dim = n_head_kv * d_head, n_slots = 2 * n_keys + 3;
    const auto k = test::random_floats(n_slots * kv_dim, 1), v = test::random_floats(n_slots * kv_dim, 2);
    const auto q = test::random_floats(n_head * d_head, 3);
    std::vector<int32_t> slots;
    for (int j = 0; j < n_keys; ++j) slots.push_back(int32_t((j * 7 + 3) % n_slots));  // not in order
    const AttentionShape s{n_head, n_head_kv, d_head, 1.0f / std::sqrt(float(d_head))};
    const KvLayerView view{DType::F32, reinterpret_cast<const uint8_t*>(k.data()), reinterpret_cast<const uint8_t*>(v.data()), kv_dim};
    std::vector<float> ref_out(n_head * d_head), cpu_out(n_head * d_head);
    ref::attention(s, q.data(), view, slots, ref_out.data());
    cpu::attention(s, q.data(), view, slots, cpu_out.data());
    for (size_t i = 0; i < ref_out.size(); ++i) ASSERT_NEAR(cpu_out[i], ref_out[i], 1e-5f) << i;
  }
}

TEST(Elementwise, RmsNormSoftmaxActivations) {
  const std::vector<float> x = {1, -2, 3, -4}, w = {1, 1, 2, 0.5f};
  std::vector<float> out(4);
  rms_norm(x.data(), w.data(), out.data(), 4, 0.0f);
  const float rms = std::sqrt((1 + 4 + 9 + 16) / 4.0f);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[i], x[i] / rms * w[i], 1e-6f);
  std::vector<float> p = {1, 2, 3};
  softmax_inplace(p.data(), 3);
  const float z = std::exp(1.f) + std::exp(2.f) + std::exp(3.f);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(p[i], std::exp(float(i + 1)) / z, 1e-6f);
  EXPECT_NEAR(silu(1.0f), 1.0f / (1.0f + std::exp(-1.0f)), 1e-7f);
  EXPECT_NEAR(gelu_tanh(1.0f), 0.841192f, 1e-5f);  // 0.5 (1 + tanh(sqrt(2/pi) (1 + 0.044715)))
}

TEST(Elementwise, LayerNormAndExactGelu) {
  // mean -0.5, variance ((1.5^2 + 1.5^2 + 3.5^2 + 3.5^2) / 4) = 7.25
  const std::vector<float> x = {1, -2, 3, -4}, w = {1, 2, 1, 0.5f}, b = {0, 1, -1, 0};
  std::vector<float> out(4);
  layer_norm(x.data(), w.data(), b.data(), out.data(), 4, 0.0f);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[i], (x[i] + 0.5f) / std::sqrt(7.25f) * w[i] + b[i], 1e-6f);
  std::vector<float> same = x;  // in place
  layer_norm(same.data(), w.data(), b.data(), same.data(), 4, 0.0f);
  EXPECT_EQ(same, out);
  EXPECT_NEAR(gelu_erf(1.0f), 0.8413447460685429f, 1e-7f);  // Phi(1)
  EXPECT_NEAR(gelu_erf(-2.0f), -2.0f * 0.022750131948179195f, 1e-7f);
  EXPECT_EQ(gelu_erf(0.0f), 0.0f);
}

}  // namespace
}  // namespace serval
