// GPTQ-style rounding (quant/gptq.h), checked by math: the packed codes round-trip through the block
// unpackers; the Hessian is the sum of x x^T; with independent inputs (a diagonal Hessian) nothing is
// compensated, so every value is the grid point nearest to it; with correlated inputs the layer's
// output error on those inputs, which GPTQ minimizes, is well below round-to-nearest's (the same
// type's search with the same importances).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "base/error.h"
#include "quant/gptq.h"
#include "tensor/blocks.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

const DType kTypes[] = {DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::IQ4_NL,
                        DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K};

std::vector<float> gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, sigma);
  std::vector<float> x(n);
  for (auto& v : x) v = g(rng);
  return x;
}

// Inputs x = z M: each column a mix of its neighbours', so the columns are strongly correlated.
std::vector<float> correlated_inputs(int64_t n_rows, int64_t cols, uint32_t seed) {
  const auto z = gaussian(size_t(n_rows * cols), seed);
  std::vector<float> x(z.size(), 0.0f);
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t k = std::max<int64_t>(0, j - 3); k <= j; ++k)
        x[size_t(r * cols + j)] += z[size_t(r * cols + k)] * (1.0f + 0.5f * float(j - k)) * (1.0f + float(j % 7));
  return x;
}

TEST(GptqCodes, PackCodesInvertsUnpack) {
  for (DType t : kTypes) {
    const auto x = gaussian(512, 7);
    std::vector<uint8_t> q(row_bytes(t, x.size()));
    quantize_row(t, x.data(), q.data(), x.size());
    std::vector<uint8_t> again = q;
    const size_t block = is_kquant(t) ? 256 : 32, bytes = row_bytes(t, block);
    for (size_t b = 0; b < x.size() / block; ++b) {
      uint8_t* p = again.data() + b * bytes;
      int8_t codes[256];
      if (is_kquant(t)) {
        BlockK k;
        unpack_block_k(t, p, k);
        std::copy(k.q, k.q + 256, codes);
        for (int i = 0; i < 256; ++i) k.q[i] = 0;
        pack_codes_k(t, p, codes);
      } else {
        Block32 k;
        unpack_block32(t, p, k);
        std::copy(k.q, k.q + 32, codes);
        pack_codes32(t, p, codes);
      }
    }
    EXPECT_EQ(again, q) << dtype_info(t).name;
  }
}

TEST(GptqCodes, PackCodesWritesEveryCodeOfTheRange) {
  for (DType t : kTypes) {
    if (t == DType::IQ4_NL) continue;  // levels, not a range (PackCodesInvertsUnpack covers them)
    const CodeRange r = code_range(t);
    const auto x = gaussian(256, 3);
    std::vector<uint8_t> q(row_bytes(t, 256));
    quantize_row(t, x.data(), q.data(), 256);
    const size_t block = is_kquant(t) ? 256 : 32;
    int8_t codes[256];
    for (size_t i = 0; i < block; ++i) codes[i] = int8_t(r.lo + int(i * 7 % size_t(r.hi - r.lo + 1)));
    if (is_kquant(t)) {
      pack_codes_k(t, q.data(), codes);
      BlockK k;
      unpack_block_k(t, q.data(), k);
      for (size_t i = 0; i < block; ++i) ASSERT_EQ(k.q[i], codes[i]) << dtype_info(t).name << " element " << i;
    } else {
      pack_codes32(t, q.data(), codes);
      Block32 k;
      unpack_block32(t, q.data(), k);
      for (size_t i = 0; i < block; ++i) ASSERT_EQ(k.q[i], codes[i]) << dtype_info(t).name << " element " << i;
    }
  }
}

TEST(GptqHessian, IsTheSumOfOuterProducts) {
  const int64_t n = 300, rows = 40;  // wider than one 128-row strip of the parallel update
  const auto x = gaussian(size_t(rows * n), 11);
  Hessian h(n);
  h.add(x.data(), 25);
  h.add(x.data() + 25 * n, rows - 25);
  EXPECT_EQ(h.rows, double(rows));
  for (int64_t i = 0; i < n; i += 7)
    for (int64_t j = 0; j <= i; j += 5) {
      double s = 0;
      for (int64_t r = 0; r < rows; ++r) s += double(x[size_t(r * n + i)]) * x[size_t(r * n + j)];
      EXPECT_NEAR(h.h[size_t(i * n + j)], s, 1e-4 * (1 + std::fabs(s))) << i << "," << j;
    }
  EXPECT_NEAR(h.mean_square()[5], h.h[5 * n + 5] / rows, 1e-6);
}

// Each dequantized value of row `q` is the point of its block's grid nearest to `w` (math: a diagonal
// Hessian spreads no error, so GPTQ only rounds).
void expect_nearest_on_grid(DType t, const float* w, const uint8_t* q, int64_t cols) {
  std::vector<float> y(static_cast<size_t>(cols));
  dequantize_row(t, q, y.data(), size_t(cols));
  const size_t block = is_kquant(t) ? 256 : 32, bytes = row_bytes(t, block);
  for (int64_t b = 0; b < cols / int64_t(block); ++b) {
    std::vector<uint8_t> probe(q + b * bytes, q + (b + 1) * bytes);
    for (size_t i = 0; i < block; ++i) {
      const size_t j = b * block + i;
      float best = INFINITY;
      const CodeRange r = code_range(t);
      for (int c = r.lo; c <= r.hi; ++c) {  // every code at this position, the scales kept
        int8_t codes[256];
        float out[256];
        if (is_kquant(t)) {
          BlockK k;
          unpack_block_k(t, probe.data(), k);
          std::copy(k.q, k.q + 256, codes);
        } else {
          Block32 k;
          unpack_block32(t, probe.data(), k);
          std::copy(k.q, k.q + 32, codes);
        }
        codes[i] = int8_t(c);
        std::vector<uint8_t> alt = probe;
        if (is_kquant(t)) pack_codes_k(t, alt.data(), codes);
        else pack_codes32(t, alt.data(), codes);
        dequantize_row(t, alt.data(), out, block);
        best = std::min(best, std::fabs(out[i] - w[j]));
      }
      ASSERT_LE(std::fabs(y[j] - w[j]), best * (1 + 1e-5f) + 1e-7f) << dtype_info(t).name << " column " << j;
    }
  }
}

// Each row of w[rows][cols] quantized alone by the type's own search (`importance` may be null).
std::vector<uint8_t> rtn_rows(DType t, const std::vector<float>& w, int64_t rows, int64_t cols, const float* importance) {
  const size_t rb = row_bytes(t, size_t(cols));
  std::vector<uint8_t> q(size_t(rows) * rb);
  for (int64_t r = 0; r < rows; ++r) quantize_row(t, w.data() + r * cols, q.data() + size_t(r) * rb, size_t(cols), importance);
  return q;
}

// GPTQ's output error on w is below `ratio` times round-to-nearest's (the type's search with the
// Hessian's mean squares as importances, as GPTQ's own block search has them).
void expect_gptq_beats_rtn(DType t, const std::vector<float>& w, int64_t rows, int64_t cols, const Hessian& h, double ratio) {
  const double e_rtn = gptq_output_error(t, w.data(), rtn_rows(t, w, rows, cols, h.mean_square().data()).data(), rows, cols, h);
  const double e_gptq = gptq_output_error(t, w.data(), gptq_quantize(t, w.data(), rows, cols, h).data(), rows, cols, h);
  EXPECT_LT(e_gptq, ratio * e_rtn) << dtype_info(t).name << ": GPTQ " << e_gptq << ", RTN " << e_rtn;
}

TEST(Gptq, IndependentInputsOnlyRound) {
  const int64_t rows = 4, cols = 512, n = 2 * cols;
  for (DType t : kTypes) {
    if (t == DType::IQ4_NL) continue;  // its grid is its levels: checked in CorrelatedInputs
    std::vector<float> x(size_t(n * cols), 0.0f);  // one active column per input row: H diagonal
    for (int64_t r = 0; r < n; ++r) x[size_t(r * cols + r % cols)] = (r < cols ? 1.0f : -2.0f) * float(1 + r % 5);
    Hessian h(cols);
    h.add(x.data(), n);
    const auto w = gaussian(size_t(rows * cols), 5);
    const auto q = gptq_quantize(t, w.data(), rows, cols, h, 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      expect_nearest_on_grid(t, w.data() + r * cols, q.data() + r * row_bytes(t, size_t(cols)), cols);
  }
}

TEST(Gptq, CorrelatedInputsLowerTheOutputError) {
  const int64_t rows = 16, cols = 512, n = 2048;
  const auto x = correlated_inputs(n, cols, 21);
  Hessian h(cols);
  h.add(x.data(), n);
  const auto w = gaussian(size_t(rows * cols), 9, 0.05f);
  for (DType t : kTypes) expect_gptq_beats_rtn(t, w, rows, cols, h, 0.8);
}

// A row of zeros has nothing to round and no error to spread: it comes back as zeros in every type,
// and the rows beside it are unchanged by it (each row is rounded on its own).
TEST(Gptq, ZeroRowsStayZero) {
  const int64_t rows = 3, cols = 512, n = 1024;
  const auto x = correlated_inputs(n, cols, 6);
  Hessian h(cols);
  h.add(x.data(), n);
  const auto w = gaussian(size_t(rows * cols), 12, 0.05f);
  auto w0 = w;
  std::fill(w0.begin() + cols, w0.begin() + 2 * cols, 0.0f);  // row 1
  for (DType t : kTypes) {
    const size_t rb = row_bytes(t, size_t(cols));
    const auto q = gptq_quantize(t, w.data(), rows, cols, h), q0 = gptq_quantize(t, w0.data(), rows, cols, h);
    std::vector<float> y(static_cast<size_t>(cols));
    dequantize_row(t, q0.data() + rb, y.data(), size_t(cols));
    for (float v : y) ASSERT_EQ(v, 0.0f) << dtype_info(t).name;
    EXPECT_TRUE(std::equal(q.begin(), q.begin() + long(rb), q0.begin())) << dtype_info(t).name;
    EXPECT_TRUE(std::equal(q.begin() + long(2 * rb), q.end(), q0.begin() + long(2 * rb))) << dtype_info(t).name;
  }
}

// Inputs whose column j + 256 repeats column j (plus a little noise): the correlated columns sit in
// different groups of 256, so only the update of the later groups (one product per group) can use it.
TEST(Gptq, ErrorsReachTheLaterGroups) {
  const int64_t rows = 8, cols = 512, n = 1024;
  auto x = gaussian(size_t(n * cols), 31);
  const auto noise = gaussian(size_t(n * cols), 32, 0.05f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 256; j < cols; ++j) x[size_t(r * cols + j)] = x[size_t(r * cols + j - 256)] + noise[size_t(r * cols + j)];
  Hessian h(cols);
  h.add(x.data(), n);
  const auto w = gaussian(size_t(rows * cols), 33, 0.05f);
  for (DType t : {DType::Q4_0, DType::Q4_K}) expect_gptq_beats_rtn(t, w, rows, cols, h, 0.6);
}

// gptq_output_error against the sum written out: (w - q) H (w - q)^T per row, over the row count.
TEST(Gptq, OutputErrorIsTheHessianNorm) {
  const int64_t rows = 3, cols = 64, n = 100;
  const auto x = correlated_inputs(n, cols, 41);
  Hessian h(cols);
  h.add(x.data(), n);
  const auto w = gaussian(size_t(rows * cols), 42);
  const auto q = rtn_rows(DType::Q4_0, w, rows, cols, nullptr);
  double want = 0;
  std::vector<float> y(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(DType::Q4_0, q.data() + r * row_bytes(DType::Q4_0, size_t(cols)), y.data(), size_t(cols));
    for (int64_t a = 0; a < cols; ++a)
      for (int64_t b = 0; b < cols; ++b)
        want += double(w[size_t(r * cols + a)] - y[size_t(a)]) * h.h[size_t(a * cols + b)] * double(w[size_t(r * cols + b)] - y[size_t(b)]);
  }
  want /= double(n);
  EXPECT_NEAR(gptq_output_error(DType::Q4_0, w.data(), q.data(), rows, cols, h), want, 1e-6 * want);
}

// The integer block types, and nothing else.
TEST(Gptq, SupportsTheIntegerBlockTypesOnly) {
  for (DType t : kTypes) EXPECT_TRUE(gptq_supports(t)) << dtype_info(t).name;
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::F8_E4M3}) EXPECT_FALSE(gptq_supports(t)) << int(t);
}

TEST(Gptq, DeadColumnsBecomeZeroAndBadInputIsRefused) {
  const int64_t rows = 2, cols = 64, n = 64;
  auto x = gaussian(size_t(n * cols), 4);
  for (int64_t r = 0; r < n; ++r) x[size_t(r * cols + 10)] = 0;  // column 10 never sees an input
  Hessian h(cols);
  h.add(x.data(), n);
  const auto w = gaussian(size_t(rows * cols), 8);
  const auto q = gptq_quantize(DType::Q8_0, w.data(), rows, cols, h);
  std::vector<float> y(static_cast<size_t>(cols));
  dequantize_row(DType::Q8_0, q.data(), y.data(), size_t(cols));
  EXPECT_EQ(y[10], 0.0f);
  // Without damping the dead column's pivot must still be set (else the factorisation has a zero).
  const auto undamped = gptq_quantize(DType::Q8_0, w.data(), rows, cols, h, 0.0f);
  dequantize_row(DType::Q8_0, undamped.data(), y.data(), size_t(cols));
  EXPECT_EQ(y[10], 0.0f);
  for (size_t j = 0; j < y.size(); ++j) ASSERT_TRUE(std::isfinite(y[j]) && (j == 10 || std::fabs(y[j] - w[j]) < 0.5f)) << j;
  EXPECT_THROW(gptq_quantize(DType::F16, w.data(), rows, cols, h), Error);
  EXPECT_THROW(gptq_quantize(DType::Q8_0, w.data(), rows, 32, h), Error);
  EXPECT_THROW(gptq_quantize(DType::Q8_0, w.data(), rows, cols, h, -1.0f), Error);
}

}  // namespace
}  // namespace serval
