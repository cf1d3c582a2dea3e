// Speculative decoding: every proposer gives exactly the tokens (and log-probabilities) of plain
// decoding — greedy and sampled, alone, in concurrent batches, under preemption — while actually
// accepting proposals; prompt lookup against its definition; the draft model's vocabulary check; a
// chi-square test of the sampled distribution with speculation against plain sampling.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "base/error.h"
#include "engine/engine.h"
#include "engine/heads.h"
#include "engine/speculative.h"
#include "model/session.h"
#include "engine_support.h"
#include "test_support.h"

namespace serval {
namespace {

using test::Outcome;
using test::run_alone;

GenerationParams params(int max_tokens, uint64_t seed, float temp) {
  GenerationParams p;
  p.max_tokens = max_tokens;
  p.sampling.temperature = temp;
  p.sampling.seed = seed;
  return p;
}

// Runs `prompts` through `e` together (all added before the first step); outcomes in order.
std::vector<Outcome> run_engine(Engine& e, const std::vector<std::vector<int32_t>>& prompts,
                                const std::vector<GenerationParams>& ps) {
  std::map<RequestId, Outcome> out;
  std::vector<RequestId> ids;
  for (size_t i = 0; i < prompts.size(); ++i)
    ids.push_back(e.add_request(prompts[i], ps[i], [&out](const TokenEvent& ev) {
      auto& o = out[ev.id];
      if (ev.finished) o.reason = ev.reason;
      else o.tokens.push_back(ev.token), o.logprobs.push_back(ev.logprob);
    }));
  for (int i = 0; i < 100000 && e.has_work(); ++i) e.step();
  EXPECT_FALSE(e.has_work());
  std::vector<Outcome> res;
  for (RequestId id : ids) res.push_back(out[id]);
  return res;
}

void expect_pool_whole(const Engine& e) {
  const auto& kv = e.kv_manager();
  for (int g = 0; g < kv.n_groups(); ++g) EXPECT_EQ(kv.pool(g).n_free(), kv.pool(g).n_blocks()) << "leaked blocks";
  if (e.proposer()) {
    EXPECT_EQ(e.proposer()->blocks_in_use(), 0) << "the draft model's KV leaked";
  }
}

// Two heads trained briefly on the model's own greedy text (enough for some guesses to be right).
// token_input: Hydra-style heads, each reading the token before the one it guesses.
DecodingHeads train_small_heads(const Model& m, bool token_input) {
  const Outcome text = run_alone(m, m.tokenizer().encode("Once upon a time, there was a little", true), params(120, 0, 0.0f));
  std::vector<int32_t> tokens = text.tokens;
  const int64_t n = int64_t(tokens.size()), d = m.config().n_embd;
  KvCache kv(m.config(), n);
  Batch batch(m.config().n_kv_groups());
  batch.block_tables[0].assign(1, {});
  for (int64_t p = 0; p < n; ++p) batch.add(tokens[size_t(p)], int32_t(p), 0, int32_t(p), true), batch.block_tables[0][0].push_back(int32_t(p));
  std::vector<float> hidden;
  m.forward_hidden(batch, kv, hidden);
  std::vector<int32_t> all(512);
  for (int i = 0; i < 512; ++i) all[size_t(i)] = i;
  DecodingHeads heads = DecodingHeads::create(m, 2, all, token_input);
  HeadTrainer trainer(heads, 3e-3f);
  const int64_t in = heads.n_in();
  for (int k = 0; k < 2; ++k) {
    std::vector<int32_t> labels(size_t(n), -1);
    std::vector<float> x(size_t(n * in));
    for (int64_t i = 0; i < n; ++i) {
      if (i + 2 + k < n) labels[size_t(i)] = tokens[size_t(i + 2 + k)];
      heads.training_input(hidden.data() + i * d, tokens, i, k, x.data() + i * in);
    }
    for (int s = 0; s < 100; ++s) trainer.step(k, x, labels);
  }
  heads.prepare_to_propose();  // as load does: the engine's heads propose from Q4_0 copies
  return heads;
}

class StoriesSpec : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = Model::load(test::shared_path("models/stories260K.gguf")).release();
    heads_ = new DecodingHeads(train_small_heads(*model_, false));
    token_heads_ = new DecodingHeads(train_small_heads(*model_, true));
  }
  static void TearDownTestSuite() { delete heads_, delete token_heads_, delete model_; }
  static Model* model_;
  static DecodingHeads* heads_;
  static DecodingHeads* token_heads_;
  std::vector<int32_t> encode(const std::string& s) const { return model_->tokenizer().encode(s, true); }

  EngineConfig config(SpecMethod method, int32_t num_blocks = 256) const {
    EngineConfig cfg;
    cfg.block_size = 4;
    cfg.num_blocks = num_blocks;
    cfg.scheduler.max_batched_tokens = 64;
    cfg.spec.method = method;
    cfg.spec.draft_max = 6;
    cfg.spec.max_running = 64;
    cfg.spec.draft_model = model_;  // the model drafting for itself: greedy drafts are all accepted
    cfg.spec.draft_kv_bytes = 1 << 20;
    cfg.spec.heads = heads_;
    cfg.spec.tree_width = 3;  // heads propose token trees (the real-model test below runs a chain)
    cfg.spec.heads_p_min = 0;  // whole trees: no guess is dropped for being unsure
    return cfg;
  }
  // By name: "ngram", "draft", "heads", "ngram+draft", "ngram+heads", "suffix" (trees); "token-heads" is
  // "heads" with token-input (Hydra-style) heads, "suffix-chain" suffix speculation with chains.
  EngineConfig config(const std::string& name, int32_t num_blocks = 256) const {
    EngineConfig cfg = config(SpecMethod::None, num_blocks);
    cfg.spec.set_method(name == "token-heads" ? "heads" : name == "suffix-chain" ? "suffix" : name);
    if (name == "token-heads") cfg.spec.heads = token_heads_;
    if (name == "suffix-chain") cfg.spec.tree_width = 1;  // "suffix" grows trees of width 3
    return cfg;
  }
};
Model* StoriesSpec::model_ = nullptr;
DecodingHeads* StoriesSpec::heads_ = nullptr;
DecodingHeads* StoriesSpec::token_heads_ = nullptr;

const std::vector<std::string> kMethods = {"ngram",       "draft",       "heads",  "ngram+draft",  "ngram+heads",
                                           "token-heads", "suffix", "suffix-chain", "suffix+draft", "suffix+heads"};
const std::vector<std::string> kTexts = {"Once upon a time", "Once upon a time there was a dog named Max",
                                         "The little girl went to the park", "Lily and Tom were best friends."};

TEST(DraftModel, TopProbabilityIsTheSoftmaxOfTheBestWithin3e4) {
  std::mt19937 rng(3);
  std::normal_distribution<float> spread(0.0f, 4.0f);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> logits(151936);
    for (float& l : logits) l = spread(rng);
    const auto best = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    logits[size_t(best)] += float(trial);  // from an unsure top to a sure one
    double sum = 0;
    for (float l : logits) sum += std::exp(double(l) - logits[size_t(best)]);
    const double want = 1.0 / sum;
    EXPECT_NEAR(DraftModelProposer::top_probability(logits, best), want, 3e-4) << "trial " << trial;
  }
}

TEST_F(StoriesSpec, EveryProposerGivesThePlainTokensAloneAndConcurrently) {
  for (const std::string& method : kMethods) {
    for (float temp : {0.0f, 1.0f}) {
      std::vector<std::vector<int32_t>> prompts;
      std::vector<GenerationParams> ps;
      std::vector<Outcome> want;
      for (size_t i = 0; i < kTexts.size(); ++i) {
        prompts.push_back(encode(kTexts[i]));
        ps.push_back(params(60, 11 + i, temp));
        want.push_back(run_alone(*model_, prompts.back(), ps.back()));
      }
      Engine together(*model_, config(method));
      const auto got = run_engine(together, prompts, ps);
      for (size_t i = 0; i < kTexts.size(); ++i) {
        EXPECT_EQ(got[i].tokens, want[i].tokens) << method << " temp " << temp << " " << kTexts[i];
        EXPECT_EQ(got[i].logprobs, want[i].logprobs) << "bitwise log-probabilities";
        EXPECT_EQ(got[i].reason, want[i].reason);
      }
      const SpecStats& st = together.stats().spec;
      EXPECT_GT(st.accepted_tokens, 0) << method << " temp " << temp << ": nothing was accepted";
      EXPECT_LE(st.accepted_tokens, st.draft_tokens);
      EXPECT_EQ(st.accepted_per_pos.size(), 6u);
      EXPECT_EQ(st.accepted_per_pos[0] <= st.drafts, true);
      if (method == "draft" && temp == 0.0f) {
        EXPECT_EQ(st.accepted_tokens, st.draft_tokens) << "a model's own greedy drafts are always accepted";
      }
      EXPECT_LT(together.stats().steps, 60 * int64_t(kTexts.size())) << "speculation saved no step";
      expect_pool_whole(together);
      Engine alone(*model_, config(method));  // one request at a time
      for (size_t i = 0; i < kTexts.size(); ++i)
        EXPECT_EQ(run_engine(alone, {prompts[i]}, {ps[i]})[0].tokens, want[i].tokens) << kTexts[i];
    }
  }
}

// The same under a pool so small that requests preempt each other, with drafts that stop at
// max_tokens and at end-of-generation, and per-request draft caps (0: off).
TEST_F(StoriesSpec, PreemptionLimitsAndPerRequestCaps) {
  std::mt19937 rng(7);
  for (const std::string& method : kMethods) {
    std::vector<std::vector<int32_t>> prompts;
    std::vector<GenerationParams> ps;
    for (int i = 0; i < 24; ++i) {
      prompts.push_back(encode(kTexts[rng() % kTexts.size()]));
      ps.push_back(params(1 + int(rng() % 50), 100 + i, rng() % 2 ? 0.0f : 0.9f));
      ps.back().draft_max = int32_t(rng() % 4) - 1;  // -1 (the engine's), 0 (off), 1, 2
    }
    EngineConfig cfg = config(method, 20);  // 80 tokens for all: preemption is certain
    cfg.scheduler.max_batched_tokens = 24;
    Engine e(*model_, cfg);
    const auto got = run_engine(e, prompts, ps);
    EXPECT_GT(e.stats().preemptions, 0);
    EXPECT_GT(e.stats().spec.accepted_tokens, 0);
    for (size_t i = 0; i < prompts.size(); ++i) {
      const Outcome want = run_alone(*model_, prompts[i], ps[i]);
      EXPECT_EQ(got[i].tokens, want.tokens) << method << " request " << i;
      EXPECT_EQ(got[i].reason, want.reason) << method << " request " << i;
    }
    expect_pool_whole(e);
  }
}

// Suffix speculation keeps finished outputs: the same request again is proposed from the first one's
// output, which the target repeats token for token at temperature 0.
TEST_F(StoriesSpec, SuffixSpeculationProposesFromEarlierOutputs) {
  Engine e(*model_, config("suffix-chain"));
  const auto prompt = encode("Once upon a time there was a dog named Max");
  const auto first = run_engine(e, {prompt}, {params(60, 1, 0.0f)});
  const int64_t first_accepted = e.stats().spec.accepted_tokens;
  const auto second = run_engine(e, {prompt}, {params(60, 1, 0.0f)});
  ASSERT_EQ(second[0].tokens, first[0].tokens);
  const int64_t accepted = e.stats().spec.accepted_tokens - first_accepted;
  std::printf("accepted: first run %lld, second run %lld of %zu tokens\n", (long long)first_accepted,
              (long long)accepted, first[0].tokens.size());
  // With 6 guesses a step, at most 6 of every 7 tokens are accepted guesses (the 7th is the target's own):
  // 60 tokens give at most 51, less the first two steps (no stored pair of tokens to match yet).
  EXPECT_GE(accepted, 45) << "nearly every step's whole draft comes from the store";
  EXPECT_GT(accepted, 2 * first_accepted);
  expect_pool_whole(e);
}

TEST_F(StoriesSpec, ABigBatchDoesNotSpeculate) {
  EngineConfig cfg = config(SpecMethod::Ngram);
  cfg.spec.max_running = 2;
  Engine e(*model_, cfg);
  std::vector<std::vector<int32_t>> prompts(3, encode("Once upon a time"));
  run_engine(e, prompts, std::vector<GenerationParams>(3, params(20, 1, 0.0f)));
  EXPECT_EQ(e.stats().spec.drafts, 0) << "three running requests are more than max_running 2";
  Engine two(*model_, cfg);
  prompts.pop_back();
  run_engine(two, prompts, std::vector<GenerationParams>(2, params(20, 1, 0.0f)));
  EXPECT_GT(two.stats().spec.drafts, 0);
}

TEST_F(StoriesSpec, TheDraftModelStopsAtAnUnsureGuess) {
  std::vector<std::vector<int32_t>> prompts(2, encode("Once upon a time"));
  const std::vector<GenerationParams> ps(2, params(30, 1, 0.0f));
  const Outcome want = run_alone(*model_, prompts[0], ps[0]);
  int64_t proposed[3];
  const float p_mins[3] = {0.0f, 0.8f, 1.0f};
  for (int i = 0; i < 3; ++i) {
    EngineConfig cfg = config(SpecMethod::Draft);
    cfg.spec.draft_p_min = p_mins[i];
    Engine e(*model_, cfg);
    EXPECT_EQ(run_engine(e, prompts, ps)[0].tokens, want.tokens);
    proposed[i] = e.stats().spec.draft_tokens;
  }
  EXPECT_GT(proposed[0], proposed[1]) << "a threshold drops some guesses";
  EXPECT_GT(proposed[1], 0);
  EXPECT_EQ(proposed[2], 0) << "no guess is surer than probability 1 on stories260K";
}

// A heads chain is as long as the heads are sure, not as the adaptive length says: with p_min 0 every
// head guesses at every step, even after a rejection (the adaptive length would then propose one token);
// with p_min 1 none does; a threshold between drops some guesses. The tokens are the plain ones always.
TEST_F(StoriesSpec, HeadsChainsAreAsLongAsTheHeadsAreSure) {
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& t : kTexts) prompts.push_back(encode(t));
  const std::vector<GenerationParams> ps(prompts.size(), params(30, 1, 0.0f));
  std::vector<Outcome> want;
  for (size_t i = 0; i < prompts.size(); ++i) want.push_back(run_alone(*model_, prompts[i], ps[i]));
  int64_t proposed[3];
  const float p_mins[3] = {0.0f, 0.3f, 1.0f};
  for (int i = 0; i < 3; ++i) {
    EngineConfig cfg = config(SpecMethod::Heads);
    cfg.spec.tree_width = 1;
    cfg.spec.heads_p_min = p_mins[i];
    Engine e(*model_, cfg);
    const auto got = run_engine(e, prompts, ps);
    for (size_t r = 0; r < prompts.size(); ++r) EXPECT_EQ(got[r].tokens, want[r].tokens) << "p_min " << p_mins[i];
    const SpecStats& st = e.stats().spec;
    proposed[i] = st.draft_tokens;
    if (i == 0) {
      ASSERT_FALSE(st.accepted_per_pos.empty());
      EXPECT_LT(st.accepted_per_pos[0], st.drafts) << "some first guesses are rejected";
      // Both heads guess at every step but the last ones of a request, where max_tokens leaves less room.
      EXPECT_GE(st.draft_tokens, 2 * st.drafts - 2 * int64_t(prompts.size()));
    }
  }
  EXPECT_GT(proposed[0], proposed[1]) << "a threshold drops some guesses";
  EXPECT_GT(proposed[1], 0);
  EXPECT_EQ(proposed[2], 0) << "no path is surer than probability 1";
}

// After an empty draft the draft model waits 1, 2, 4 ... steps (at most --draft-backoff) before it
// runs for that request again; 0 turns the wait off.
TEST_F(StoriesSpec, TheDraftModelBacksOffAfterEmptyDrafts) {
  for (int32_t backoff : {0, 4}) {
    SpeculativeConfig c = config(SpecMethod::Draft).spec;
    c.draft_p_min = 1.0f;  // never sure: every draft is empty
    c.draft_backoff_max = backoff;
    DraftModelProposer p(c, 4);
    Request r(1, encode("Once upon a time"), params(100, 0, 0.0f), nullptr, 0);
    Request* reqs[] = {&r};
    const int32_t limits[] = {4};
    std::vector<int> ran;
    for (int step = 0; step < 16; ++step) {
      const int64_t before = p.forward_passes();
      p.propose(reqs, limits);
      EXPECT_TRUE(r.draft.empty());
      if (p.forward_passes() > before) ran.push_back(step);
      r.tokens.push_back(r.tokens.back());
    }
    if (backoff == 0) {
      EXPECT_EQ(ran.size(), 16u) << "no back-off: the draft model runs every step";
    } else {
      EXPECT_EQ(ran, (std::vector<int>{0, 2, 5, 10, 15})) << "waits of 1, 2, 4, then 4 (the cap)";
    }
    p.forget(r);
    EXPECT_EQ(p.blocks_in_use(), 0);
  }
}

// An oracle that knows each request's plain continuation and proposes it as a token tree whose right
// path is not the first branch, beside wrong tokens at every depth:
//   0: wrong (root)   1: right (root)   2: wrong (under 1)   3: right (under 1)   4: right (under 3)
//   5: wrong (under 0)
// The kept path is then 1, 3, 4: its K/V must move from draft slots 1, 3, 4 to 0, 1, 2.
class TreeOracle : public Proposer {
 public:
  std::map<RequestId, std::vector<int32_t>> plain;  // prompt and plain output per request
  int32_t n_vocab = 0;
  bool makes_trees() const override { return true; }
  void propose(std::span<Request* const> reqs, std::span<const int32_t> limits) override {
    for (size_t i = 0; i < reqs.size(); ++i) {
      Request& r = *reqs[i];
      r.cut_draft(0);
      const auto& want = plain.at(r.id);
      const size_t n = r.tokens.size();
      if (n + 3 > want.size()) continue;
      const auto wrong = [&](int32_t t) { return (t + 1) % n_vocab; };
      r.draft = {wrong(want[n]), want[n], wrong(want[n + 1]), want[n + 1], want[n + 2], wrong(want[n + 1])};
      r.draft_parents = {-1, -1, 1, 1, 3, 0};
      r.cut_draft(size_t(limits[i]));
    }
  }
};

TEST_F(StoriesSpec, TreeVerificationKeepsAPathOffTheFirstBranch) {
  for (float temp : {0.0f, 1.0f}) {
    std::vector<std::vector<int32_t>> prompts;
    std::vector<GenerationParams> ps;
    std::vector<Outcome> want;
    auto oracle = std::make_unique<TreeOracle>();
    oracle->n_vocab = int32_t(model_->config().n_vocab);
    for (size_t i = 0; i < kTexts.size(); ++i) {
      prompts.push_back(encode(kTexts[i]));
      ps.push_back(params(40, 5 + i, temp));
      want.push_back(run_alone(*model_, prompts.back(), ps.back()));
      auto& all = oracle->plain[RequestId(i + 1)];
      all = prompts.back();
      all.insert(all.end(), want.back().tokens.begin(), want.back().tokens.end());
    }
    Engine e(*model_, config(SpecMethod::Ngram));
    e.set_proposer(std::move(oracle));
    const auto got = run_engine(e, prompts, ps);
    for (size_t i = 0; i < kTexts.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << "temp " << temp << " " << kTexts[i];
      EXPECT_EQ(got[i].logprobs, want[i].logprobs) << "bitwise: the moved K/V and the tree mask are exact";
    }
    const SpecStats& st = e.stats().spec;
    // Whole trees (6 tokens) keep 3; only the last steps of a request, near max_tokens, are cut.
    EXPECT_LE(st.draft_tokens, 6 * st.drafts);
    EXPECT_LE(st.accepted_tokens, 3 * st.drafts);
    EXPECT_GE(st.accepted_per_pos[2], st.drafts - 3 * int64_t(kTexts.size())) << "the third right token is kept";
    EXPECT_LT(e.stats().steps, 40 * 2) << "four tokens a step";
    expect_pool_whole(e);
  }
}

// A proposer that proposes {42} and records who asked (the fallback behind prompt lookup).
class Recorder : public Proposer {
 public:
  std::vector<RequestId> asked;
  void propose(std::span<Request* const> reqs, std::span<const int32_t>) override {
    for (Request* r : reqs) asked.push_back(r->id), r->draft = {42};
  }
};

TEST(Speculative, PromptLookupFirstLeavesTheRestToTheFallback) {
  SpeculativeConfig c;
  c.set_method("ngram+draft");
  auto owned = std::make_unique<Recorder>();
  Recorder* fallback = owned.get();
  LookupFirstProposer p(c, std::move(owned));
  Request three(1, {5, 6, 7, 8, 9, 5, 6, 7}, {}, nullptr, 0);  // "5 6 7" occurred before: lookup
  Request two(2, {5, 6, 8, 9, 5, 6}, {}, nullptr, 0);          // only a 2-gram repeats: below 3
  Request none(3, {1, 2, 3}, {}, nullptr, 0);
  Request* reqs[] = {&three, &two, &none};
  const int32_t limits[] = {3, 3, 3};
  p.propose(reqs, limits);
  EXPECT_EQ(three.draft, (std::vector<int32_t>{8, 9, 5}));
  EXPECT_EQ(two.draft, std::vector<int32_t>{42});
  EXPECT_EQ(none.draft, std::vector<int32_t>{42});
  EXPECT_EQ(fallback->asked, (std::vector<RequestId>{2, 3}));
  c.ngram_min = 2;  // an explicit minimum is kept
  LookupFirstProposer q(c, std::make_unique<Recorder>());
  q.propose(reqs, limits);
  EXPECT_EQ(two.draft, (std::vector<int32_t>{8, 9, 5}));
  // Suffix speculation first: the same split, by the length of the longest match (3 tokens and
  // factor 1: 3 guesses; 2 tokens is below the minimum).
  SpeculativeConfig s;
  s.set_method("suffix+draft");
  auto recorder = std::make_unique<Recorder>();
  Recorder* rest = recorder.get();
  LookupFirstProposer sp(s, std::move(recorder));
  sp.propose(reqs, limits);
  EXPECT_EQ(three.draft, (std::vector<int32_t>{8, 9, 5}));
  EXPECT_EQ(two.draft, std::vector<int32_t>{42});
  EXPECT_EQ(rest->asked, (std::vector<RequestId>{2, 3}));
}

// Two-sample chi-square test of equal distributions (equal sample sizes), categories with fewer than
// 20 in both samples together pooled; false when the statistic passes the 99.9th percentile.
bool same_distribution(const std::map<int32_t, std::pair<int, int>>& counts, std::string& why) {
  double chi2 = 0;
  int cells = 0, small_a = 0, small_b = 0;
  auto add = [&](int a, int b) {
    const double half = (a + b) / 2.0;
    chi2 += (a - half) * (a - half) / half + (b - half) * (b - half) / half;
    ++cells;
  };
  for (const auto& [token, ab] : counts) {
    if (ab.first + ab.second < 20) small_a += ab.first, small_b += ab.second;
    else add(ab.first, ab.second);
  }
  if (small_a + small_b > 0) add(small_a, small_b);
  const double k = cells - 1;  // degrees of freedom
  if (k < 2) return why = "too few categories", false;
  // Wilson-Hilferty: the 99.9th percentile of chi-square with k degrees of freedom (z = 3.09).
  const double critical = k * std::pow(1 - 2 / (9 * k) + 3.09 * std::sqrt(2 / (9 * k)), 3);
  why = "chi2 " + std::to_string(chi2) + " critical " + std::to_string(critical) + " dof " + std::to_string(k);
  return chi2 < critical;
}

// Plain sampling with seeds 0..N-1 against speculative sampling with seeds N..2N-1, at the positions
// where prompt lookup proposes (the first token follows the prompt's prefill and is never proposed).
TEST_F(StoriesSpec, SampledDistributionMatchesPlainSampling) {
  const auto prompt = encode("Lily had a red ball. Lily had a red ball. Lily had a");
  const int n = 400;
  std::vector<std::map<int32_t, std::pair<int, int>>> counts(4);  // [position] token -> (plain, speculative)
  Engine e(*model_, config(SpecMethod::Ngram));
  std::vector<GenerationParams> spec_ps;
  for (int i = 0; i < n; ++i) {
    const auto o = run_alone(*model_, prompt, params(4, uint64_t(i), 1.0f));
    for (size_t p = 0; p < o.tokens.size(); ++p) ++counts[p][o.tokens[p]].first;
    spec_ps.push_back(params(4, uint64_t(n + i), 1.0f));
  }
  for (const auto& o : run_engine(e, std::vector<std::vector<int32_t>>(n, prompt), spec_ps))
    for (size_t p = 0; p < o.tokens.size(); ++p) ++counts[p][o.tokens[p]].second;
  EXPECT_GT(e.stats().spec.drafts, n / 10) << "prompt lookup should propose often";
  EXPECT_GT(e.stats().spec.accepted_tokens, 0);
  EXPECT_LT(e.stats().spec.accepted_tokens, e.stats().spec.draft_tokens) << "some proposals must be rejected";
  for (size_t p = 1; p < 4; ++p) {
    std::string why;
    EXPECT_TRUE(same_distribution(counts[p], why)) << "position " << p << ": " << why;
    std::printf("position %zu: %s\n", p, why.c_str());
  }
}

TEST(NgramProposer, ProposesWhatFollowedTheLatestLongestMatch) {
  // ... 5 6 7 8 9 ... 5 6 7 1 2 | 5 6 7: the 3-gram "5 6 7" last occurred before "1 2".
  const std::vector<int32_t> t = {5, 6, 7, 8, 9, 4, 5, 6, 7, 1, 2, 3, 5, 6, 7};
  EXPECT_EQ(NgramProposer::lookup(t, 1, 3, 4), (std::vector<int32_t>{1, 2, 3, 5}));
  EXPECT_EQ(NgramProposer::lookup(t, 1, 3, 2), (std::vector<int32_t>{1, 2}));
  // A longer n-gram wins over a more recent shorter one: "9 4" occurs once, "4" more recently.
  const std::vector<int32_t> u = {9, 4, 1, 1, 4, 2, 2, 9, 4};
  EXPECT_EQ(NgramProposer::lookup(u, 1, 2, 3), (std::vector<int32_t>{1, 1, 4}));
  EXPECT_EQ(NgramProposer::lookup(u, 1, 1, 3), (std::vector<int32_t>{2, 2, 9})) << "unigram: the latest 4";
  // The continuation stops at the end of the tokens.
  const std::vector<int32_t> v = {1, 2, 3, 1, 2};
  EXPECT_EQ(NgramProposer::lookup(v, 2, 2, 8), (std::vector<int32_t>{3, 1, 2}));
  EXPECT_TRUE(NgramProposer::lookup(std::vector<int32_t>{1, 2, 3}, 1, 3, 4).empty()) << "no repeat";
  EXPECT_TRUE(NgramProposer::lookup(v, 3, 3, 4).empty()) << "no 3-gram repeats";
  EXPECT_TRUE(NgramProposer::lookup(std::vector<int32_t>{7}, 1, 3, 4).empty());
}

TEST(Speculative, ProposalLengthAdaptsToAcceptance) {
  EXPECT_EQ(next_spec_len(4, 4, 4, 16), 8) << "all kept: twice as long";
  EXPECT_EQ(next_spec_len(12, 12, 12, 16), 16) << "at most the cap";
  EXPECT_EQ(next_spec_len(0, 3, 3, 16), 2) << "from at least 1";
  EXPECT_EQ(next_spec_len(8, 8, 3, 16), 4) << "some rejected: one more than kept";
  EXPECT_EQ(next_spec_len(8, 8, 0, 16), 1);
  EXPECT_EQ(next_spec_len(8, 2, 2, 16), 16) << "a short proposal kept whole still doubles the length";
}

TEST(Speculative, ConfigAndVocabularyChecksSayWhatIsWrong) {
  const auto msg = [](auto&& f) { return test::error_message(f); };
  SpeculativeConfig c;
  c.draft_max = 0;
  EXPECT_NE(msg([&] { c.validate(); }).find("--draft-max"), std::string::npos);
  c.draft_max = 4, c.draft_min = 5;
  EXPECT_NE(msg([&] { c.validate(); }).find("--draft-min"), std::string::npos);
  c.draft_min = 1, c.method = SpecMethod::Draft;
  EXPECT_NE(msg([&] { c.validate(); }).find("--model-draft"), std::string::npos);
  EXPECT_NE(msg([] { parse_spec_method("medusa"); }).find("'medusa'"), std::string::npos);
  EXPECT_EQ(parse_spec_method("ngram"), SpecMethod::Ngram);
  EXPECT_EQ(parse_spec_method("suffix"), SpecMethod::Suffix);
  EXPECT_EQ(std::string(to_string(SpecMethod::Suffix)), "suffix");
  SpeculativeConfig n;
  n.set_method("ngram+heads");
  EXPECT_EQ(n.first, SpecMethod::Ngram);
  EXPECT_EQ(n.method, SpecMethod::Heads);
  EXPECT_EQ(n.method_name(), "ngram+heads");
  EXPECT_EQ(n.lookup_min(), 3) << "in front of heads or a draft model, matches of 3 tokens or more";
  n.set_method("ngram");
  EXPECT_EQ(n.method_name(), "ngram");
  EXPECT_EQ(n.lookup_min(), 1);
  n.set_method("suffix+draft");
  EXPECT_EQ(n.first, SpecMethod::Suffix);
  EXPECT_EQ(n.method, SpecMethod::Draft);
  EXPECT_EQ(n.method_name(), "suffix+draft");
  EXPECT_EQ(n.lookup_min(), 3);
  n.set_method("ngram");
  for (const char* bad : {"ngram+ngram", "ngram+", "draft+ngram", "ngram+none", "suffix+ngram", "heads+draft",
                          "ngram+suffix", "+draft"})
    EXPECT_NE(msg([&] { n.set_method(bad); }).find("unknown speculative method '" + std::string(bad) + "'"),
              std::string::npos) << bad;
  n.method = SpecMethod::Ngram, n.first = SpecMethod::Ngram;
  EXPECT_NE(msg([&] { n.validate(); }).find("lookup first needs a draft model or heads behind it"), std::string::npos);
  n.first = SpecMethod::None, n.draft_backoff_max = -1;
  EXPECT_NE(msg([&] { n.validate(); }).find("--draft-backoff must be 0..1024 (got -1)"), std::string::npos);
  n.draft_backoff_max = 8;
  SpeculativeConfig sx;
  sx.set_method("suffix");
  sx.validate();
  sx.suffix_depth = 0;
  EXPECT_NE(msg([&] { sx.validate(); }).find("--spec-suffix-depth must be 1..64 (got 0)"), std::string::npos);
  sx.suffix_depth = 24, sx.suffix_factor = 0;
  EXPECT_NE(msg([&] { sx.validate(); }).find("--spec-suffix-factor"), std::string::npos);
  sx.suffix_factor = 1, sx.suffix_p_min = 1.5f;
  EXPECT_NE(msg([&] { sx.validate(); }).find("--spec-suffix-p-min must be 0..1"), std::string::npos);
  sx.suffix_p_min = 0.1f, sx.suffix_cache = -1;
  EXPECT_NE(msg([&] { sx.validate(); }).find("--spec-suffix-cache"), std::string::npos);
  EXPECT_NE(msg([&] { sx.set_method("ngram+suffix"); }).find("unknown speculative method 'ngram+suffix'"),
            std::string::npos);
  EXPECT_NE(msg([&] { sx.set_method("foo+draft"); }).find("unknown speculative method 'foo+draft'"),
            std::string::npos);
  for (int width : {0, 65})
    EXPECT_NE(msg([&] { n.tree_width = width, n.validate(); }).find(fmt::format("--spec-tree-width must be 1..64 (got {})", width)),
              std::string::npos) << width;
  n.tree_width = 1;
  n.draft_backoff_max = 8, n.set_method("ngram+draft"), n.draft_model = nullptr, n.ngram_max = 2;
  EXPECT_NE(msg([&] { n.validate(); }).find("(got 3..2)"), std::string::npos) << "the default minimum 3 is above max";
  auto a = Model::load(test::shared_path("models/stories260K.gguf"));
  auto b = Model::load(test::shared_path("models/TinyStories-656K-Q8_0.gguf"));
  EXPECT_NE(msg([&] { check_same_vocabulary(*a, *b); }).find("2048 tokens, the target's 512"), std::string::npos);
  EXPECT_EQ(msg([&] { check_same_vocabulary(*a, *a); }), "no error");
}

// The real pair: Qwen2.5-Coder 1.5B verified against 0.5B drafts; prompt lookup and heads on the 0.5B.
TEST(RealModelSpec, QwenPairAndPromptLookupGiveThePlainTokens) {
  const std::string small = test::cached_model("qwen2.5-coder-0.5b-instruct");
  const std::string large = test::cached_model("qwen2.5-coder-1.5b-instruct");
  ASSERT_FALSE(small.empty() || large.empty()) << "run scripts/setup";
  auto draft = Model::load(small);
  auto target = Model::load(large);
  const std::vector<std::string> texts = {"def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                                          "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"};
  // Untrained (zero) heads guess the target's own next token again: the plumbing of hidden states on
  // a real model, lossless whether or not a guess is kept.
  std::vector<int32_t> subset(2048);
  for (int i = 0; i < 2048; ++i) subset[size_t(i)] = i;
  const DecodingHeads heads = DecodingHeads::create(*draft, 3, subset);
  const std::vector<std::pair<const Model*, std::string>> runs = {{target.get(), "draft"},
                                                                  {target.get(), "ngram+draft"},
                                                                  {draft.get(), "ngram"},
                                                                  {draft.get(), "heads"}};
  for (const auto& [m, method] : runs) {
    EngineConfig cfg;
    cfg.num_blocks = 64;
    cfg.spec.set_method(method);
    cfg.spec.heads = &heads;
    cfg.spec.draft_model = draft.get();
    cfg.spec.draft_kv_bytes = 16 << 20;
    Engine e(*m, cfg);
    std::vector<std::vector<int32_t>> prompts;
    std::vector<GenerationParams> ps;
    for (size_t i = 0; i < texts.size(); ++i)
      prompts.push_back(m->tokenizer().encode(texts[i], true)), ps.push_back(params(16, i, i ? 0.7f : 0.0f));
    const auto got = run_engine(e, prompts, ps);
    for (size_t i = 0; i < texts.size(); ++i)
      EXPECT_EQ(got[i].tokens, run_alone(*m, prompts[i], ps[i]).tokens) << method << " " << texts[i];
    if (method != "heads") {
      EXPECT_GT(e.stats().spec.accepted_tokens, 0) << method;
    }
    EXPECT_GT(e.stats().spec.drafts, 0) << method;
  }
}

// A draft model with a reduced head (the vocabulary's first N logits, `--draft-vocab`) proposes only
// tokens below N and scores its confidence among them: the target's tokens stay exactly the plain
// ones, whether N = 256 leaves most of the 1.5B's tokens out of the draft's reach or N = 65536 nearly
// none.
TEST(RealModelSpec, DraftWithReducedHeadGivesThePlainTokens) {
  const std::string small = test::cached_model("qwen2.5-coder-0.5b-instruct");
  const std::string large = test::cached_model("qwen2.5-coder-1.5b-instruct");
  ASSERT_FALSE(small.empty() || large.empty()) << "run scripts/setup";
  auto target = Model::load(large);
  const auto prompt = target->tokenizer().encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", true);
  const GenerationParams p = params(24, 0, 0.0f);
  const auto plain = run_alone(*target, prompt, p).tokens;
  for (int64_t n : {int64_t(256), int64_t(65536)}) {
    LoadOptions o;
    o.logit_rows = n;
    auto draft = Model::load(small, o);
    EngineConfig cfg;
    cfg.num_blocks = 64;
    cfg.spec.set_method("draft");
    cfg.spec.draft_model = draft.get();
    cfg.spec.draft_kv_bytes = 16 << 20;
    Engine e(*target, cfg);
    EXPECT_EQ(run_engine(e, {prompt}, {p})[0].tokens, plain) << n;
    EXPECT_GT(e.stats().spec.drafts, 0) << n;
    if (n == 65536) EXPECT_GT(e.stats().spec.accepted_tokens, 0);
    EXPECT_THROW(Engine(*draft, cfg), Error);  // a cut head cannot be the served model
  }
}

}  // namespace
}  // namespace serval
