// cpu::lora_update at every ISA level this CPU runs, against ref::lora_update (sums in double), and its
// batch invariance: a token's update is the same bits alone as beside other tokens and adapters.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/isa.h"
#include "kernels/ops.h"

namespace serval {
namespace {

using cpu::Isa;

class LoraLevel : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (int(GetParam()) > int(cpu::detected_isa()))
      GTEST_SKIP() << "ISA level " << cpu::isa_name(GetParam()) << " cannot run on this CPU";
    cpu::force_isa(GetParam());
  }
  void TearDown() override { cpu::force_isa(saved_); }
  const Isa saved_ = cpu::active_isa();
};

struct Adapter {
  int64_t rank;
  std::vector<float> a, bt;
};

// Shapes with tails at every stage: `in` not a multiple of 32 or 8, `out` past a 256-output chunk.
constexpr int64_t kIn = 203, kOut = 301, kTok = 7;

std::vector<float> random_floats(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = d(rng);
  return v;
}

TEST_P(LoraLevel, EqualsReferenceAndIsBatchInvariant) {
  std::mt19937 rng(42);
  std::vector<Adapter> adapters;
  for (int64_t rank : {4, 16, 3}) adapters.push_back({rank, random_floats(rng, size_t(rank * kIn), 0.1f), random_floats(rng, size_t(rank * kOut), 0.1f)});
  const std::vector<float> x = random_floats(rng, kTok * kIn, 1.0f), y0 = random_floats(rng, kTok * kOut, 1.0f);
  // Tokens 0, 3, 5 use adapter 0; 1 and 6 adapter 1; 2 adapter 2; 4 none.
  const std::vector<std::vector<int64_t>> tokens = {{0, 3, 5}, {1, 6}, {2}};
  const std::vector<std::vector<float>> factors = {{2.0f, 0.5f, 1.0f}, {1.0f, -1.0f}, {0.25f}};
  std::vector<cpu::LoraSegment> segs;
  for (size_t s = 0; s < adapters.size(); ++s)
    segs.push_back({adapters[s].a.data(), adapters[s].bt.data(), adapters[s].rank, tokens[s], factors[s]});
  std::vector<float> got = y0, want = y0;
  cpu::lora_update(segs, kIn, kOut, x.data(), got.data());
  ref::lora_update(segs, kIn, kOut, x.data(), want.data());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - want[i]);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-5 * (1 + std::abs(want[i]))) << "value " << i;
  }
  EXPECT_EQ(got[4 * kOut + 7], y0[4 * kOut + 7]) << "a token without an adapter is untouched";
  EXPECT_NE(got[0], y0[0]) << "the update is applied";
  // Token 5 alone (its segment of one) gives the same bits as in the batch above.
  std::vector<float> alone = y0;
  const std::vector<int64_t> t5 = {5};
  const std::vector<float> f5 = {1.0f};
  const cpu::LoraSegment one = {adapters[0].a.data(), adapters[0].bt.data(), adapters[0].rank, t5, f5};
  cpu::lora_update({&one, 1}, kIn, kOut, x.data(), alone.data());
  for (int64_t i = 0; i < kOut; ++i) ASSERT_EQ(alone[5 * kOut + i], got[5 * kOut + i]) << "output " << i;
  RecordProperty("worst_abs_error", std::to_string(worst));
}

// The scalar level's arithmetic written out (float sums in order, no FMA: this file, like lora.cpp's
// scalar level, is built for the baseline ISA): the scalar level gives exactly these bits, and the SIMD
// levels (FMA, lane sums) do not, so each level is seen to run its own loops.
TEST_P(LoraLevel, EachLevelRunsItsOwnLoops) {
  std::mt19937 rng(5);
  const int64_t rank = 8;
  const std::vector<float> a = random_floats(rng, size_t(rank * kIn), 0.1f), bt = random_floats(rng, size_t(rank * kOut), 0.1f);
  const std::vector<float> x = random_floats(rng, kTok * kIn, 1.0f), y0 = random_floats(rng, kTok * kOut, 1.0f);
  std::vector<int64_t> tokens(kTok);
  for (int64_t t = 0; t < kTok; ++t) tokens[size_t(t)] = t;
  const std::vector<float> factors(kTok, 0.75f);
  const cpu::LoraSegment seg = {a.data(), bt.data(), rank, tokens, factors};
  std::vector<float> got = y0, plain = y0;
  cpu::lora_update({&seg, 1}, kIn, kOut, x.data(), got.data());
  for (int64_t t = 0; t < kTok; ++t) {
    std::vector<float> mid(static_cast<size_t>(rank));
    for (int64_t r = 0; r < rank; ++r) {
      volatile float acc = 0;  // volatile: no contraction into an FMA, no reordering
      for (int64_t c = 0; c < kIn; ++c) acc = acc + a[size_t(r * kIn + c)] * x[size_t(t * kIn + c)];
      mid[size_t(r)] = acc;
    }
    for (int64_t i = 0; i < kOut; ++i) {
      volatile float acc = 0;
      for (int64_t r = 0; r < rank; ++r) acc = acc + mid[size_t(r)] * bt[size_t(r * kOut + i)];
      plain[size_t(t * kOut + i)] += 0.75f * acc;
    }
  }
  const bool same = std::memcmp(got.data(), plain.data(), got.size() * 4) == 0;
  if (GetParam() == Isa::Scalar) EXPECT_TRUE(same) << "the scalar level must be the plain loops";
  else EXPECT_FALSE(same) << cpu::isa_name(GetParam()) << " gave the plain loops' bits: its own kernel did not run";
}

INSTANTIATE_TEST_SUITE_P(Levels, LoraLevel, ::testing::Values(Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx),
                         [](const auto& info) { return std::string(cpu::isa_name(info.param)); });

}  // namespace
}  // namespace serval
