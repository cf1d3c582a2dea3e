// Sampling: expected values from the definitions (softmax math, argmax, filters), seeded determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "base/error.h"
#include "sampling/sampler.h"

namespace serval {
namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, 2.0f, 0.5f, 2.9f, -1.0f};

SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0;
  return p;
}

TEST(Sampler, GreedyIsArgmax) {
  Sampler s(greedy());
  EXPECT_EQ(s.sample(kLogits, {}).token, 1);
  EXPECT_EQ(argmax(std::vector<float>{2, 5, 5, 1}), 1);  // ties: lowest id
}

TEST(Sampler, LogprobsAreLogSoftmax) {
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  const auto r = logprobs_of(kLogits, 2, 3);
  EXPECT_NEAR(r.logprob, 2.0 - std::log(z), 1e-6);
  ASSERT_EQ(r.top.size(), 3u);
  EXPECT_EQ(r.top[0].id, 1);
  EXPECT_EQ(r.top[1].id, 4);
  EXPECT_EQ(r.top[2].id, 2);
  EXPECT_NEAR(r.top[0].logprob, 3.0 - std::log(z), 1e-6);
}

TEST(Sampler, SameSeedSameTokensDifferentSeedDifferent) {
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 0;
  p.top_p = 1;
  p.min_p = 0;
  auto run = [&](uint64_t seed) {
    p.seed = seed;
    Sampler s(p);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(kLogits, {}).token);
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, FrequenciesFollowTemperedSoftmax) {
  SamplingParams p;
  p.temperature = 2.0f;
  p.top_k = 0;
  p.top_p = 1;
  p.min_p = 0;
  p.seed = 7;
  Sampler s(p);
  std::map<int32_t, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++counts[s.sample(kLogits, {}).token];
  double z = 0;
  for (float l : kLogits) z += std::exp(l / 2.0);
  for (int32_t id = 0; id < int32_t(kLogits.size()); ++id)
    EXPECT_NEAR(counts[id] / double(n), std::exp(kLogits[id] / 2.0) / z, 0.01) << id;
}

TEST(Sampler, TopKTopPMinPRestrictCandidates) {
  auto support = [](SamplingParams p) {
    p.temperature = 5.0f;
    std::set<int32_t> seen;
    for (uint64_t seed = 0; seed < 300; ++seed) {
      p.seed = seed;
      Sampler s(p);
      seen.insert(s.sample(kLogits, {}).token);
    }
    return seen;
  };
  SamplingParams k;
  k.top_k = 2, k.top_p = 1, k.min_p = 0;
  EXPECT_EQ(support(k), (std::set<int32_t>{1, 4}));
  // softmax of kLogits: p1 ~ 0.376, p4 ~ 0.340, p2 ~ 0.138: top-p 0.7 keeps {1, 4}.
  SamplingParams tp;
  tp.top_k = 0, tp.top_p = 0.7f, tp.min_p = 0;
  EXPECT_EQ(support(tp), (std::set<int32_t>{1, 4}));
  // min-p 0.3: keep tokens with p >= 0.3 * p_max, i.e. logit >= 3 + ln 0.3 = 1.796.
  SamplingParams mp;
  mp.top_k = 0, mp.top_p = 1, mp.min_p = 0.3f;
  EXPECT_EQ(support(mp), (std::set<int32_t>{1, 2, 4}));
}

TEST(Sampler, PenaltiesAndLogitBias) {
  SamplingParams p = greedy();
  p.logit_bias = {{5, 10.0f}};
  EXPECT_EQ(Sampler(p).sample(kLogits, {}).token, 5);
  // Repetition penalty 2 on token 1: 3.0 / 2 = 1.5 < 2.9, so token 4 wins.
  p = greedy();
  p.repeat_penalty = 2.0f;
  const std::vector<int32_t> history = {1};
  EXPECT_EQ(Sampler(p).sample(kLogits, history).token, 4);
  // Frequency penalty 0.06 x 2 occurrences: 3.0 - 0.12 = 2.88 < 2.9.
  p = greedy();
  p.frequency_penalty = 0.06f;
  const std::vector<int32_t> twice = {1, 1};
  EXPECT_EQ(Sampler(p).sample(kLogits, twice).token, 4);
  p.frequency_penalty = 0;
  p.presence_penalty = 0.05f;  // 2.95 > 2.9: still token 1
  EXPECT_EQ(Sampler(p).sample(kLogits, twice).token, 1);
}

TEST(Sampler, ValidationRejectsImpossibleParameters) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_THROW(p.validate(10), Error);
  p = {};
  p.top_p = 0;
  EXPECT_THROW(p.validate(10), Error);
  p = {};
  p.logit_bias = {{10, 1.0f}};
  EXPECT_THROW(p.validate(10), Error);
  p = {};
  p.n_logprobs = 21;
  EXPECT_THROW(p.validate(10), Error);
  EXPECT_NO_THROW(SamplingParams{}.validate(10));
}

}  // namespace
}  // namespace serval
