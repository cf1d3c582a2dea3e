// Sampling: expected values from the definitions (softmax math, argmax, filters), seeded determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <unordered_map>

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

TEST(Sampler, ArgmaxIsMaxElementWithTiesNansAndInfinities) {
  // std::max_element is the definition: the first largest, NaN never larger, a NaN first element wins.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<float> v(1 + rng() % 300);
    for (float& x : v) x = float(int(rng() % 9) - 4);  // many ties
    for (int k = int(rng() % 3); k > 0; --k) v[rng() % v.size()] = std::nanf("");
    if (rng() % 4 == 0) v[rng() % v.size()] = -INFINITY;
    if (rng() % 6 == 0) v[rng() % v.size()] = INFINITY;
    if (rng() % 8 == 0) std::fill(v.begin(), v.end(), -INFINITY);
    const auto want = int32_t(std::max_element(v.begin(), v.end()) - v.begin());
    ASSERT_EQ(argmax(v), want) << "trial " << trial << ", " << v.size() << " logits";
  }
  std::vector<float> big(151936, -1.0f);
  big[151935] = 2.0f, big[77777] = 2.0f;
  EXPECT_EQ(argmax(big), 77777);
  EXPECT_EQ(argmax(std::vector<float>{std::nanf(""), 5.0f}), 0);
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

// The oracle: the straightforward implementation, independent of Sampler's partial selection and
// incremental counts. Copies the logits, recounts the penalty window over the history, sorts the
// whole vocabulary, sums in sorted order.
class ReferenceSampler {
 public:
  explicit ReferenceSampler(SamplingParams p) : p_(std::move(p)), rng_(p_.seed ^ 0x9E3779B97F4A7C15ull) {}

  SampleResult sample(std::span<const float> raw, std::span<const int32_t> history) {
    std::vector<float> logits(raw.begin(), raw.end());
    for (const auto& [id, bias] : p_.logit_bias) logits[id] += bias;
    if (p_.repeat_penalty != 1.0f || p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f) {
      const size_t window = p_.repeat_last_n < 0 ? history.size() : std::min<size_t>(history.size(), p_.repeat_last_n);
      std::map<int32_t, int> counts;
      for (size_t i = history.size() - window; i < history.size(); ++i) ++counts[history[i]];
      for (const auto& [id, count] : counts) {
        if (id < 0 || id >= int32_t(logits.size())) continue;
        float& l = logits[id];
        l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
        l -= float(count) * p_.frequency_penalty + p_.presence_penalty;
      }
    }
    const std::vector<int32_t> order = sorted_ids(logits);
    int32_t chosen = order[0];
    if (p_.temperature > 0) {
      const size_t k = p_.top_k > 0 ? std::min<size_t>(p_.top_k, order.size()) : order.size();
      const double top = logits[order[0]];
      std::vector<double> prob(k);
      double sum = 0;
      for (size_t i = 0; i < k; ++i) sum += (prob[i] = std::exp(double(logits[order[i]]) - top));
      size_t keep = k;
      if (p_.top_p < 1.0f) {
        double cum = 0;
        for (size_t i = 0; i < k; ++i) {
          cum += prob[i] / sum;
          if (cum >= p_.top_p) {
            keep = i + 1;
            break;
          }
        }
      }
      if (p_.min_p > 0.0f)
        while (keep > 1 && prob[keep - 1] < p_.min_p * prob[0]) --keep;
      std::vector<double> w(keep);
      double total = 0;
      for (size_t i = 0; i < keep; ++i) total += (w[i] = std::exp((double(logits[order[i]]) - top) / p_.temperature));
      double u = next_uniform() * total;
      chosen = order[keep - 1];
      for (size_t i = 0; i < keep; ++i) {
        if (u < w[i]) {
          chosen = order[i];
          break;
        }
        u -= w[i];
      }
    }
    // log-softmax of the raw logits, top-n from a full sort
    const float mx = *std::max_element(raw.begin(), raw.end());
    double z = 0;
    for (float l : raw) z += std::exp(double(l) - mx);
    const float log_z = mx + float(std::log(z));
    SampleResult r{chosen, raw[chosen] - log_z, {}};
    const std::vector<int32_t> raw_order = sorted_ids(raw);
    for (int32_t i = 0; i < std::min<int32_t>(p_.n_logprobs, int32_t(raw.size())); ++i)
      r.top.push_back({raw_order[i], raw[raw_order[i]] - log_z});
    return r;
  }

 private:
  SamplingParams p_;
  uint64_t rng_;

  static std::vector<int32_t> sorted_ids(std::span<const float> l) {
    std::vector<int32_t> idx(l.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    return idx;
  }
  double next_uniform() {
    uint64_t z = (rng_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return double(z >> 11) * (1.0 / 9007199254740992.0);
  }
};

void expect_same(const SampleResult& got, const SampleResult& want, const std::string& what) {
  ASSERT_EQ(got.token, want.token) << what;
  EXPECT_EQ(got.logprob, want.logprob) << what;
  ASSERT_EQ(got.top.size(), want.top.size()) << what;
  for (size_t i = 0; i < got.top.size(); ++i) {
    EXPECT_EQ(got.top[i].id, want.top[i].id) << what << " top " << i;
    EXPECT_EQ(got.top[i].logprob, want.top[i].logprob) << what << " top " << i;
  }
}

// Random logits: smooth, or coarse (many ties), or a few peaks over a flat floor.
std::vector<float> random_logits(std::mt19937& rng, size_t n) {
  std::vector<float> l(n);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  switch (rng() % 3) {
    case 0:
      for (auto& x : l) x = normal(rng);
      break;
    case 1:
      for (auto& x : l) x = float(int(rng() % 9)) * 0.5f - 2.0f;
      break;
    default:
      for (auto& x : l) x = -4.0f + 0.001f * float(rng() % 5);
      for (int k = 0; k < 4; ++k) l[rng() % n] = 6.0f + float(rng() % 3);
  }
  return l;
}

TEST(Sampler, MatchesTheFullSortReference) {
  std::mt19937 rng(12345);
  const std::vector<size_t> vocabs = {1, 2, 7, 64, 1000, 1024, 1025, 3000, 6000};
  int configs = 0;
  for (int trial = 0; trial < 500; ++trial) {
    const size_t n = vocabs[rng() % vocabs.size()];
    SamplingParams p;
    // 1.0 takes the untempered probabilities directly; 1.1 is close to it but must not.
    const float temps[] = {0.0f, 0.3f, 1.0f, 1.1f, 1.7f};
    p.temperature = temps[rng() % 5];
    const int32_t ks[] = {0, 1, 5, 40, int32_t(n), int32_t(n) + 10, 2000, 1024};
    p.top_k = ks[rng() % 8];
    const float ps[] = {1.0f, 0.95f, 0.5f, 0.01f, 0.999999f};
    p.top_p = ps[rng() % 5];
    const float mins[] = {0.0f, 0.05f, 0.5f, 1.0f};
    p.min_p = mins[rng() % 4];
    if (rng() % 2) {
      p.repeat_penalty = 1.3f;
      p.presence_penalty = 0.4f;
      p.frequency_penalty = 0.25f;
      const int32_t windows[] = {-1, 0, 1, 5, 64};
      p.repeat_last_n = windows[rng() % 5];
    }
    if (rng() % 3 == 0) p.logit_bias = {{int32_t(rng() % n), 3.0f}, {int32_t(rng() % n), -100.0f}};
    const int32_t tops[] = {0, 1, 3, 20};
    p.n_logprobs = tops[rng() % 4];
    p.seed = rng();
    Sampler sampler(p);
    ReferenceSampler reference(p);
    std::vector<int32_t> history;
    for (int k = int(rng() % 20); k > 0; --k) history.push_back(int32_t(rng() % n));
    for (int step = 0; step < 12; ++step) {
      const auto logits = random_logits(rng, n);
      const std::string what = "trial " + std::to_string(trial) + " step " + std::to_string(step) + " vocab " +
                               std::to_string(n) + " T " + std::to_string(p.temperature) + " k " +
                               std::to_string(p.top_k) + " p " + std::to_string(p.top_p) + " min_p " +
                               std::to_string(p.min_p) + " window " + std::to_string(p.repeat_last_n);
      const SampleResult want = reference.sample(logits, history);
      const SampleResult got = sampler.sample(logits, history);
      expect_same(got, want, what);
      if (::testing::Test::HasFatalFailure()) return;
      history.push_back(got.token);
    }
    ++configs;
  }
  EXPECT_EQ(configs, 500);
}

TEST(Sampler, LargeVocabularyWithoutTopKMatchesTheReference) {
  // A 150k vocabulary with top-k off (the HTTP API's default): the candidate order is only sorted
  // as far as the draw needs.
  std::mt19937 rng(99);
  const size_t n = 150000;
  for (float top_p : {1.0f, 0.9f}) {
    for (float temperature : {1.0f, 0.7f}) {
      SamplingParams p;
      p.temperature = temperature;
      p.top_k = 0;
      p.top_p = top_p;
      p.min_p = 0;
      p.seed = 5;
      p.n_logprobs = 5;
      Sampler sampler(p);
      ReferenceSampler reference(p);
      for (int step = 0; step < 3; ++step) {
        std::vector<float> logits(n);
        std::normal_distribution<float> normal(0.0f, step % 2 ? 1.0f : 4.0f);
        for (auto& x : logits) x = normal(rng);
        expect_same(sampler.sample(logits, {}), reference.sample(logits, {}), "step " + std::to_string(step));
      }
    }
  }
}

TEST(Sampler, TiesGoToTheLowestIdEverywhere) {
  const std::vector<float> flat(10, 1.0f);
  EXPECT_EQ(argmax(flat), 0);
  SamplingParams p = greedy();
  p.n_logprobs = 3;
  const auto r = Sampler(p).sample(flat, {});
  EXPECT_EQ(r.token, 0);
  ASSERT_EQ(r.top.size(), 3u);
  EXPECT_EQ(r.top[0].id, 0);
  EXPECT_EQ(r.top[1].id, 1);
  EXPECT_EQ(r.top[2].id, 2);
  // top-k 1 over ties keeps the lowest id, whatever the temperature.
  p.temperature = 2.0f;
  p.top_k = 1;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    p.seed = seed;
    EXPECT_EQ(Sampler(p).sample(flat, {}).token, 0);
  }
  // top-k larger than the vocabulary is the whole vocabulary.
  p.top_k = 1000;
  p.top_p = 1;
  p.min_p = 0;
  std::set<int32_t> seen;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    p.seed = seed;
    seen.insert(Sampler(p).sample(flat, {}).token);
  }
  EXPECT_EQ(seen.size(), flat.size());
}

TEST(Sampler, PenaltiesLookBackOverTheLast64TokensByDefault) {
  EXPECT_EQ(SamplingParams{}.repeat_last_n, 64);
  SamplingParams p = greedy();
  p.repeat_penalty = 2.0f;
  std::vector<int32_t> history = {1};  // token 1 (logit 3.0) is penalized to 1.5 < 2.9
  Sampler s(p);
  EXPECT_EQ(s.sample(kLogits, history).token, 4);
  for (int i = 0; i < 63; ++i) history.push_back(0);
  EXPECT_EQ(s.sample(kLogits, history).token, 4) << "64 tokens back: still in the window";
  history.push_back(0);
  EXPECT_EQ(s.sample(kLogits, history).token, 1) << "65 tokens back: out of the window";
  p.repeat_last_n = -1;  // the whole history
  EXPECT_EQ(Sampler(p).sample(kLogits, history).token, 4);
  p.repeat_last_n = 0;  // none
  EXPECT_EQ(Sampler(p).sample(kLogits, std::vector<int32_t>{1}).token, 1);
}

TEST(Sampler, AHistoryThatIsNotAnExtensionIsRecounted) {
  // The counts are incremental for a growing history; any other history gets a fresh count.
  SamplingParams p = greedy();
  p.frequency_penalty = 0.06f;  // two occurrences of token 1: 3.0 - 0.12 < 2.9
  p.repeat_last_n = -1;
  Sampler s(p);
  EXPECT_EQ(s.sample(kLogits, std::vector<int32_t>{1, 1}).token, 4);
  EXPECT_EQ(s.sample(kLogits, std::vector<int32_t>{1}).token, 1) << "shorter";
  EXPECT_EQ(s.sample(kLogits, std::vector<int32_t>{1, 0, 1}).token, 4) << "extends {1}";
  EXPECT_EQ(s.sample(kLogits, std::vector<int32_t>{0, 0, 2, 3}).token, 1) << "differs at the last token counted";
  EXPECT_EQ(s.sample(kLogits, std::vector<int32_t>{}).token, 1) << "empty";
  // Tokens outside the vocabulary are counted but change nothing.
  EXPECT_EQ(s.sample(kLogits, std::vector<int32_t>{-5, 99, 1}).token, 1);
}

TEST(Sampler, IncrementalWindowCountsMatchARecountOverLongHistories) {
  std::mt19937 rng(3);
  for (int32_t window : {-1, 0, 1, 7, 64, 300}) {
    SamplingParams p;
    p.temperature = 0.8f;
    p.top_k = 0;
    p.top_p = 1;
    p.min_p = 0;
    p.repeat_penalty = 1.1f;
    p.presence_penalty = 0.3f;
    p.frequency_penalty = 0.2f;
    p.repeat_last_n = window;
    p.seed = uint64_t(window + 10);
    Sampler sampler(p);
    ReferenceSampler reference(p);
    std::vector<int32_t> history;
    for (int step = 0; step < 400; ++step) {
      std::vector<float> logits(50);
      for (auto& x : logits) x = float(rng() % 100) * 0.05f;
      const auto want = reference.sample(logits, history);
      expect_same(sampler.sample(logits, history), want, "window " + std::to_string(window) + " step " + std::to_string(step));
      if (::testing::Test::HasFatalFailure()) return;
      history.push_back(want.token);
      if (step % 50 == 7) history.push_back(int32_t(rng() % 50));  // prompt-like tokens between samples
    }
  }
}

TEST(Sampler, TheLogprobCanBeSkippedWithoutChangingTheTokens) {
  std::mt19937 rng(8);
  for (float temperature : {0.0f, 0.9f}) {
    SamplingParams p;
    p.temperature = temperature;
    p.seed = 4;
    SamplingParams skip = p;
    skip.compute_logprob = false;
    Sampler a(p), b(skip);
    for (int step = 0; step < 50; ++step) {
      const auto logits = random_logits(rng, 300);
      const auto full = a.sample(logits, {});
      const auto lean = b.sample(logits, {});
      EXPECT_EQ(lean.token, full.token);
      EXPECT_TRUE(std::isnan(lean.logprob));
      EXPECT_TRUE(lean.top.empty());
    }
  }
  SamplingParams p = greedy();
  p.compute_logprob = false;
  p.n_logprobs = 2;  // asked for the top: computed anyway
  const auto r = Sampler(p).sample(kLogits, {});
  EXPECT_FALSE(std::isnan(r.logprob));
  EXPECT_EQ(r.top.size(), 2u);
}

}  // namespace
}  // namespace serval
