// Float rows to each writable type, checked through the scalar dequantizer (tensor/dequant.h): every
// value comes back within half a quantization step of its block (math), zero blocks stay zero, and
// the symmetric types keep ggml's signed zeros.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/error.h"
#include "tensor/blocks.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

std::vector<float> random_row(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = g(rng) * (rng() % 4 == 0 ? 10.0f : 0.1f);
  for (size_t i = 0; i < 32; ++i) x[i] = 0;        // an all-zero block
  for (size_t i = 32; i < 64; ++i) x[i] = 0.25f;   // a constant block
  return x;
}

std::vector<float> round_trip(DType t, const std::vector<float>& x) {
  std::vector<uint8_t> q(row_bytes(t, x.size()));
  quantize_row(t, x.data(), q.data(), x.size());
  std::vector<float> y(x.size());
  dequantize_row(t, q.data(), y.data(), x.size());
  return y;
}

// Half a step of the block's grid: range / (levels - 1) / 2, with F16 scales' rounding allowed for. Q4_0
// and Q5_0 put the block's largest magnitude on level -8 (-16) and cap the other side at +7 (+15):
// a value there of the opposite sign can be a whole step off.
double tolerance(DType t, const float* x) {
  float lo = x[0], hi = x[0], amax = 0;
  for (int j = 0; j < 32; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]), amax = std::max(amax, std::fabs(x[j]));
  double step = 0;
  switch (t) {
    case DType::Q8_0: step = amax / 127.0; break;
    case DType::Q4_0: step = amax / 8.0; break;
    case DType::Q5_0: step = amax / 16.0; break;
    case DType::Q4_1: step = (hi - lo) / 15.0; break;
    case DType::Q5_1: step = (hi - lo) / 31.0; break;
    default: break;
  }
  const double steps = t == DType::Q4_0 || t == DType::Q5_0 ? 1.0 : 0.5;
  return steps * step * 1.002 + 1e-3 * amax + 1e-7;
}

TEST(Quantize, EveryTypeComesBackWithinItsStep) {
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1}) {
    SCOPED_TRACE(std::string(dtype_info(t).name));
    const auto x = random_row(32 * 40, 7);
    const auto y = round_trip(t, x);
    for (size_t b = 0; b < x.size() / 32; ++b) {
      const double tol = tolerance(t, x.data() + b * 32);
      for (size_t j = b * 32; j < (b + 1) * 32; ++j) ASSERT_LE(std::fabs(double(x[j]) - y[j]), tol) << "element " << j;
    }
    for (size_t j = 0; j < 32; ++j) EXPECT_EQ(y[j], 0.0f) << "a zero block stays zero";
  }
}

TEST(Quantize, FloatTypesRoundToNearestEven) {
  const std::vector<float> x = {1.0f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, -2.5e-8f, 65504.0f, 1e-3f, NAN, -0.0f};
  std::vector<uint8_t> h(x.size() * 2);
  quantize_row(DType::F16, x.data(), h.data(), x.size());
  std::vector<float> back(x.size());
  dequantize_row(DType::F16, h.data(), back.data(), x.size());
  EXPECT_EQ(back[1], 1.0f) << "a tie goes to the even neighbour";
  EXPECT_EQ(back[2], 1.0f + 2.0f / 1024);
  EXPECT_EQ(back[4], 65504.0f);
  EXPECT_TRUE(std::isnan(back[6]));
  EXPECT_TRUE(std::signbit(back[7]));
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80) << "tie to even";
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(NAN) & 0x7fc0, 0x7fc0) << "NaN stays a quiet NaN";
}

TEST(Quantize, SymmetricTypesKeepSignedZeros) {
  // A block whose largest magnitude is positive has a negative scale (d = max / -8): a value that
  // quantizes to the middle level comes back as -0, as ggml's q * d gives.
  std::vector<float> x(32, 0.0f);
  x[0] = 8.0f;
  const auto y = round_trip(DType::Q4_0, x);
  EXPECT_EQ(y[0], 8.0f);
  EXPECT_TRUE(std::signbit(y[1]));
}

// The grid a k-quant or IQ4_NL sub-block stores: its levels, from the scalar unpacker (tensor/blocks.h).
std::vector<double> grid_of(DType t, const uint8_t* block, int sub, int& sub_len) {
  std::vector<double> g;
  if (t == DType::IQ4_NL) {
    static const int8_t kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    Block32 b;
    unpack_block32(t, block, b);
    for (int8_t l : kLevels) g.push_back(double(b.d) * l);
    sub_len = 32;
    return g;
  }
  BlockK b;
  unpack_block_k(t, block, b);
  sub_len = b.sub_len;
  const int lo = t == DType::Q3_K ? -4 : t == DType::Q6_K ? -32 : 0;
  const int hi = t == DType::Q2_K ? 3 : t == DType::Q3_K ? 3 : t == DType::Q4_K ? 15 : 31;
  for (int l = lo; l <= hi; ++l) g.push_back(double(b.d) * b.scale[sub] * l - double(b.dmin) * b.min[sub]);
  return g;
}

// Each value of a sub-block with a non-zero scale comes back as the grid point nearest to it (the
// last step of every k-quant and IQ4_NL search re-rounds against the stored scales), and the row's
// relative RMS error is what its bits allow.
TEST(Quantize, KQuantsAndIq4nlRoundToTheirStoredGrid) {
  const std::pair<DType, double> kTypes[] = {{DType::Q2_K, 0.45}, {DType::Q3_K, 0.25}, {DType::Q4_K, 0.12},
                                             {DType::Q5_K, 0.06}, {DType::Q6_K, 0.03}, {DType::IQ4_NL, 0.12}};
  for (const auto& [t, max_rel_rms] : kTypes) {
    SCOPED_TRACE(std::string(dtype_info(t).name));
    const auto x = random_row(256 * 8, 11);
    std::vector<uint8_t> q(row_bytes(t, x.size()));
    quantize_row(t, x.data(), q.data(), x.size());
    std::vector<float> y(x.size());
    dequantize_row(t, q.data(), y.data(), x.size());
    const size_t be = dtype_info(t).block_elems, bb = dtype_info(t).block_bytes;
    double err2 = 0, sum2 = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      int sub_len = 0;
      const auto grid = grid_of(t, q.data() + i / be * bb, int(i % be) / (t == DType::Q4_K || t == DType::Q5_K ? 32 : 16), sub_len);
      err2 += (double(x[i]) - y[i]) * (double(x[i]) - y[i]), sum2 += double(x[i]) * x[i];
      if (grid.front() == grid.back()) continue;  // a zero scale: the search's levels are kept
      double best = 1e300;
      for (double g : grid) best = std::min(best, std::fabs(g - x[i]));
      ASSERT_LE(std::fabs(double(y[i]) - x[i]), best * (1 + 1e-5) + 1e-9) << "element " << i;
    }
    EXPECT_LT(std::sqrt(err2 / sum2), max_rel_rms);
    EXPECT_GT(std::sqrt(err2 / sum2), 0.0) << "a lossy type that loses nothing would mean the check is vacuous";
    for (size_t j = 0; j < 32; ++j) EXPECT_EQ(y[j], 0.0f) << "a zero block stays zero";
  }
}

// A portable input (an LCG's integers scaled by powers of two, so every value is exact on any machine):
// super-blocks of three magnitudes, some one-signed, some blocks of zeros.
std::vector<float> lcg_input(int n, uint32_t seed) {
  std::vector<float> x(static_cast<size_t>(n));
  uint32_t s = seed;
  for (int i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const int k = (i / 256) % 3;
    x[i] = float(int32_t(s) >> 8) * (k == 0 ? 1.0f / 1048576 : k == 1 ? 1.0f / 65536 : 1.0f / 16777216);
    if ((i / 256) % 5 == 4) x[i] = std::fabs(x[i]);
    if ((i / 32) % 11 == 7) x[i] = 0;
  }
  return x;
}

// Recorded output of llama.cpp's quantizers (ggml_quantize_chunk without an importance matrix, llama.cpp
// c392e5094, by a harness outside the repository) on lcg_input(256 * 64, 12345): FNV-1a 64 of the bytes.
TEST(Quantize, KQuantsAndIq4nlWriteLlamaCppsBytes) {
  const std::pair<DType, uint64_t> kRecorded[] = {
      {DType::Q2_K, 0xc0cbd12f8b17e030ull}, {DType::Q3_K, 0xfb306a4d749e6988ull}, {DType::Q4_K, 0x6d0a5b32750b091cull},
      {DType::Q5_K, 0x5e8e160eecac714full}, {DType::Q6_K, 0xbd1b0792161be680ull}, {DType::IQ4_NL, 0x4acd7c85555dec22ull},
  };
  const auto x = lcg_input(256 * 64, 12345);
  for (const auto& [t, want] : kRecorded) {
    std::vector<uint8_t> q(row_bytes(t, x.size()));
    quantize_row(t, x.data(), q.data(), x.size());
    uint64_t h = 1469598103934665603ull;
    for (uint8_t b : q) h = (h ^ b) * 1099511628211ull;
    EXPECT_EQ(h, want) << dtype_info(t).name;
  }
}

// The same with an importance for each column (an LCG's values in [1/64, 16]): llama.cpp's weighted
// searches (quantize_q*_K, quantize_iq4_nl and quantize_q4_0 .. q5_1 given quant_weights), recorded the
// same way.
TEST(Quantize, ImportanceWeightedSearchesWriteLlamaCppsBytes) {
  const std::pair<DType, uint64_t> kRecorded[] = {
      {DType::Q2_K, 0xb99bc8322f0c2a64ull}, {DType::Q3_K, 0xcd5c87fd283d3461ull}, {DType::Q4_K, 0xcc1f69e6d18d0a07ull},
      {DType::Q5_K, 0x08efe93ae602fdc4ull}, {DType::Q6_K, 0xd97f3460850cd8f4ull}, {DType::IQ4_NL, 0xfdcdb119332c559eull},
      {DType::Q4_0, 0x8e69bde4457a3232ull}, {DType::Q4_1, 0x07177cad3797f8b7ull}, {DType::Q5_0, 0x671cb0260391b0d9ull},
      {DType::Q5_1, 0x957d815201b4baafull},
  };
  const auto x = lcg_input(256 * 64, 12345);
  std::vector<float> qw(x.size());
  uint32_t s = 777;
  for (auto& w : qw) s = s * 1664525u + 1013904223u, w = float(s >> 16) / 4096.0f + 1.0f / 64;
  for (const auto& [t, want] : kRecorded) {
    std::vector<uint8_t> q(row_bytes(t, x.size()));
    quantize_row(t, x.data(), q.data(), x.size(), qw.data());
    uint64_t h = 1469598103934665603ull;
    for (uint8_t b : q) h = (h ^ b) * 1099511628211ull;
    EXPECT_EQ(h, want) << dtype_info(t).name;
  }
}

// MXFP4 against the OCP Microscaling spec: E2M1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (8..15 the
// same negated) times the E8M0 scale 2^(e - 127); ggml keeps the doubled values with 2^(e - 128).
// Quantizing picks each value's nearest representable one for the block's power of two.
TEST(Quantize, Mxfp4FollowsTheMicroscalingSpec) {
  const double e2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int e : {0, 1, 2, 100, 127, 130, 250}) {  // 6 x 2^(254 - 127) would pass FLT_MAX
    uint8_t block[17];
    block[0] = uint8_t(e);
    for (int j = 0; j < 16; ++j) block[1 + j] = uint8_t(j | ((15 - j) << 4));
    float got[32];
    dequantize_row(DType::MXFP4, block, got, 32);
    for (int j = 0; j < 32; ++j) {
      const int code = j < 16 ? j : 15 - (j - 16);
      const double want = (code < 8 ? 1 : -1) * e2m1[code % 8] * std::ldexp(1.0, e - 127);
      EXPECT_EQ(double(got[j]), want) << "e " << e << " code " << code;
    }
  }
  // Round trip: amax / scale lands in [4, 8) (doubled: [8, 16) of 12), so each value is within half of
  // the largest gap (2 doubled units, at 8..12) times the scale of the nearest representable value.
  const auto x = random_row(4096, 21);
  const auto y = round_trip(DType::MXFP4, x);
  for (size_t b = 0; b < x.size() / 32; ++b) {
    float amax = 0;
    for (size_t j = 0; j < 32; ++j) amax = std::max(amax, std::abs(x[32 * b + j]));
    const double d = amax > 0 ? std::ldexp(1.0, int(std::floor(std::log2(amax))) - 3) : 0;
    for (size_t j = 0; j < 32; ++j) {
      const double v = x[32 * b + j];
      EXPECT_LE(std::abs(y[32 * b + j] - v), std::abs(v) > 12 * d ? std::abs(v) - 12 * d + 1e-12 : 2 * d + 1e-12)
          << "block " << b << " value " << j;
    }
  }
}

TEST(Quantize, RefusesWhatItCannotWrite) {
  std::vector<float> x(256, 1.0f);
  std::vector<uint8_t> out(1024);
  EXPECT_TRUE(can_quantize_to(DType::Q4_K));
  EXPECT_THROW(quantize_row(DType::Q4_K, x.data(), out.data(), 128), Error) << "not whole super-blocks";
  EXPECT_THROW(quantize_row(DType::Q8_0, x.data(), out.data(), 40), Error) << "not whole blocks";
}

}  // namespace
}  // namespace serval
