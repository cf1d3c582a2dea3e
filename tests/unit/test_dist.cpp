// A model split over ranks (src/dist, model/shard.h): how shares are cut, and the split forward pass
// run as threads of this process (the in-process hub) against the whole model. The same over MPI
// processes is tests/py/test_mpi.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dist/runtime.h"
#include "dist/step.h"
#include "engine/engine.h"
#include "model/session.h"
#include "test_support.h"

namespace serval {
namespace {

ModelConfig heads_config(int64_t n_head, int64_t n_head_kv) {
  ModelConfig c;
  c.n_vocab = 1000, c.n_layer = 4, c.n_embd = 64, c.n_head = n_head, c.n_head_kv = n_head_kv, c.d_head = 64;
  return c;
}

TEST(Shard, HeadsFollowTheirKvHeads) {
  const ModelConfig c = heads_config(14, 2);  // Qwen2.5 0.5B
  const ShardLayout a = make_shard_layout(c, 2, 1, 0, 0), b = make_shard_layout(c, 2, 1, 1, 0);
  EXPECT_EQ(a.head_begin, 0); EXPECT_EQ(a.head_end, 7); EXPECT_EQ(a.kv_head_begin, 0); EXPECT_EQ(a.kv_head_end, 1);
  EXPECT_EQ(b.head_begin, 7); EXPECT_EQ(b.head_end, 14); EXPECT_EQ(b.kv_head_begin, 1); EXPECT_EQ(b.kv_head_end, 2);
  EXPECT_EQ(a.vocab_end, 500); EXPECT_EQ(b.vocab_begin, 500); EXPECT_EQ(b.vocab_end, 1000);
}

TEST(Shard, FewerKvHeadsThanRanksAreReplicated) {
  const ModelConfig c = heads_config(4, 1);  // Gemma 3 270M
  for (int r = 0; r < 2; ++r) {
    const ShardLayout s = make_shard_layout(c, 2, 1, r, 0);
    EXPECT_EQ(s.kv_head_begin, 0); EXPECT_EQ(s.kv_head_end, 1);
    EXPECT_EQ(s.head_begin, 2 * r); EXPECT_EQ(s.head_end, 2 * r + 2);
  }
  EXPECT_NE(test::error_message([&] { make_shard_layout(heads_config(6, 2), 3, 1, 0, 0); }), "no error");
  EXPECT_NE(test::error_message([&] { make_shard_layout(heads_config(4, 1), 8, 1, 0, 0); }), "no error");
}

TEST(Shard, LayersSplitOverStages) {
  const ModelConfig c = heads_config(4, 4);
  EXPECT_EQ(make_shard_layout(c, 1, 2, 0, 0).layer_end, 2);
  EXPECT_EQ(make_shard_layout(c, 1, 2, 0, 1).layer_begin, 2);
  EXPECT_EQ(make_shard_layout(c, 1, 2, 0, 1).layer_end, 4);
  EXPECT_NE(test::error_message([&] { make_shard_layout(c, 1, 5, 0, 0); }), "no error");
}

TEST(Shard, FfnCutsFallOnBlockBoundaries) {
  // 4864 = 19 blocks of 256 (Q6_K): the shares are unequal, 10 and 9 blocks.
  EXPECT_EQ(ffn_share(4864, 256, 2, 0), std::make_pair(int64_t(0), int64_t(2560)));
  EXPECT_EQ(ffn_share(4864, 256, 2, 1), std::make_pair(int64_t(2560), int64_t(4864)));
  EXPECT_EQ(ffn_share(384, 32, 2, 1), std::make_pair(int64_t(192), int64_t(384)));
  EXPECT_NE(test::error_message([] { ffn_share(256, 256, 2, 1); }), "no error");
}

// A step survives the trip to another rank whole, with the slot copies rank 0's cache recorded.
TEST(Step, RoundTripsWithTheSlotCopies) {
  auto model = dist::load_model(test::shared_path("models/stories260K.gguf"), {}, 1, 1);
  ModelConfig c = model->config();
  c.shard = make_shard_layout(c, 1, 2, 0, 0);  // rank 0 of two stages: its cache records copies
  KvCache kv(c, 32);
  kv.copy_slot(0, 3, 7);
  kv.copy_slot(0, 4, 8);
  Batch b(1);
  b.block_size = 4;
  b.add(5, 0, 0, 0, false);
  b.add(6, 1, 0, 1, true);
  b.block_tables[0] = {{0, 2}};
  b.table_block_size = {4};
  auto hub = dist::LocalHub::create(2);
  dist::send_step(hub->comm(0), dist::make_step(b, kv, true));
  const dist::Step got = dist::recv_step(hub->comm(1));
  EXPECT_FALSE(got.stop);
  EXPECT_TRUE(got.want_hidden);
  EXPECT_EQ(got.n_slots, std::vector<int64_t>{32});
  ASSERT_EQ(got.copies.size(), 2u);
  EXPECT_EQ(got.copies[1].from, 4);
  EXPECT_EQ(got.copies[1].to, 8);
  EXPECT_TRUE(kv.take_copies().empty());  // taken by the step
  EXPECT_EQ(got.batch.tokens, b.tokens);
  EXPECT_EQ(got.batch.positions, b.positions);
  EXPECT_EQ(got.batch.want_logits, b.want_logits);
  EXPECT_EQ(got.batch.slots, b.slots);
  EXPECT_EQ(got.batch.block_tables, b.block_tables);
  EXPECT_EQ(got.batch.table_block_size, b.table_block_size);
  EXPECT_EQ(got.batch.block_size, 4);
  dist::send_step(hub->comm(0), dist::Step{});
  EXPECT_TRUE(dist::recv_step(hub->comm(1)).stop);
}

std::vector<int32_t> prompt_tokens(const Model& model) {
  return model.tokenizer().encode("Once upon a time, there was a little girl named Lily. She loved to play", true, false);
}

// Logits of every token of the prompt, evaluated in two chunks (prefill, then more tokens on its KV).
std::vector<float> run_logits(const Model& model, DType kv_type = DType::F16) {
  SingleSequence seq(model, 64, kv_type);
  const auto tokens = prompt_tokens(model);
  std::vector<float> out = seq.eval(std::span(tokens).first(9), true);
  const std::vector<float> more = seq.eval(std::span(tokens).subspan(9), true);
  out.insert(out.end(), more.begin(), more.end());
  return out;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(std::isfinite(a[i]) && std::isfinite(b[i])) << "logit " << i;
    d = std::max(d, std::fabs(a[i] - b[i]));
  }
  return d;
}

class SplitModel : public ::testing::TestWithParam<const char*> {
 protected:
  std::string path() const { return test::shared_path(std::string("models/") + GetParam()); }
};

// Logits of a prefill of `n_repeat` copies of the prompt in one batch (micro-batches when split).
std::vector<float> long_prefill_logits(const Model& model, int n_repeat) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n_repeat; ++i) {
    const auto p = prompt_tokens(model);
    tokens.insert(tokens.end(), p.begin(), p.end());
  }
  SingleSequence seq(model, int64_t(tokens.size()));
  return seq.eval(tokens, true);
}

TEST_P(SplitModel, PipelineIsBitwiseTheWholeModel) {
  const auto whole_model = Model::load(path());
  const auto split_model = dist::load_model(path(), {}, 1, 2);
  const auto whole = run_logits(*whole_model), split = run_logits(*split_model);
  ASSERT_EQ(whole.size(), split.size());
  EXPECT_EQ(std::memcmp(whole.data(), split.data(), whole.size() * 4), 0);
  // 51 tokens: 3 micro-batches, each stage running one while the next stage runs the one before.
  const auto whole_long = long_prefill_logits(*whole_model, 3), split_long = long_prefill_logits(*split_model, 3);
  ASSERT_EQ(whole_long.size(), split_long.size());
  EXPECT_EQ(std::memcmp(whole_long.data(), split_long.data(), whole_long.size() * 4), 0);
}

TEST_P(SplitModel, TensorParallelIsDeterministicAndCloseToTheWholeModel) {
  const auto whole = run_logits(*Model::load(path()));
  const auto tp = run_logits(*dist::load_model(path(), {}, 2, 1));
  const auto again = run_logits(*dist::load_model(path(), {}, 2, 1));
  const auto both = run_logits(*dist::load_model(path(), {}, 2, 2));
  ASSERT_EQ(whole.size(), tp.size());
  EXPECT_EQ(std::memcmp(tp.data(), again.data(), tp.size() * 4), 0);
  EXPECT_EQ(std::memcmp(tp.data(), both.data(), tp.size() * 4), 0);  // stages add nothing to the sums
  float scale = 0;
  for (float x : whole) scale = std::max(scale, std::fabs(x));
  const float diff = max_abs_diff(whole, tp);
  RecordProperty("max_abs_logit_diff", std::to_string(diff));
  std::printf("%s: TP 2 logits differ from the whole model by at most %g (largest |logit| %g)\n", GetParam(), diff, scale);
  EXPECT_LE(diff, 1e-3f * scale);
  // The same greedy token everywhere.
  const size_t n_tokens = prompt_tokens(*Model::load(path())).size(), n_vocab = whole.size() / n_tokens;
  for (size_t t = 0; t < n_tokens; ++t) {
    auto argmax = [&](const std::vector<float>& l) {
      return std::max_element(l.begin() + t * n_vocab, l.begin() + (t + 1) * n_vocab) - l.begin();
    };
    EXPECT_EQ(argmax(whole), argmax(tp)) << "token " << t;
  }
}

// Greedy tokens (and log-probabilities) of several requests decoded together on the paged engine,
// with prompt lookup speculating (batches of many sequences, block tables, verification steps).
std::vector<std::vector<std::pair<int32_t, float>>> engine_outputs(const Model& model, const std::string& spec) {
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.num_blocks = 64;
  cfg.spec.set_method(spec);
  Engine engine(model, cfg);
  const std::vector<std::vector<int32_t>> prompts = {{1, 403, 407, 261}, {1, 378, 186, 400, 259, 429, 374},
                                                     {1, 268, 319, 289, 402, 268, 319, 289}};
  std::vector<std::vector<std::pair<int32_t, float>>> out(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationParams p;
    p.sampling.temperature = 0;
    p.max_tokens = 20;
    p.ignore_eos = true;
    engine.add_request(prompts[i], p, [&out, i](const TokenEvent& ev) {
      if (!ev.finished) out[i].push_back({ev.token, ev.logprob});
    });
  }
  while (engine.step()) {
  }
  return out;
}

TEST(SplitEngine, ManyRequestsDecodeAsOneProcess) {
  const std::string path = test::shared_path("models/stories260K.gguf");
  const auto whole = Model::load(path);
  for (const char* spec : {"none", "ngram"}) {
    const auto plain = engine_outputs(*whole, spec);
    EXPECT_EQ(engine_outputs(*dist::load_model(path, {}, 1, 2), spec), plain) << spec;  // bitwise
    const auto tp = engine_outputs(*dist::load_model(path, {}, 2, 2), spec);
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_EQ(tp[i].size(), plain[i].size());
      for (size_t t = 0; t < plain[i].size(); ++t) EXPECT_EQ(tp[i][t].first, plain[i][t].first) << spec << " " << i;
    }
  }
}

// Real models from the cache. Qwen2.5 0.5B: KV heads split 1 + 1, FFN columns cut at Q6_K/Q4_K
// super-blocks (2560 + 2304). Gemma 3 270M: its one KV head replicated, two KV groups (sliding
// window), post norms after the all-reduces. The yardstick of rounding noise: how far the whole model
// moves with an F32 KV cache instead of F16.
class SplitCached : public ::testing::TestWithParam<const char*> {};

TEST_P(SplitCached, PipelineBitwiseAndTensorParallelWithinRoundingNoise) {
  const std::string path = test::cached_model(GetParam());
  if (path.empty()) GTEST_SKIP() << GetParam() << " is not in the model cache";
  const auto whole_model = Model::load(path);
  const auto whole = run_logits(*whole_model), whole_f32 = run_logits(*whole_model, DType::F32);
  const auto pp = run_logits(*dist::load_model(path, {}, 1, 2));
  EXPECT_EQ(std::memcmp(whole.data(), pp.data(), whole.size() * 4), 0);
  const auto tp = run_logits(*dist::load_model(path, {}, 2, 1));
  const float diff = max_abs_diff(whole, tp), noise = max_abs_diff(whole, whole_f32);
  double sum = 0;
  for (size_t i = 0; i < tp.size(); ++i) sum += std::fabs(tp[i] - whole[i]);
  std::printf("%s: TP 2 logits differ from the whole model by at most %g (mean %g); an F32 KV cache moves them by "
              "at most %g\n", GetParam(), diff, sum / double(tp.size()), noise);
  EXPECT_LE(diff, 2 * noise);
}

// Mixture-of-experts and latent-attention families: the tiny random models of tests/data/families
// (F32; checked against transformers by tests/py/test_families.py). Their logits of a fixed token
// sequence, prefilled in two chunks as run_logits does.
std::vector<float> family_logits(const Model& model) {
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 24; ++i) tokens.push_back(int32_t((i * 397 + 11) % model.config().n_vocab));
  SingleSequence seq(model, 64, DType::F16);
  std::vector<float> out = seq.eval(std::span(tokens).first(9), true);
  const std::vector<float> more = seq.eval(std::span(tokens).subspan(9), true);
  out.insert(out.end(), more.begin(), more.end());
  return out;
}

class SplitFamily : public ::testing::TestWithParam<const char*> {
 protected:
  std::string path() const { return std::string(SERVAL_SOURCE_DIR) + "/tests/data/families/" + GetParam(); }
};

// Pipeline stages give the whole model's bits; TP ranks, each with its columns of every expert and of
// the shared expert (the router whole on each, so all route alike) and its attention heads (MLA: its
// heads, the latent cache replicated), are deterministic, close to the whole model and pick its
// greedy tokens. Without the all-reduce of the experts' partial sums (or with a bias added by every
// rank, or the sinks of the wrong heads) the logits move by far more than the bound. OLMoE's query and key
// norms span all heads: the ranks add their sums of squares first (TP 4 over its 2 KV heads replicates
// each, so only a KV head's first rank counts its keys).
TEST_P(SplitFamily, PipelineBitwiseAndTensorParallelClose) {
  const auto whole_model = Model::load(path());
  const auto whole = family_logits(*whole_model);
  EXPECT_EQ(family_logits(*dist::load_model(path(), {}, 1, 2)), whole);
  const auto tp = family_logits(*dist::load_model(path(), {}, 2, 1));
  EXPECT_EQ(family_logits(*dist::load_model(path(), {}, 2, 2)), tp);  // stages add nothing to the sums
  const auto tp4 = family_logits(*dist::load_model(path(), {}, 4, 1));
  ASSERT_EQ(whole.size(), tp.size());
  ASSERT_EQ(whole.size(), tp4.size());
  float scale = 0;
  for (float x : whole) scale = std::max(scale, std::fabs(x));
  const float diff = max_abs_diff(whole, tp), diff4 = max_abs_diff(whole, tp4);
  std::printf("%s: TP 2 / 4 logits differ from the whole model by at most %g / %g (largest |logit| %g)\n", GetParam(),
              diff, diff4, scale);
  EXPECT_LE(diff, 1e-3f * scale);
  EXPECT_LE(diff4, 1e-3f * scale);
  const size_t n_vocab = size_t(whole_model->config().n_vocab);
  for (size_t t = 0; t < whole.size() / n_vocab; ++t) {
    auto argmax = [&](const std::vector<float>& l) {
      return std::max_element(l.begin() + t * n_vocab, l.begin() + (t + 1) * n_vocab) - l.begin();
    };
    EXPECT_EQ(argmax(whole), argmax(tp)) << "token " << t;
    EXPECT_EQ(argmax(whole), argmax(tp4)) << "token " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, SplitFamily,
                         ::testing::Values("qwen3", "qwen3moe", "qwen2moe", "mixtral", "olmoe", "gpt_oss", "deepseek2",
                                           "deepseek2_qlora"));

INSTANTIATE_TEST_SUITE_P(Models, SplitCached, ::testing::Values("qwen2.5-coder-0.5b-instruct", "gemma-3-270m"));

INSTANTIATE_TEST_SUITE_P(Models, SplitModel, ::testing::Values("stories260K.gguf", "TinyStories-656K-Q8_0.gguf"));

}  // namespace
}  // namespace serval
