// Constrained decoding and prompt log-probabilities inside the engine. Oracles: one sequence decoded
// alone with the grammar's mask applied by the test itself (so masks must follow each sequence
// through batching, chunking and preemption), the grammar's own matcher on the output bytes, and the
// model's logits evaluated token by token for the prompt log-probabilities.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "engine/engine.h"
#include "engine_support.h"
#include "grammar/gbnf.h"
#include "grammar/matcher.h"
#include "model/session.h"
#include "test_support.h"

namespace serval {
namespace {

struct Got {
  std::vector<int32_t> tokens;
  std::vector<TokenEvent> prompt_events;
  FinishReason reason = FinishReason::None;
  std::string error;
};

TokenCallback collect(std::map<RequestId, Got>& out) {
  return [&out](const TokenEvent& ev) {
    Got& g = out[ev.id];
    if (ev.finished) g.reason = ev.reason, g.error = ev.error;
    else if (ev.prompt) g.prompt_events.push_back(ev);
    else g.tokens.push_back(ev.token);
  };
}

class GrammarEngine : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = Model::load(test::shared_path("models/stories260K.gguf")).release(); }
  static void TearDownTestSuite() { delete model_; }
  static Model* model_;

  std::shared_ptr<const grammar::TokenVocab> vocab() const {
    const Tokenizer& tok = model_->tokenizer();
    std::vector<std::string> bytes;
    std::vector<int32_t> eog;
    for (int32_t id = 0; id < tok.n_vocab(); ++id) {
      bytes.push_back(tok.token_to_piece(id));
      if (tok.is_end_of_generation(id)) eog.push_back(id);
    }
    return std::make_shared<const grammar::TokenVocab>(bytes, eog);
  }

  // The oracle: the sequence alone, its logits masked here, stopping where the grammar is complete.
  test::Outcome constrained_alone(const std::vector<int32_t>& prompt, const GenerationParams& p) const {
    grammar::GrammarMatcher m(p.grammar, vocab());
    SingleSequence seq(*model_, int64_t(prompt.size()) + p.max_tokens);
    Sampler sampler(p.sampling);
    std::vector<int32_t> history = prompt;
    std::vector<float> logits = seq.eval(prompt);
    test::Outcome o;
    for (int i = 0; i < p.max_tokens; ++i) {
      const auto mask = m.allowed();
      for (size_t t = 0; t < logits.size(); ++t)
        if (!mask->has(int32_t(t))) logits[t] = -INFINITY;
      const int32_t tok = sampler.sample(logits, history).token;
      EXPECT_TRUE(m.accept(tok));
      o.tokens.push_back(tok);
      history.push_back(tok);
      if (model_->tokenizer().is_end_of_generation(tok) || m.is_complete()) return o.reason = FinishReason::Stop, o;
      logits = seq.eval(std::vector<int32_t>{tok});
    }
    return o.reason = FinishReason::Length, o;
  }
};
Model* GrammarEngine::model_ = nullptr;

constexpr const char* kWords = R"(root ::= (" " [a-z]+){3,6} ".")";

TEST_F(GrammarEngine, MasksFollowEachSequenceThroughBatchingAndPreemption) {
  auto words = std::make_shared<grammar::CompiledGrammar>(grammar::parse_gbnf(kWords));
  auto digits = std::make_shared<grammar::CompiledGrammar>(grammar::parse_gbnf(R"(root ::= " " [0-9]{2,8})"));
  EngineConfig cfg;
  cfg.block_size = 8;
  cfg.num_blocks = 12;  // 96 tokens for everyone: preemption is certain
  cfg.scheduler.max_batched_tokens = 24;
  Engine e(*model_, cfg);
  std::mt19937 rng(11);
  struct Spec { std::vector<int32_t> prompt; GenerationParams params; };
  std::vector<Spec> specs;
  std::map<RequestId, Got> out;
  std::map<RequestId, size_t> spec_of;
  for (int i = 0; i < 24; ++i) {
    GenerationParams p;
    p.max_tokens = 12 + int(rng() % 20);
    p.sampling.temperature = i % 3 == 0 ? 0.0f : 1.0f;
    p.sampling.seed = uint64_t(i);
    p.grammar = i % 3 == 2 ? nullptr : i % 2 ? words : digits;  // every third one unconstrained
    specs.push_back({model_->tokenizer().encode(i % 2 ? "Once upon a time" : "The number was", true), p});
    spec_of[e.add_request(specs.back().prompt, p, collect(out))] = specs.size() - 1;
  }
  for (int i = 0; i < 100000 && e.has_work(); ++i) e.step();
  ASSERT_FALSE(e.has_work());
  EXPECT_GT(e.stats().preemptions, 0);
  for (const auto& [id, idx] : spec_of) {
    const Spec& s = specs[idx];
    const test::Outcome want = s.params.grammar ? constrained_alone(s.prompt, s.params) : test::run_alone(*model_, s.prompt, s.params);
    EXPECT_EQ(out[id].tokens, want.tokens) << "request " << idx;
    EXPECT_EQ(out[id].reason, want.reason) << "request " << idx << " " << out[id].error;
    if (!s.params.grammar || out[id].reason != FinishReason::Stop) continue;
    std::string text;
    for (int32_t t : out[id].tokens) text += model_->tokenizer().token_to_piece(t);
    EXPECT_TRUE(grammar::matches(grammar::parse_gbnf(s.params.grammar == words ? kWords : R"(root ::= " " [0-9]{2,8})"), text))
        << "request " << idx << ": '" << text << "'";
  }
}

TEST_F(GrammarEngine, PromptLogprobsMatchTokenByTokenLogits) {
  const std::vector<int32_t> prompt = model_->tokenizer().encode("Once upon a time there was a little dog", true);
  SingleSequence seq(*model_, 64);
  std::vector<float> want;
  for (size_t k = 0; k + 1 < prompt.size(); ++k) {
    const auto logits = seq.eval(std::vector<int32_t>{prompt[k]});
    want.push_back(logprobs_of(logits, prompt[k + 1], 0).logprob);
  }
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.scheduler.max_batched_tokens = 5;  // the prompt in chunks
  Engine e(*model_, cfg);
  std::map<RequestId, Got> out;
  GenerationParams p;
  p.max_tokens = 2;
  p.sampling.temperature = 0;
  p.prompt_logprobs = 3;
  for (int round = 0; round < 2; ++round) {  // the second time the prompt's blocks are in the prefix cache
    const RequestId id = e.add_request(prompt, p, collect(out));
    while (e.has_work()) e.step();
    const Got& g = out[id];
    ASSERT_EQ(g.prompt_events.size(), want.size()) << "round " << round;
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_EQ(g.prompt_events[k].token, prompt[k + 1]);
      EXPECT_NEAR(g.prompt_events[k].logprob, want[k], 1e-4) << "token " << k + 1;
      EXPECT_EQ(g.prompt_events[k].top.size(), 3u);
    }
    EXPECT_EQ(g.tokens.size(), 2u);
  }
}

}  // namespace
}  // namespace serval
