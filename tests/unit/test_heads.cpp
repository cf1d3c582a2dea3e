// Decoding heads: the hand-written backprop against finite differences of the loss, training that
// lowers the loss, the GGUF round trip with its checks, and the frequency-ranked vocabulary; for
// Medusa heads and for token-input (Hydra-style) heads, whose guesses are checked against a scalar
// reference of the block computed here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <set>

#include "base/error.h"
#include "engine/heads.h"
#include "io/gguf_writer.h"
#include "model/model.h"
#include "test_support.h"

namespace serval {
namespace {

std::unique_ptr<Model> stories() { return Model::load(test::shared_path("models/stories260K.gguf")); }

// Random heads and data on stories260K's sizes (n_embd 64), vocabulary subset of 40 tokens.
struct Fixture {
  std::unique_ptr<Model> m = stories();
  DecodingHeads heads;
  std::vector<float> h;
  std::vector<int32_t> labels;
  explicit Fixture(int rows = 12, bool token_input = false) {
    std::vector<int32_t> vocab;
    for (int i = 0; i < 40; ++i) vocab.push_back(3 + 7 * i);
    heads = DecodingHeads::create(*m, 2, vocab, token_input);
    std::mt19937 rng(5);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto& w : heads.w) for (auto& x : w) x = 0.1f * n(rng);
    for (auto& b : heads.b) for (auto& x : b) x = 0.1f * n(rng);
    for (int64_t i = 0; i < rows * heads.n_in(); ++i) h.push_back(n(rng));  // input rows (x)
    for (int r = 0; r < rows; ++r) labels.push_back(r % 5 == 4 ? -1 : int32_t(rng() % 40));
  }
};

class HeadKinds : public ::testing::TestWithParam<bool> {};  // token_input: false (Medusa), true (Hydra)
INSTANTIATE_TEST_SUITE_P(DecodingHeads, HeadKinds, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "TokenInput" : "Medusa"; });

TEST_P(HeadKinds, GradientsMatchFiniteDifferences) {
  Fixture f(12, GetParam());
  HeadTrainer t(f.heads, 1e-3f);
  std::vector<float> dw, db;
  t.gradients(1, f.h, f.labels, dw, db);
  const float eps = 1e-2f;
  std::mt19937 rng(9);
  for (int trial = 0; trial < 20; ++trial) {
    const bool bias = trial % 4 == 0;
    auto& p = bias ? f.heads.b[1] : f.heads.w[1];
    const size_t i = rng() % p.size();
    const float keep = p[i];
    p[i] = keep + eps;
    const double up = t.loss(1, f.h, f.labels);
    p[i] = keep - eps;
    const double down = t.loss(1, f.h, f.labels);
    p[i] = keep;
    const double numeric = (up - down) / (2 * eps), analytic = bias ? db[i] : dw[i];
    EXPECT_NEAR(analytic, numeric, 2e-3 + 0.02 * std::abs(numeric)) << (bias ? "b" : "W") << "[" << i << "]";
  }
  EXPECT_NEAR(t.gradients(1, f.h, f.labels, dw, db), t.loss(1, f.h, f.labels), 1e-4) << "the loss both ways";
}

// The block against its formula in double, a = x[:n_embd] + SiLU(W x + b) and z = W x + b, and it writes
// n_embd values of a and z, not one more: sentinels after them stay as they were.
TEST_P(HeadKinds, TheBlockWritesItsFormulaAndNothingPastIt) {
  Fixture f(1, GetParam());
  const size_t d = size_t(f.heads.n_embd), in = size_t(f.heads.n_in());
  const float sentinel = 12345.0f;
  std::vector<float> a(d + 4, sentinel), z(d + 4, sentinel);
  f.heads.block(1, f.h.data(), a.data(), z.data());
  for (size_t i = 0; i < d; ++i) {
    double zi = f.heads.b[1][i];
    for (size_t j = 0; j < in; ++j) zi += double(f.heads.w[1][i * in + j]) * f.h[j];
    EXPECT_NEAR(z[i], zi, 1e-4) << "z[" << i << "]";
    EXPECT_NEAR(a[i], f.h[i] + zi / (1 + std::exp(-zi)), 1e-4) << "a[" << i << "]";
  }
  for (size_t i = d; i < d + 4; ++i) {
    EXPECT_EQ(a[i], sentinel) << "a written past n_embd at " << i;
    EXPECT_EQ(z[i], sentinel) << "z written past n_embd at " << i;
  }
}

// Adam's first step, with its bias correction, moves every parameter whose gradient is well above eps
// by the learning rate against the gradient's sign (m / sqrt(v) = g / |g| at t = 1).
TEST_P(HeadKinds, AdamsFirstStepMovesEachParameterByTheLearningRate) {
  Fixture f(12, GetParam());
  const float lr = 1e-3f;
  HeadTrainer t(f.heads, lr);
  std::vector<float> dw, db;
  t.gradients(1, f.h, f.labels, dw, db);
  const std::vector<float> before = f.heads.w[1];
  t.step(1, f.h, f.labels);
  int checked = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    if (std::abs(dw[i]) < 1e-5f) continue;
    EXPECT_NEAR(before[i] - f.heads.w[1][i], dw[i] > 0 ? lr : -lr, 1e-3 * lr) << "W[" << i << "]";
    ++checked;
  }
  EXPECT_GT(checked, int(before.size() / 2));
}

TEST_P(HeadKinds, TrainingLowersTheLossAndOnlyTheTrainedHeadMoves) {
  Fixture f(64, GetParam());
  HeadTrainer t(f.heads, 3e-3f);
  const auto other = f.heads.w[0];
  const double before = t.loss(1, f.h, f.labels);
  for (int s = 0; s < 150; ++s) t.step(1, f.h, f.labels);
  EXPECT_LT(t.loss(1, f.h, f.labels), 0.75 * before) << "random labels: slow to fit, but they must be fitted";
  EXPECT_EQ(f.heads.w[0], other);
  // Unlabelled rows carry no gradient.
  std::vector<float> dw, db;
  EXPECT_EQ(t.gradients(0, f.h, std::vector<int32_t>(64, -1), dw, db), 0.0);
  for (float g : dw) ASSERT_EQ(g, 0.0f);
}

// Proposing reads quantized copies of the matrices (prepare_to_propose, Q4_0 by default): the scores
// stay within the type's rounding of the F32 heads', and the guesses mostly agree. Q4_0 rounds more
// coarsely than Q8_0 (16 levels against 256), so its error is the larger one.
struct PreparedError {
  double mean = 0;  // mean |error| against the largest score
  double max = 0;   // largest |error| against the largest score
  int agree = 0;    // guesses equal to the F32 heads' (of 128)
};

PreparedError prepared_error(const Fixture& f, const DecodingHeads& prepared) {
  PreparedError e;
  double err = 0, scale = 0;
  for (int r = 0; r < 64; ++r)
    for (int k = 0; k < 2; ++k) {
      const float* x = f.h.data() + r * f.heads.n_in();
      const std::vector<float> want = f.heads.scores(k, x), got = prepared.scores(k, x);
      float spread = 0;
      for (float v : want) spread = std::max(spread, std::abs(v));
      for (size_t v = 0; v < want.size(); ++v) {
        e.max = std::max(e.max, double(std::abs(got[v] - want[v]) / spread));
        err += std::abs(got[v] - want[v]), scale += spread;
      }
      e.agree += prepared.guess(k, x) == f.heads.guess(k, x);
    }
  e.mean = err / scale;
  return e;
}

TEST_P(HeadKinds, PreparedHeadsScoreAsTheF32Heads) {
  Fixture f(64, GetParam());
  for (auto& w : f.heads.w) for (auto& x : w) x *= 5.0f;  // weights that matter
  DecodingHeads q8 = f.heads, prepared = f.heads;
  q8.prepare_to_propose(DType::Q8_0);
  prepared.prepare_to_propose();
  ASSERT_NE(prepared.quantized, nullptr);
  ASSERT_EQ(f.heads.quantized, nullptr);
  EXPECT_THROW(DecodingHeads(f.heads).prepare_to_propose(DType::Q5_0), Error);
  const PreparedError e8 = prepared_error(f, q8), e4 = prepared_error(f, prepared);
  EXPECT_LT(e8.max, 0.1) << "Q8_0: largest error against the largest score";
  EXPECT_LT(e8.mean, 0.01) << "Q8_0: mean error";
  EXPECT_GE(e8.agree, 100) << "Q8_0: of 128 guesses";
  // Q4_0 (the default): a step of a block's largest weight / 8 rather than / 127, on rows of only two
  // blocks here (stories260K's 64 values), so about ten times the error and fewer guesses agreeing.
  // On the Qwen models both copies give the same accepted tokens (docs/speculative.md).
  EXPECT_LT(e4.mean, 0.15) << "Q4_0: mean error";
  // Per weight, Q4_0 rounds to a step of amax / 8 (half a step of error, a whole step where the value
  // opposite the largest one is clamped at 7 steps) and Q8_0 to amax / 127: the same weights' largest
  // score error may grow by 127 / 8 ~ 16 times, twice that with clamping, not more.
  EXPECT_LT(e4.max, 32 * e8.max) << "Q4_0: largest error against the largest score";
  EXPECT_GE(e4.agree, 80) << "Q4_0: of 128 guesses";
  EXPECT_GT(e4.mean, 4 * e8.mean) << "the default copies are Q4_0's, not Q8_0's";
  std::printf("prepared heads: mean error Q8_0 %.4f Q4_0 %.4f, largest %.4f and %.4f, guesses agreeing %d and %d of 128\n",
              e8.mean, e4.mean, e8.max, e4.max, e8.agree, e4.agree);
  // The prepared copies follow the matrices they were made from: changed weights, changed scores.
  prepared.w[0].assign(prepared.w[0].size(), 0.0f);
  EXPECT_NE(prepared.scores(0, f.h.data()), f.heads.scores(0, f.h.data()) ) << "before preparing again: the old copies";
  prepared.prepare_to_propose();
  DecodingHeads zero = f.heads;
  zero.w[0].assign(zero.w[0].size(), 0.0f);
  const std::vector<float> z_want = zero.scores(0, f.h.data()), z_got = prepared.scores(0, f.h.data());
  float spread = 0;
  for (float v : z_want) spread = std::max(spread, std::abs(v));
  for (size_t v = 0; v < z_want.size(); ++v) EXPECT_NEAR(z_got[v], z_want[v], 0.25f * spread);
}

// A hidden state of stories260K (64 values, normal with this scale), and the target's own logits for
// it, computed here in double from the output rows (the heads' oracle).
std::vector<float> random_hidden(uint32_t seed, float scale) {
  std::vector<float> h(64);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n;
  for (auto& x : h) x = scale * n(rng);
  return h;
}

std::vector<double> target_logits(const Model& m, const std::vector<float>& h) {
  std::vector<double> logits(512);
  std::vector<float> row(64);
  for (int v = 0; v < 512; ++v) {
    get_row(m.weights().output, v, row.data());
    for (int i = 0; i < 64; ++i) logits[size_t(v)] += double(row[size_t(i)]) * h[size_t(i)];
  }
  return logits;
}

// The target's softmax over its whole vocabulary for hidden state h, in double.
std::vector<double> target_probs(const Model& m, const std::vector<float>& h) {
  std::vector<double> p = target_logits(m, h);
  const double mx = *std::max_element(p.begin(), p.end());
  double z = 0;
  for (double& v : p) z += (v = std::exp(v - mx));
  for (double& v : p) v /= z;
  return p;
}

// Three heads with W = 0 and b = 0 over the whole vocabulary: each block is the identity, so every head
// gives the target's own distribution.
DecodingHeads zero_heads(const Model& m) {
  std::vector<int32_t> all(512);
  std::iota(all.begin(), all.end(), 0);
  return DecodingHeads::create(m, 3, all);
}

TEST(DecodingHeads, ZeroHeadsProposeWhatTheTargetWould) {
  // With W = 0 and b = 0 the block is the identity: every head's guess is the target's own argmax
  // over the subset.
  auto m = stories();
  const DecodingHeads heads = zero_heads(*m);
  const std::vector<float> h = random_hidden(1, 1.0f);
  const std::vector<double> logits = target_logits(*m, h);
  const int32_t want = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int32_t> guesses;
  heads.propose(h.data(), 0, 2, guesses);
  EXPECT_EQ(guesses, (std::vector<int32_t>{want, want}));
}

// The token tree is the set of the n likeliest paths (products of the heads' softmax probabilities over
// their `width` likeliest tokens), best first, parents before children. Zero heads all give the
// target's distribution, which the test computes itself from the output rows.
TEST(DecodingHeads, TheTokenTreeHoldsTheLikeliestPathsBestFirst) {
  auto m = stories();
  const DecodingHeads heads = zero_heads(*m);
  const std::vector<float> h = random_hidden(2, 3.0f);
  const std::vector<double> prob = target_probs(*m, h);
  std::vector<int32_t> top(512);
  std::iota(top.begin(), top.end(), 0);
  std::sort(top.begin(), top.end(), [&](int32_t a, int32_t b) { return prob[size_t(a)] > prob[size_t(b)]; });
  top.resize(3);
  auto p = [&](int32_t t) { return prob[size_t(t)]; };
  // Every path of up to 3 tokens from the top 3, with its probability.
  std::vector<std::pair<double, std::vector<int32_t>>> paths;
  for (int32_t a : top) {
    paths.push_back({p(a), {a}});
    for (int32_t b : top) {
      paths.push_back({p(a) * p(b), {a, b}});
      for (int32_t c : top) paths.push_back({p(a) * p(b) * p(c), {a, b, c}});
    }
  }
  std::sort(paths.begin(), paths.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<int32_t> tokens, parents;
  heads.propose_tree(h.data(), 0, 7, 3, tokens, parents);
  ASSERT_EQ(tokens.size(), 7u);
  for (size_t i = 0; i < tokens.size(); ++i) {
    ASSERT_LT(parents[i], int32_t(i)) << "parents come first";
    std::vector<int32_t> path;
    for (int32_t a = int32_t(i); a >= 0; a = parents[size_t(a)]) path.insert(path.begin(), tokens[size_t(a)]);
    EXPECT_EQ(path, paths[i].second) << "token " << i << " is the path of rank " << i;
  }
  heads.propose_tree(h.data(), 0, 7, 1, tokens, parents);
  EXPECT_EQ(tokens, (std::vector<int32_t>{top[0], top[0], top[0]})) << "width 1: a chain, one token per head";
  EXPECT_EQ(parents, (std::vector<int32_t>{-1, 0, 1}));
}

// With p_min, a chain stops before the first guess whose path probability (the product of each head's
// softmax probability of its guess) is below it, and a tree stops growing where the likeliest candidate
// left is. Zero heads give the target's distribution at every depth, computed here from the output rows.
TEST(DecodingHeads, ChainsAndTreesStopWhereThePathProbabilityFallsBelowPMin) {
  auto m = stories();
  const DecodingHeads heads = zero_heads(*m);
  const std::vector<float> h = random_hidden(2, 3.0f);
  std::vector<double> sorted = target_probs(*m, h);
  std::sort(sorted.rbegin(), sorted.rend());
  const double p0 = sorted[0];
  ASSERT_GT(p0, 0.2) << "the test needs a confident target";
  ASSERT_LT(p0, 0.95);
  std::vector<int32_t> guesses;
  // Path probabilities p0, p0^2, p0^3: a cut between two of them keeps the guesses above it.
  for (int keep = 0; keep <= 3; ++keep) {
    const double cut = keep == 3 ? 0.5 * std::pow(p0, 3) : std::pow(p0, keep + 0.5);
    heads.propose(h.data(), 0, 3, guesses, float(cut));
    EXPECT_EQ(guesses.size(), size_t(keep)) << "p_min " << cut;
  }
  heads.propose(h.data(), 0, 3, guesses, 0.0f);
  EXPECT_EQ(guesses.size(), 3u) << "p_min 0: every head guesses";
  // Width 3: the tree takes paths in order of probability while they reach p_min.
  std::vector<double> paths;
  for (int i = 0; i < 3; ++i) {
    paths.push_back(sorted[size_t(i)]);
    for (int j = 0; j < 3; ++j) {
      paths.push_back(sorted[size_t(i)] * sorted[size_t(j)]);
      for (int l = 0; l < 3; ++l) paths.push_back(sorted[size_t(i)] * sorted[size_t(j)] * sorted[size_t(l)]);
    }
  }
  std::sort(paths.rbegin(), paths.rend());
  std::vector<int32_t> tokens, parents;
  int cuts = 0;
  for (int n = 1; n <= 6; ++n) {
    if (paths[size_t(n - 1)] < 1.01 * paths[size_t(n)]) continue;  // too close a tie to cut between
    heads.propose_tree(h.data(), 0, 12, 3, tokens, parents, float(std::sqrt(paths[size_t(n - 1)] * paths[size_t(n)])));
    EXPECT_EQ(tokens.size(), size_t(n)) << "a cut below the path of rank " << n - 1;
    ++cuts;
  }
  EXPECT_GE(cuts, 3) << "too many ties: the tree's cut was hardly tested";
}

// Token-input heads, by a scalar reference in double: x = [h ; e / rms(e)] with e the token's embedding
// row, z = W x + b, a = h + SiLU(z), and the likeliest subset token of U a; the chain feeds each guess
// to the next head, and the tree expands each node with its own token.
std::vector<double> reference_scores(const DecodingHeads& H, const Model& m, int k, const std::vector<float>& h,
                                     int32_t previous, std::vector<float>* features = nullptr) {
  const int d = 64;
  std::vector<float> e(64), row(64);
  get_row(m.weights().tok_embd, previous, e.data());
  double ss = 0;
  for (float v : e) ss += double(v) * v;
  std::vector<double> x(128);
  for (int i = 0; i < d; ++i) x[size_t(i)] = h[size_t(i)], x[size_t(d + i)] = e[size_t(i)] / std::sqrt(ss / d + 1e-6);
  std::vector<double> a(64);
  for (int i = 0; i < d; ++i) {
    double z = H.b[size_t(k)][size_t(i)];
    for (int j = 0; j < 2 * d; ++j) z += double(H.w[size_t(k)][size_t(i * 2 * d + j)]) * x[size_t(j)];
    a[size_t(i)] = h[size_t(i)] + z / (1 + std::exp(-z));
  }
  if (features) {  // rescaled to h's RMS, as chain_features does
    double sh = 0, sa = 0;
    for (int i = 0; i < d; ++i) sh += double(h[size_t(i)]) * h[size_t(i)], sa += a[size_t(i)] * a[size_t(i)];
    features->clear();
    for (int i = 0; i < d; ++i) features->push_back(float(a[size_t(i)] * std::sqrt(sh / sa)));
  }
  std::vector<double> scores;
  for (int32_t v : H.vocab) {
    get_row(m.weights().output, v, row.data());
    double s = 0;
    for (int i = 0; i < d; ++i) s += double(row[size_t(i)]) * a[size_t(i)];
    scores.push_back(s);
  }
  return scores;
}

TEST(DecodingHeads, TokenInputHeadsReadThePreviousTokenInChainsAndTrees) {
  Fixture f(1, true);
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (auto& w : f.heads.w) for (auto& x : w) x = 0.5f * n(rng);  // strong enough to move the guesses
  const std::vector<float> h = random_hidden(4, 1.0f);
  auto best = [&](int k, int32_t previous) {
    const auto s = reference_scores(f.heads, *f.m, k, h, previous);
    return f.heads.vocab[size_t(std::max_element(s.begin(), s.end()) - s.begin())];
  };
  std::set<int32_t> seen;
  for (int32_t last : {1, 17, 100, 300}) {
    const int32_t g0 = best(0, last), g1 = best(1, g0);
    seen.insert(g0);
    std::vector<int32_t> guesses, tokens, parents;
    f.heads.propose(h.data(), last, 2, guesses);
    EXPECT_EQ(guesses, (std::vector<int32_t>{g0, g1})) << "last token " << last;
    f.heads.propose_tree(h.data(), last, 2, 1, tokens, parents);  // what propose() runs: its tokens are checked above
    EXPECT_EQ(parents, (std::vector<int32_t>{-1, 0})) << "a width-1 tree is a chain";
    // Width 2, 6 nodes (all paths of depth 2): each depth-1 node's children are head 1's two likeliest
    // after that node's own token.
    f.heads.propose_tree(h.data(), last, 6, 2, tokens, parents);
    ASSERT_EQ(tokens.size(), 6u);
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (parents[i] < 0) continue;
      const auto s = reference_scores(f.heads, *f.m, 1, h, tokens[size_t(parents[i])]);
      std::vector<size_t> order(s.size());
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + 2, order.end(), [&](size_t a, size_t b) { return s[a] > s[b]; });
      const int32_t t = tokens[i];
      EXPECT_TRUE(t == f.heads.vocab[order[0]] || t == f.heads.vocab[order[1]]) << "node " << i;
    }
  }
  EXPECT_GT(seen.size(), 1u) << "the previous token changes head 0's guess";
}

// Recurrent heads: head k > 0 reads head k-1's output a_{k-1} in place of h. The chain and every node
// of a full tree of width 2 are checked against the scalar reference, each node's input built from its
// own path; and some chains differ from those of the same weights read as plain token-input heads.
TEST(DecodingHeads, RecurrentHeadsReadThePreviousHeadsOutputAlongTheirPath) {
  auto m = stories();
  std::vector<int32_t> vocab;
  for (int i = 0; i < 40; ++i) vocab.push_back(3 + 7 * i);
  DecodingHeads heads = DecodingHeads::create(*m, 3, vocab, true, true);
  std::mt19937 rng(13);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (auto& w : heads.w) for (auto& x : w) x = 0.5f * n(rng);
  for (auto& b : heads.b) for (auto& x : b) x = 0.1f * n(rng);
  DecodingHeads plain = heads;
  plain.recurrent = false;
  const std::vector<float> h = random_hidden(6, 1.0f);
  auto best = [&](const std::vector<double>& s) { return heads.vocab[size_t(std::max_element(s.begin(), s.end()) - s.begin())]; };
  int differ = 0;
  for (int32_t last : {1, 17, 100, 300}) {
    std::vector<float> a0, a1;
    const int32_t g0 = best(reference_scores(heads, *m, 0, h, last, &a0));
    const int32_t g1 = best(reference_scores(heads, *m, 1, a0, g0, &a1));
    const int32_t g2 = best(reference_scores(heads, *m, 2, a1, g1));
    std::vector<int32_t> guesses, plain_guesses, tokens, parents;
    heads.propose(h.data(), last, 3, guesses);
    EXPECT_EQ(guesses, (std::vector<int32_t>{g0, g1, g2})) << "last token " << last;
    plain.propose(h.data(), last, 3, plain_guesses);
    differ += plain_guesses != guesses;
    // A full tree of width 2 (2 + 4 + 8 nodes): node j's children come from head depth(j) on the output
    // of head depth(j) - 1 at j's parent's input, and j's own token.
    heads.propose_tree(h.data(), last, 14, 2, tokens, parents);
    ASSERT_EQ(tokens.size(), 14u);
    std::function<std::pair<std::vector<float>, int32_t>(int32_t, int)> input_of = [&](int32_t node, int depth) {
      if (node < 0) return std::make_pair(h, last);  // what head 0 reads
      const auto [f, prev] = input_of(parents[size_t(node)], depth - 1);
      std::vector<float> a;
      reference_scores(heads, *m, depth - 1, f, prev, &a);
      return std::make_pair(a, tokens[size_t(node)]);
    };
    auto depth_of = [&](int32_t node) { int d = 0; for (; node >= 0; node = parents[size_t(node)]) ++d; return d; };
    for (size_t j = 0; j < tokens.size(); ++j) {
      const int d = depth_of(int32_t(j));  // head d - 1 guessed it
      const auto [f, prev] = input_of(parents[j], d - 1);
      const auto s = reference_scores(heads, *m, d - 1, f, prev);
      std::vector<size_t> order(s.size());
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + 2, order.end(), [&](size_t a, size_t b) { return s[a] > s[b]; });
      EXPECT_TRUE(tokens[j] == heads.vocab[order[0]] || tokens[j] == heads.vocab[order[1]]) << "node " << j;
    }
  }
  EXPECT_GT(differ, 0) << "reading a_{k-1} rather than h changes some chain";
  // The flag survives the file, and a recurrent file that is not token-input is refused.
  const std::string path = testing::TempDir() + "/recurrent.gguf";
  heads.save(path, "stories260K.gguf");
  const DecodingHeads back = DecodingHeads::load(path, *m);
  EXPECT_TRUE(back.recurrent && back.token_input);
  std::vector<int32_t> again;
  back.propose(h.data(), 17, 3, again);
  EXPECT_EQ(again.size(), 3u);
  EXPECT_THROW(DecodingHeads::create(*m, 2, vocab, false, true), Error);
  std::remove(path.c_str());
}

TEST(DecodingHeads, FileRoundTripAndChecksSayWhatIsWrong) {
  Fixture f;
  const std::string path = testing::TempDir() + "/heads.gguf";
  f.heads.save(path, "stories260K.gguf");
  const DecodingHeads back = DecodingHeads::load(path, *f.m);
  EXPECT_EQ(back.vocab, f.heads.vocab);
  EXPECT_EQ(back.w, f.heads.w);
  EXPECT_EQ(back.b, f.heads.b);
  EXPECT_EQ(back.out, f.heads.out);
  EXPECT_FALSE(back.token_input);
  Fixture t(1, true);  // token-input heads: a 64 x 128 W per head, and the flag
  t.heads.save(path, "stories260K.gguf");
  const DecodingHeads back_t = DecodingHeads::load(path, *t.m);
  EXPECT_TRUE(back_t.token_input);
  EXPECT_EQ(back_t.w, t.heads.w);
  EXPECT_EQ(back_t.w[0].size(), 64u * 128u);
  auto other = Model::load(test::shared_path("models/TinyStories-656K-Q8_0.gguf"));
  const auto msg = [](auto&& fn) { return test::error_message(fn); };
  EXPECT_NE(msg([&] { DecodingHeads::load(path, *other); }).find("heads for hidden size 64, the model's is 128"),
            std::string::npos);
  EXPECT_NE(msg([&] { DecodingHeads::load(test::shared_path("models/stories260K.gguf"), *f.m); })
                .find("not a decoding-heads file"), std::string::npos);
  GgufWriter g;  // a heads file with a token id outside the vocabulary
  g.add_string("general.architecture", "serval-heads");
  g.add_u32("serval-heads.count", 1), g.add_u32("serval-heads.n_embd", 64), g.add_u32("serval-heads.n_vocab", 512);
  const std::vector<float> ids = {3, 600}, w(64 * 64, 0.0f), b(64, 0.0f);
  g.add_f32_tensor("heads.vocab", {2}, ids.data());
  g.add_f32_tensor("heads.0.weight", {64, 64}, w.data());
  g.write(path);
  EXPECT_NE(msg([&] { DecodingHeads::load(path, *f.m); }).find("vocabulary entry 600 is not a token id"), std::string::npos);
  GgufWriter short_w;  // a head's weights with half the values its shape needs: refused, never read past
  short_w.add_string("general.architecture", "serval-heads");
  short_w.add_u32("serval-heads.count", 1), short_w.add_u32("serval-heads.n_embd", 64);
  short_w.add_u32("serval-heads.n_vocab", 512);
  const std::vector<float> good_ids = {3, 7};
  short_w.add_f32_tensor("heads.vocab", {2}, good_ids.data());
  short_w.add_f32_tensor("heads.0.weight", {64, 32}, w.data());
  short_w.add_f32_tensor("heads.0.bias", {64}, b.data());
  short_w.write(path);
  EXPECT_NE(msg([&] { DecodingHeads::load(path, *f.m); }).find("tensor 'heads.0.weight' must be F32 with 4096 elements"),
            std::string::npos);
  std::remove(path.c_str());
}

TEST(DecodingHeads, FrequentTokensRankByCountThenId) {
  const std::vector<int32_t> t = {5, 3, 5, 9, 3, 5, 1, 9, 7};
  EXPECT_EQ(frequent_tokens(t, 3, 10), (std::vector<int32_t>{5, 3, 9}));
  EXPECT_EQ(frequent_tokens(t, 5, 10), (std::vector<int32_t>{5, 3, 9, 1, 7}));
  EXPECT_EQ(frequent_tokens(t, 20, 10).size(), 10u);
}

// The oracle for corpus_states: the model run one token at a time, a fresh cache per window, and the
// largest logit found by a plain scan (not the sampler's argmax).
void one_token_at_a_time(const Model& m, std::span<const int32_t> window, std::vector<float>& hidden,
                         std::vector<int32_t>& predicted) {
  const int n = int(window.size());
  KvCache kv(m.config(), n);
  std::vector<float> logits, h;
  for (int p = 0; p < n; ++p) {
    Batch batch(m.config().n_kv_groups());
    for (int g = 0; g < batch.n_groups(); ++g) {
      batch.block_tables[g].assign(1, std::vector<int32_t>(size_t(n)));
      std::iota(batch.block_tables[g][0].begin(), batch.block_tables[g][0].end(), 0);
    }
    batch.add(window[size_t(p)], p, 0, p, true);
    m.forward(batch, kv, logits, &h);
    hidden.insert(hidden.end(), h.begin(), h.end());
    predicted.push_back(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
  }
}

TEST(DecodingHeads, CorpusSegmentsReadEachDocumentFromItsStartInRunsOfAtMostCtx) {
  std::vector<std::vector<int32_t>> docs(3);
  for (int i = 0; i < 5; ++i) docs[0].push_back(100 + i);
  for (int i = 0; i < 30; ++i) docs[1].push_back(200 + i);
  docs[2] = {300, 301};  // shorter than min_len: left out
  std::vector<int32_t> lengths = {99};  // cleared first
  const auto kept = corpus_segments(docs, 12, 3, lengths);
  EXPECT_EQ(lengths, (std::vector<int32_t>{5, 12, 12, 6}));
  std::vector<int32_t> want = docs[0];
  want.insert(want.end(), docs[1].begin(), docs[1].end());
  EXPECT_EQ(kept, want);
  // A document's last run shorter than min_len is left out, its earlier runs kept.
  corpus_segments(docs, 12, 7, lengths);
  EXPECT_EQ(lengths, (std::vector<int32_t>{12, 12}));
}

TEST(DecodingHeads, CorpusStatesAreThoseOfTheModelReadingEachSegmentFromItsStart) {
  auto m = stories();
  const int ctx = 12;
  std::vector<int32_t> tokens = m->tokenizer().encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her big "
      "red ball and her friend Tom.",
      true);
  // Passes of at most ctx tokens: {12}, {5, 7} (two sequences in one pass), {4}; the tokens past the
  // segments are not read.
  const std::vector<int32_t> segments = {12, 5, 7, 4};
  ASSERT_GE(tokens.size(), size_t(28 + 3));
  tokens.resize(28 + 3);
  std::vector<int32_t> predicted = {7};  // cleared first
  std::vector<std::pair<int64_t, int64_t>> heard;
  const auto hidden =
      corpus_states(*m, tokens, segments, ctx, &predicted, [&](int64_t w, int64_t n) { heard.emplace_back(w, n); });
  std::vector<float> want_h;
  std::vector<int32_t> want_p;
  size_t at = 0;
  for (int32_t len : segments)
    one_token_at_a_time(*m, std::span(tokens).subspan(at, size_t(len)), want_h, want_p), at += size_t(len);
  EXPECT_EQ(predicted, want_p);
  ASSERT_EQ(hidden.size(), want_h.size());
  for (size_t i = 0; i < hidden.size(); ++i) ASSERT_NEAR(hidden[i], want_h[i], 1e-4f * (1 + std::abs(want_h[i]))) << i;
  EXPECT_EQ(heard, (std::vector<std::pair<int64_t, int64_t>>{{12, 28}, {24, 28}, {28, 28}}));
  // The same states without the predictions (the output matrix is skipped).
  EXPECT_EQ(corpus_states(*m, tokens, segments, ctx), hidden);
  // A segment longer than a pass, or segments past the corpus, are refused.
  EXPECT_THROW(corpus_states(*m, tokens, std::vector<int32_t>{13}, ctx), Error);
  EXPECT_THROW(corpus_states(*m, tokens, std::vector<int32_t>{12, 12, 12}, ctx), Error);
}

TEST(DecodingHeads, HeadLabelsAreTheTokenTwoPlusKAheadOrTheModelsGuessOfIt) {
  const std::vector<int32_t> tokens = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  std::vector<int32_t> predicted, index(30);
  for (int i = 0; i < 10; ++i) predicted.push_back(20 + i);
  for (int t = 0; t < 30; ++t) index[size_t(t)] = t - 10;  // t's place in the subset
  index[13] = index[27] = -1;                              // outside it
  using V = std::vector<int32_t>;
  const V two_of_5 = {5, 5}, uneven = {3, 7};
  // Head 0 at row i guesses token i + 2: the corpus's, or the model's guess of it from row i + 1.
  EXPECT_EQ(head_labels(tokens, nullptr, index, 0, two_of_5, 10), (V{2, -1, 4, -1, -1, 7, 8, 9, -1, -1}));
  EXPECT_EQ(head_labels(tokens, &predicted, index, 0, two_of_5, 10), (V{11, 12, 13, -1, -1, 16, -1, 18, -1, -1}));
  // Head 1 guesses token i + 3; nothing past the row's segment.
  EXPECT_EQ(head_labels(tokens, nullptr, index, 1, two_of_5, 10), (V{-1, 4, -1, -1, -1, 8, 9, -1, -1, -1}));
  EXPECT_EQ(head_labels(tokens, &predicted, index, 1, two_of_5, 10), (V{12, 13, -1, -1, -1, -1, 18, -1, -1, -1}));
  // Segments of other lengths: each row's label stays inside its own.
  EXPECT_EQ(head_labels(tokens, nullptr, index, 0, uneven, 10), (V{2, -1, -1, 5, 6, 7, 8, 9, -1, -1}));
  EXPECT_EQ(head_labels(tokens, nullptr, index, 2, uneven, 10), (V{-1, -1, -1, 7, 8, 9, -1, -1, -1, -1}));
  // Rows past n_rows get none.
  EXPECT_EQ(head_labels(tokens, nullptr, index, 0, uneven, 6), (V{2, -1, -1, 5, -1, -1}));
}

}  // namespace
}  // namespace serval
