// The engine end to end on real models: every request gets exactly the tokens (and log-probabilities)
// it gets when run alone, whatever else shares its steps, whatever the chunking, with or without
// prefix-cache hits and preemptions; aborts and finished requests return every block.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>

#include "base/error.h"
#include "engine/capacity.h"
#include "engine/engine.h"
#include "engine/engine_loop.h"
#include "engine/naive_engine.h"
#include "model/session.h"
#include "engine_support.h"
#include "test_support.h"

namespace serval {
namespace {

using test::Outcome;
using test::run_alone;

void expect_pool_whole(const Engine& e) {
  const auto& kv = e.kv_manager();
  for (int g = 0; g < kv.n_groups(); ++g) {
    EXPECT_EQ(kv.pool(g).n_free(), kv.pool(g).n_blocks()) << "leaked blocks in group " << g;
    for (int32_t b = 0; b < kv.pool(g).n_blocks(); ++b) ASSERT_EQ(kv.pool(g).ref_count(b), 0);
  }
}

// Runs the engine until idle, collecting each request's events.
std::map<RequestId, Outcome> drain(Engine& e, std::map<RequestId, Outcome>& out, int max_steps = 100000) {
  for (int i = 0; i < max_steps && e.has_work(); ++i) e.step();
  EXPECT_FALSE(e.has_work()) << "engine did not finish (deadlock?)";
  return out;
}

TokenCallback collect(std::map<RequestId, Outcome>& out, RequestId* id_slot) {
  return [&out, id_slot](const TokenEvent& ev) {
    auto& o = out[ev.id];
    if (ev.finished) o.reason = ev.reason;
    else o.tokens.push_back(ev.token), o.logprobs.push_back(ev.logprob);
  };
}

GenerationParams sampled(int max_tokens, uint64_t seed, float temp = 0.9f) {
  GenerationParams p;
  p.max_tokens = max_tokens;
  p.sampling.temperature = temp;
  p.sampling.seed = seed;
  return p;
}

class StoriesEngine : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = Model::load(test::shared_path("models/stories260K.gguf")).release(); }
  static void TearDownTestSuite() { delete model_; }
  static Model* model_;
  std::vector<int32_t> encode(const std::string& s) const { return model_->tokenizer().encode(s, true); }
};
Model* StoriesEngine::model_ = nullptr;

TEST_F(StoriesEngine, ConcurrentEqualsAloneForAnyChunkSizeAndCacheState) {
  const std::vector<std::string> texts = {"Once upon a time", "Once upon a time there was a dog named Max",
                                          "The little girl went to the park", "Once upon a time there was a cat",
                                          "Lily and Tom were best friends. They liked to play"};
  std::vector<Outcome> alone;
  for (size_t i = 0; i < texts.size(); ++i) alone.push_back(run_alone(*model_, encode(texts[i]), sampled(30, i)));
  for (int64_t chunk : {1, 5, 16, 512}) {
    for (bool prefix_caching : {false, true}) {
      EngineConfig cfg;
      cfg.block_size = 4;
      cfg.num_blocks = 256;
      cfg.prefix_caching = prefix_caching;
      cfg.scheduler.max_batched_tokens = chunk;
      Engine e(*model_, cfg);
      for (int round = 0; round < 2; ++round) {  // round 1 runs with a warm prefix cache
        std::map<RequestId, Outcome> out;
        std::vector<RequestId> ids;
        for (size_t i = 0; i < texts.size(); ++i) ids.push_back(e.add_request(encode(texts[i]), sampled(30, i), collect(out, nullptr)));
        drain(e, out);
        for (size_t i = 0; i < texts.size(); ++i) {
          EXPECT_EQ(out[ids[i]].tokens, alone[i].tokens) << "chunk " << chunk << " caching " << prefix_caching << " round " << round;
          EXPECT_EQ(out[ids[i]].logprobs, alone[i].logprobs) << "bitwise log-probabilities";
        }
        expect_pool_whole(e);
      }
      if (prefix_caching) {
        EXPECT_GT(e.stats().prefix_hits, 0);
      } else {
        EXPECT_EQ(e.stats().prefix_hits, 0);
      }
    }
  }
}

// The mean of a prompt's final hidden states, from one forward pass over the whole prompt (every row
// wanted), summed in position order: what a mean-pooled embedding request must give.
std::vector<float> mean_of_rows(const Model& m, const std::vector<int32_t>& prompt) {
  const auto n = int64_t(prompt.size());
  KvCache kv(m.config(), n, DType::F16);
  Batch batch(m.config().n_kv_groups());
  std::vector<int32_t> slots(static_cast<size_t>(n));
  std::iota(slots.begin(), slots.end(), 0);
  for (auto& g : batch.block_tables) g = {slots};
  for (int64_t p = 0; p < n; ++p) batch.add(prompt[size_t(p)], int32_t(p), 0, int32_t(p), true);
  std::vector<float> logits, hidden;
  m.forward(batch, kv, logits, &hidden);
  const int64_t d = m.config().n_embd;
  std::vector<float> sum(size_t(d), 0.0f);
  for (int64_t p = 0; p < n; ++p)
    for (int64_t i = 0; i < d; ++i) sum[size_t(i)] += hidden[size_t(p * d + i)];
  for (float& v : sum) v /= float(n);
  return sum;
}

TEST_F(StoriesEngine, MeanPooledEmbeddingsUnderChunkingCachingAndPreemption) {
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 10; ++i) {
    auto p = encode("Once upon a time there was a little dog");  // a shared prefix: prefix-cache hits for others
    for (int k = 0, extra = 5 + int(rng() % 40); k < extra; ++k) p.push_back(int32_t(3 + rng() % 500));
    prompts.push_back(p);
  }
  std::vector<std::vector<float>> want;
  for (const auto& p : prompts) want.push_back(mean_of_rows(*model_, p));
  for (int64_t chunk : {7, 512}) {
    EngineConfig cfg;
    cfg.block_size = 4;
    cfg.num_blocks = 40;  // 160 tokens, shared with long generations: preemptions
    cfg.scheduler.max_batched_tokens = chunk;
    Engine e(*model_, cfg);
    std::map<RequestId, std::vector<float>> got;
    std::map<RequestId, size_t> index;
    std::map<RequestId, Outcome> gen;
    for (size_t i = 0; i < prompts.size(); ++i) {
      GenerationParams g = sampled(60, i);
      e.add_request(encode("Lily and Tom were best friends"), g, collect(gen, nullptr));
      GenerationParams p;
      p.embed = p.embed_mean = true;
      p.max_tokens = 1, p.draft_max = 0;
      index[e.add_request(prompts[i], p, [&got](const TokenEvent& ev) {
        if (ev.finished) got[ev.id] = ev.embedding;
      })] = i;
    }
    drain(e, gen);
    EXPECT_GT(e.stats().preemptions, 0) << "chunk " << chunk;
    EXPECT_GT(e.stats().prefix_hits, 0) << "the generations share blocks; the embeddings must not";
    for (const auto& [id, i] : index) EXPECT_EQ(got[id], want[i]) << "prompt " << i << " chunk " << chunk;
    expect_pool_whole(e);
  }
}

TEST_F(StoriesEngine, RandomizedArrivalsAbortsAndPreemption) {
  std::mt19937 rng(2024);
  const std::vector<std::string> bases = {"Once upon a time there was", "One day a little boy named Tim",
                                          "The sun was shining and the birds", "Lily loved her red ball"};
  struct Spec { std::vector<int32_t> prompt; GenerationParams params; };
  std::vector<Spec> specs;
  for (int i = 0; i < 300; ++i) {
    auto prompt = encode(bases[rng() % bases.size()]);
    const int extra = int(rng() % 30);  // random suffix after a shared prefix
    for (int k = 0; k < extra; ++k) prompt.push_back(int32_t(3 + rng() % 500));
    GenerationParams p = sampled(1 + int(rng() % 40), i, (rng() % 3 == 0) ? 0.0f : 1.0f);
    p.priority = int(rng() % 3);
    specs.push_back({prompt, p});
  }
  for (auto policy : {SchedulingPolicy::Fcfs, SchedulingPolicy::Priority}) {
    EngineConfig cfg;
    cfg.block_size = 8;
    cfg.num_blocks = 24;  // 192 tokens for everyone: preemption is certain
    cfg.scheduler.max_batched_tokens = 48;
    cfg.scheduler.max_seqs = 12;
    cfg.scheduler.policy = policy;
    Engine e(*model_, cfg);
    std::map<RequestId, Outcome> out;
    std::map<RequestId, size_t> spec_of;
    std::vector<RequestId> aborted;
    size_t next = 0;
    int steps = 0;
    while ((next < specs.size() || e.has_work()) && steps < 200000) {
      for (int k = int(rng() % 4); k > 0 && next < specs.size(); --k, ++next)
        spec_of[e.add_request(specs[next].prompt, specs[next].params, collect(out, nullptr))] = next;
      if (rng() % 25 == 0 && !e.scheduler().running().empty()) {
        const RequestId victim = e.scheduler().running()[rng() % e.scheduler().running().size()]->id;
        EXPECT_TRUE(e.abort(victim));
        aborted.push_back(victim);
      }
      e.step();
      ++steps;
    }
    ASSERT_FALSE(e.has_work()) << "no progress (deadlock?)";
    EXPECT_GT(e.stats().preemptions, 0) << "the pool should have forced preemptions";
    EXPECT_GT(e.stats().prefix_hits, 0);
    for (const auto& [id, idx] : spec_of) {
      const Outcome want = run_alone(*model_, specs[idx].prompt, specs[idx].params);
      const Outcome& got = out[id];
      if (got.reason == FinishReason::Abort) {
        ASSERT_LE(got.tokens.size(), want.tokens.size());
        EXPECT_TRUE(std::equal(got.tokens.begin(), got.tokens.end(), want.tokens.begin())) << "request " << idx;
      } else {
        EXPECT_EQ(got.tokens, want.tokens) << "request " << idx;
        EXPECT_EQ(got.reason, want.reason) << "request " << idx;
      }
    }
    EXPECT_EQ(out.size(), specs.size()) << "every request ends with a final event";
    expect_pool_whole(e);
  }
}

TEST_F(StoriesEngine, AbortReturnsBlocksAtOnce) {
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.num_blocks = 64;
  Engine e(*model_, cfg);
  std::map<RequestId, Outcome> out;
  const RequestId id = e.add_request(encode("Once upon a time there was a big dog"), sampled(50, 1), collect(out, nullptr));
  e.step();
  e.step();
  EXPECT_GT(e.stats().kv_usage, 0.0);
  EXPECT_TRUE(e.abort(id));
  EXPECT_EQ(e.stats().kv_usage, 0.0);
  EXPECT_EQ(out[id].reason, FinishReason::Abort);
  EXPECT_FALSE(e.abort(id));
  expect_pool_whole(e);
}

TEST_F(StoriesEngine, RejectsWhatCanNeverFitWithTheNumbers) {
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.num_blocks = 8;  // 32 tokens
  Engine e(*model_, cfg);
  std::map<RequestId, Outcome> out;
  try {
    e.add_request(encode("Once upon a time"), sampled(40, 1), collect(out, nullptr));
    FAIL() << "accepted a request that cannot fit";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("45 tokens"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("32 tokens"), std::string::npos) << err.what();
  }
  EXPECT_THROW(e.add_request({}, sampled(4, 1), nullptr), Error);
  EXPECT_THROW(e.add_request({1, 99999}, sampled(4, 1), nullptr), Error);
  EXPECT_THROW(e.add_request({1}, sampled(0, 1), nullptr), Error);
  EXPECT_FALSE(e.has_work());
}

// KV budget strings to bytes, and bytes to blocks: stories260K holds 2 x 5 layers x 4 KV heads x 8
// dims x 2 bytes = 640 bytes per token in F16, 1280 in F32.
TEST_F(StoriesEngine, KvBudgetsInBytesAndUnits) {
  EXPECT_EQ(kv_budget_from_string("1000"), 1000u);
  EXPECT_EQ(kv_budget_from_string("2k"), 2000u);
  EXPECT_EQ(kv_budget_from_string("3KiB"), 3072u);
  EXPECT_EQ(kv_budget_from_string("1.5MB"), 1500000u);
  EXPECT_EQ(kv_budget_from_string("512MiB"), 536870912u);
  EXPECT_EQ(kv_budget_from_string("2gb"), 2000000000u);
  EXPECT_EQ(kv_budget_from_string("1GiB"), 1073741824u);
  EXPECT_EQ(kv_budget_from_string("7b"), 7u);
  EXPECT_GT(kv_budget_from_string("0.01"), 0u) << "a fraction of free memory";
  for (const char* bad : {"", "-5MiB", "12 parsecs", "abc", "0"}) EXPECT_THROW(kv_budget_from_string(bad), Error) << bad;
  for (DType t : {DType::F16, DType::F32}) {
    EngineConfig cfg;
    cfg.block_size = 16;
    cfg.kv_type = t;
    cfg.kv_cache_bytes = 100 * 1280 * 16 + 5;
    Engine e(*model_, cfg);
    const int64_t per_token = t == DType::F16 ? 640 : 1280;
    EXPECT_EQ(e.capacity().bytes_per_token, per_token);
    EXPECT_EQ(e.capacity().num_blocks, (100 * 1280 * 16 + 5) / (per_token * 16));
    EXPECT_EQ(e.capacity().tokens, e.capacity().num_blocks * 16);
    const int64_t ctx = e.max_model_len();
    const std::string text = e.capacity().describe(ctx);
    const double mib = double(e.capacity().num_blocks) * 16 * double(per_token) / 1048576.0;
    EXPECT_NE(text.find(fmt::format("{} bytes per token", per_token)), std::string::npos) << text;
    EXPECT_NE(text.find(fmt::format("{:.1f} MiB", mib)), std::string::npos) << text;
    EXPECT_NE(text.find(fmt::format("{:.2f} sequences of the full context ({} tokens)",
                                    double(e.capacity().tokens) / double(ctx), ctx)), std::string::npos) << text;
  }
}

// ignore_eos keeps generating past the end-of-generation token (made certain with a logit bias).
TEST_F(StoriesEngine, IgnoreEosAndStopTokens) {
  Engine e(*model_, EngineConfig{});
  std::map<RequestId, Outcome> out;
  GenerationParams p = sampled(5, 1, 0.0f);
  p.sampling.logit_bias = {{2, 100.0f}};  // EOS
  const RequestId stops = e.add_request(encode("Once upon a time"), p, collect(out, nullptr));
  p.ignore_eos = true;
  const RequestId goes_on = e.add_request(encode("Once upon a time"), p, collect(out, nullptr));
  GenerationParams q = sampled(20, 1, 0.0f);
  const Outcome free_run = run_alone(*model_, encode("Once upon a time"), q);
  q.stop_token_ids = {free_run.tokens[3]};
  const RequestId stop_id = e.add_request(encode("Once upon a time"), q, collect(out, nullptr));
  drain(e, out);
  EXPECT_EQ(out[stops].tokens, std::vector<int32_t>{2});
  EXPECT_EQ(out[stops].reason, FinishReason::Stop);
  EXPECT_EQ(out[goes_on].tokens, std::vector<int32_t>(5, 2));
  EXPECT_EQ(out[goes_on].reason, FinishReason::Length);
  const auto first = std::find(free_run.tokens.begin(), free_run.tokens.end(), free_run.tokens[3]);
  EXPECT_EQ(out[stop_id].tokens, std::vector<int32_t>(free_run.tokens.begin(), first + 1));
  EXPECT_EQ(out[stop_id].reason, FinishReason::Stop);
}

TEST_F(StoriesEngine, NaiveBaselineGivesTheSameTokens) {
  const std::vector<std::string> texts = {"Once upon a time", "The little girl went to the park and saw",
                                          "Tom had a red ball"};
  std::vector<NaiveRequest> reqs;
  for (size_t i = 0; i < texts.size(); ++i) reqs.push_back({encode(texts[i]), sampled(10 + 7 * int(i), i)});
  NaiveEngine naive(*model_, 2);
  const NaiveResult r = naive.run(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(r.outputs[i], run_alone(*model_, reqs[i].prompt, reqs[i].params).tokens);
  EXPECT_GT(r.reserved_slot_steps, r.used_slot_steps);
}

TEST_F(StoriesEngine, EngineLoopStreamsAndAborts) {
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.num_blocks = 128;
  Engine e(*model_, cfg);
  EngineLoop loop(e);
  auto s1 = loop.submit(encode("Once upon a time"), sampled(12, 3));
  auto s2 = loop.submit(encode("Lily"), sampled(400, 4));
  EXPECT_THROW(loop.submit({}, sampled(4, 1)), Error);
  std::vector<int32_t> got;
  for (;;) {
    auto ev = s1->next(std::chrono::seconds(30));
    ASSERT_TRUE(ev.has_value());
    if (ev->finished) {
      EXPECT_EQ(ev->reason, FinishReason::Length);
      break;
    }
    got.push_back(ev->token);
  }
  EXPECT_EQ(got, run_alone(*model_, encode("Once upon a time"), sampled(12, 3)).tokens);
  loop.abort(s2->id);
  for (;;) {
    auto ev = s2->next(std::chrono::seconds(30));
    ASSERT_TRUE(ev.has_value());
    if (ev->finished) {
      EXPECT_EQ(ev->reason, FinishReason::Abort);
      break;
    }
  }
  EXPECT_EQ(loop.stats().kv_usage, 0.0);
}

// The prefix cache registers blocks from each request's hash chain, extended as tokens are decoded:
// a later prompt that repeats an earlier request's prompt and output finds all of it cached.
TEST_F(StoriesEngine, PrefixCacheHitsDecodedTokensToo) {
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.num_blocks = 64;
  Engine e(*model_, cfg);
  std::map<RequestId, Outcome> out;
  const auto prompt = encode("Once upon a time there was");  // not a multiple of 4 tokens
  const GenerationParams p = sampled(12, 3, 0.0f);
  const RequestId a = e.add_request(prompt, p, collect(out, nullptr));
  drain(e, out);
  ASSERT_EQ(out[a].tokens.size(), 12u);
  // A's KV covers its prompt and all its output but the last token.
  auto longer = prompt;
  longer.insert(longer.end(), out[a].tokens.begin(), out[a].tokens.end());
  const int64_t hits_before = e.stats().prefix_hits;
  const RequestId b = e.add_request(longer, p, collect(out, nullptr));
  e.step();
  EXPECT_EQ(e.stats().prefix_hits - hits_before, int64_t(longer.size() - 1) / 4 * 4);
  drain(e, out);
  EXPECT_EQ(out[b].tokens, run_alone(*model_, longer, p).tokens);
  expect_pool_whole(e);
}

// Engine::stats() keeps counters instead of walking block tables: they agree with the tables at
// every step, through growth, preemption and finishing.
TEST_F(StoriesEngine, StatsAgreeWithTheBlockTables) {
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.num_blocks = 20;  // preemptions
  cfg.scheduler.max_batched_tokens = 16;
  Engine e(*model_, cfg);
  std::map<RequestId, Outcome> out;
  const std::vector<std::string> texts = {"Once upon a time", "The little girl went to the park",
                                          "Once upon a time there was a cat", "Tom had a red ball"};
  for (size_t i = 0; i < texts.size(); ++i) e.add_request(encode(texts[i]), sampled(25, i), collect(out, nullptr));
  int steps = 0;
  while (e.has_work() && steps++ < 10000) {
    e.step();
    int64_t reserved = 0, used = 0;
    for (const Request* r : e.scheduler().running()) {
      for (int g = 0; g < e.kv_manager().n_groups(); ++g)
        for (int32_t b : r->kv.table(g)) reserved += b >= 0 ? cfg.block_size : 0;
      used += r->num_computed_tokens * e.kv_manager().n_groups();
    }
    const EngineStats st = e.stats();
    ASSERT_EQ(st.reserved_slots, reserved) << "step " << steps;
    ASSERT_EQ(st.used_slots, used) << "step " << steps;
  }
  EXPECT_GT(e.stats().preemptions, 0);
  EXPECT_EQ(e.stats().reserved_slots, 0);
  expect_pool_whole(e);
}

// Aborting a request that waits (never scheduled, or preempted) takes it out of the queue.
TEST_F(StoriesEngine, AbortWhileWaiting) {
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.num_blocks = 64;
  cfg.scheduler.max_seqs = 1;
  cfg.scheduler.policy = SchedulingPolicy::Priority;
  Engine e(*model_, cfg);
  std::map<RequestId, Outcome> out;
  std::vector<RequestId> ids;
  for (int i = 0; i < 4; ++i) {
    GenerationParams p = sampled(6, i);
    p.priority = i % 2;
    ids.push_back(e.add_request(encode("Once upon a time"), p, collect(out, nullptr)));
  }
  e.step();
  ASSERT_EQ(e.scheduler().running().size(), 1u);
  ASSERT_EQ(e.scheduler().waiting().size(), 3u);
  EXPECT_TRUE(e.abort(ids[3]));
  EXPECT_TRUE(e.abort(ids[1]));
  EXPECT_EQ(e.scheduler().waiting().size(), 1u);
  EXPECT_EQ(e.scheduler().waiting().front()->id, ids[2]);
  drain(e, out);
  EXPECT_EQ(out[ids[1]].reason, FinishReason::Abort);
  EXPECT_TRUE(out[ids[1]].tokens.empty());
  EXPECT_EQ(out[ids[2]].tokens, run_alone(*model_, encode("Once upon a time"), sampled(6, 2)).tokens);
  expect_pool_whole(e);
}

// The default real model: concurrent requests equal the same requests one by one.
TEST(RealModelEngine, DefaultModelBatchInvariance) {
  const std::string path = test::cached_model("qwen2.5-coder-0.5b-instruct");
  ASSERT_FALSE(path.empty()) << "run scripts/setup";
  auto m = Model::load(path);
  const std::vector<std::string> texts = {"def fibonacci(n):", "The capital of France is",
                                          "# Sort a list in Python\n", "def fibonacci(n):\n    if n < 2:"};
  for (int64_t chunk : {3, 64}) {
    EngineConfig cfg;
    cfg.block_size = 16;
    cfg.num_blocks = 64;
    cfg.scheduler.max_batched_tokens = chunk;
    Engine e(*m, cfg);
    std::map<RequestId, Outcome> out;
    std::vector<RequestId> ids;
    for (size_t i = 0; i < texts.size(); ++i)
      ids.push_back(e.add_request(m->tokenizer().encode(texts[i], true), sampled(12, i, i % 2 ? 0.0f : 0.8f), collect(out, nullptr)));
    drain(e, out);
    for (size_t i = 0; i < texts.size(); ++i) {
      const Outcome want = run_alone(*m, m->tokenizer().encode(texts[i], true), sampled(12, i, i % 2 ? 0.0f : 0.8f));
      EXPECT_EQ(out[ids[i]].tokens, want.tokens) << texts[i] << " chunk " << chunk;
      EXPECT_EQ(out[ids[i]].logprobs, want.logprobs) << texts[i] << " chunk " << chunk;
    }
    expect_pool_whole(e);
  }
}

// Quantized KV caches (head dimension 64, so Q8_0 too): concurrent requests sharing a prefix, with
// prefix caching (a warm second round hits it), equal each request run alone on its own cache of the
// same type; the capacity follows the type's bytes.
TEST(RealModelEngine, QuantizedKvBatchInvarianceAndPrefixCaching) {
  const std::string path = test::cached_model("qwen2.5-coder-0.5b-instruct");
  ASSERT_FALSE(path.empty()) << "run scripts/setup";
  auto m = Model::load(path);
  const std::string prefix = "# A helper module\nimport os\n\n";
  const std::vector<std::string> texts = {prefix + "def fibonacci(n):", prefix + "def read_file(path):",
                                          "The capital of France is"};
  for (DType t : {DType::Q8_0, DType::F8_E4M3}) {
    std::vector<test::Outcome> alone;
    for (size_t i = 0; i < texts.size(); ++i)
      alone.push_back(run_alone(*m, m->tokenizer().encode(texts[i], true), sampled(6, i, i % 2 ? 0.0f : 0.8f), t));
    EngineConfig cfg;
    cfg.block_size = 4;
    cfg.num_blocks = 64;
    cfg.kv_type = t;
    cfg.prefix_caching = true;
    cfg.scheduler.max_batched_tokens = 5;
    Engine e(*m, cfg);
    for (int round = 0; round < 2; ++round) {
      std::map<RequestId, Outcome> out;
      std::vector<RequestId> ids;
      for (size_t i = 0; i < texts.size(); ++i)
        ids.push_back(e.add_request(m->tokenizer().encode(texts[i], true), sampled(6, i, i % 2 ? 0.0f : 0.8f),
                                    collect(out, nullptr)));
      drain(e, out);
      for (size_t i = 0; i < texts.size(); ++i) {
        EXPECT_EQ(out[ids[i]].tokens, alone[i].tokens) << dtype_info(t).name << " round " << round << ": " << texts[i];
        EXPECT_EQ(out[ids[i]].logprobs, alone[i].logprobs) << "bitwise log-probabilities";
      }
      expect_pool_whole(e);
    }
    EXPECT_GT(e.stats().prefix_hits, 0);
    const int64_t f16 = m->config().kv_bytes_per_token(2.0);
    EXPECT_EQ(e.capacity().bytes_per_token, t == DType::Q8_0 ? f16 * 34 / 64 : f16 / 2);
    EXPECT_NE(e.capacity().describe(e.max_model_len()).find(kv_cache_type_name(t)), std::string::npos);
  }
}

TEST(Capacity, LatentAttentionKeepsOneRowPerLayer) {
  // DeepSeek-V2-Lite: 27 layers x (512 latent + 64 rotated key values) x 2 bytes, not 2 x layers x heads x d_head.
  PlanInput in;
  ASSERT_TRUE(plan_preset("deepseek-v2-lite", in));
  EXPECT_EQ(in.kv_rows, 1);
  EXPECT_EQ(plan_capacity(in).kv_bytes_per_token, 27u * (512 + 64) * 2);
  in.kv_rows = 3;
  EXPECT_THROW(plan_capacity(in), Error);
}

TEST(Capacity, ReproducesTheSeedFigures) {
  const double GiB = 1024.0 * 1024 * 1024;
  PlanInput in;
  ASSERT_TRUE(plan_preset("llama3-8b", in));
  in.context = 8192;
  in.memory_bytes = 80ull << 30;
  auto r = plan_capacity(in);
  EXPECT_EQ(r.kv_bytes_per_token, 2ull * 32 * 8 * 128 * 2);
  EXPECT_DOUBLE_EQ(r.kv_bytes_per_sequence / GiB, 1.0);  // ~1 GiB per 8K sequence
  ASSERT_TRUE(plan_preset("llama3-70b", in));
  r = plan_capacity(in);
  EXPECT_DOUBLE_EQ(r.kv_bytes_per_sequence / GiB, 2.5);
  in.context = 32768;
  in.users = 100;
  r = plan_capacity(in);
  EXPECT_DOUBLE_EQ(r.kv_bytes_per_sequence / GiB, 10.0);
  EXPECT_NEAR(r.kv_bytes_for_users / 1e12, 1.07, 0.01);  // ~1 TB for 100 users at 32K
  in.users = 0;
  in.memory_bytes = 48ull * 1000 * 1000 * 1000;
  in.weight_bits = 4;
  EXPECT_TRUE(plan_capacity(in).weights_fit);  // 4-bit 70B: ~35 GB
  in.weight_bits = 16;
  EXPECT_FALSE(plan_capacity(in).weights_fit);  // BF16 70B: ~141 GB
  EXPECT_EQ(plan_capacity(in).max_sequences, 0);
}

}  // namespace
}  // namespace serval

namespace serval {
namespace {

// Gemma 3: sliding-window layers keep only the blocks inside their window; the engine's tokens still
// equal the contiguous single-sequence run.
TEST(RealModelEngine, Gemma3SlidingWindowFreesBlocksAndMatchesAlone) {
  const std::string path = test::cached_model("gemma-3-270m");
  ASSERT_FALSE(path.empty()) << "run scripts/setup";
  auto m = Model::load(path);
  ASSERT_EQ(m->config().n_kv_groups(), 2);
  ASSERT_EQ(m->config().sliding_window, 512);
  auto prompt = m->tokenizer().encode(test::read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/tinystory.txt"), true);
  prompt.resize(700);  // longer than the window
  GenerationParams p;
  p.max_tokens = 6;
  p.sampling.temperature = 0;
  EngineConfig cfg;
  cfg.block_size = 16;
  cfg.num_blocks = 64;  // 1024 tokens per group
  cfg.scheduler.max_batched_tokens = 256;
  Engine e(*m, cfg);
  std::map<RequestId, Outcome> out;
  const RequestId id = e.add_request(prompt, p, collect(out, nullptr));
  while (e.has_work()) {
    e.step();
    if (e.has_work() && !e.scheduler().running().empty()) {
      const Request* r = e.scheduler().running()[0];
      int64_t held_global = 0, held_window = 0;
      for (int32_t b : r->kv.table(0)) held_global += b >= 0;
      for (int32_t b : r->kv.table(1)) held_window += b >= 0;
      EXPECT_LE(held_window, (512 + 256) / 16 + 2) << "the window group keeps only what the window needs";
      if (r->num_computed_tokens >= 700) {
        EXPECT_GT(held_global, held_window);
      }
      // The engine's block counts add both groups up.
      const EngineStats st = e.stats();
      EXPECT_EQ(st.blocks_total, 128);
      EXPECT_EQ(st.blocks_free, e.kv_manager().pool(0).n_free() + e.kv_manager().pool(1).n_free());
      EXPECT_EQ(st.blocks_total - st.blocks_free, held_global + held_window);
    }
  }
  EXPECT_EQ(out[id].tokens, run_alone(*m, prompt, p).tokens);
  expect_pool_whole(e);
}

}  // namespace
}  // namespace serval

#ifdef _OPENMP
#include <omp.h>
#endif

#include "base/cpu.h"

namespace serval {
namespace {

// An exception thrown by run_on_engine's function reaches the caller; the engine thread lives on.
TEST_F(StoriesEngine, RunOnEngineRethrowsAndTheLoopCarriesOn) {
  EngineConfig cfg;
  cfg.block_size = 4;
  cfg.num_blocks = 64;
  Engine e(*model_, cfg);
  EngineLoop loop(e);
  EXPECT_THROW(loop.run_on_engine([](Engine&) { throw Error("from the engine thread"); }), Error);
  EXPECT_THROW(loop.run_on_engine([](Engine&) { throw std::runtime_error("not an Error"); }), std::runtime_error);
  auto s = loop.submit(encode("Once upon a time"), sampled(5, 7));
  std::vector<int32_t> got;
  for (;;) {
    auto ev = s->next(std::chrono::seconds(30));
    ASSERT_TRUE(ev.has_value()) << "the engine thread no longer serves requests";
    if (ev->finished) {
      EXPECT_EQ(ev->reason, FinishReason::Length);
      break;
    }
    got.push_back(ev->token);
  }
  EXPECT_EQ(got, run_alone(*model_, encode("Once upon a time"), sampled(5, 7)).tokens);
  EXPECT_EQ(loop.stats().kv_usage, 0.0);
}

#ifdef _OPENMP
// OpenMP's thread count is per thread: EngineLoop's thread uses the process-wide compute setting,
// not the runtime's default.
TEST_F(StoriesEngine, EngineLoopThreadUsesTheComputeThreadSetting) {
  EngineConfig cfg;
  cfg.num_blocks = 16;
  Engine e(*model_, cfg);
  for (int n : {1, 3}) {
    set_compute_threads(n);
    EngineLoop loop(e);
    int seen = 0;
    loop.run_on_engine([&](Engine&) { seen = omp_get_max_threads(); });
    EXPECT_EQ(seen, n);
  }
  set_compute_threads(0);
  EngineLoop loop(e);
  int seen = 0;
  loop.run_on_engine([&](Engine&) { seen = omp_get_max_threads(); });
  EXPECT_EQ(seen, available_cores());
}
#endif

}  // namespace
}  // namespace serval

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define SERVAL_CALLGRIND 1
#endif
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace serval {
namespace {

// stories260K with its GGUF context length raised to `n_ctx` (a copy in the test's temp directory):
// its forward pass is tiny, so the engine's own per-step work shows at long contexts.
std::string stories_with_context(uint32_t n_ctx) {
  std::string bytes = test::read_file(test::shared_path("models/stories260K.gguf"));
  const std::string key = "llama.context_length";
  const size_t at = bytes.find(key);
  if (at == std::string::npos) return "";
  uint32_t type = 0;
  std::memcpy(&type, bytes.data() + at + key.size(), 4);
  if (type != 4) return "";  // GGUF_TYPE_UINT32
  std::memcpy(bytes.data() + at + key.size() + 4, &n_ctx, 4);
  const std::string path = ::testing::TempDir() + "/stories260K-ctx" + std::to_string(n_ctx) + ".gguf";
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// Engine overhead per decode step at 16 running sequences with ~4K-token contexts (a shared
// 4000-token prefix, computed once and then found in the prefix cache, and 16 distinct tokens each),
// with stats() after each step as EngineLoop does. Disabled: a measurement, not a check. For the
// instruction counts of the measured steps only (Model::forward included: subtract its inclusive
// cost), run it under callgrind:
//   OMP_NUM_THREADS=1 SERVAL_BENCH_STEPS=4 valgrind --tool=callgrind --instr-atstart=no
//     --collect-atstart=no build/tests/serval_unit_tests --gtest_also_run_disabled_tests
//     --gtest_filter='EngineBench.*'        (one command; about 20 minutes, mostly the forward passes)
//   callgrind_annotate --inclusive=yes callgrind.out.<pid>.<n>
// SERVAL_BENCH_STEPS sets the measured steps per scenario (default 32). One dump per scenario:
// greedy; API-like sampling (temperature 1, top_k off, top_p 0.95, presence and frequency penalties
// over the whole history, as the HTTP API sends them); greedy with a 17th request waiting at the
// head of the queue that shares the cached prefix but does not fit (its lookup is repeated each step).
TEST(EngineBench, DISABLED_DecodeStepOverhead16x4K) {
  const std::string path = stories_with_context(8192);
  ASSERT_FALSE(path.empty());
  auto m = Model::load(path);
  constexpr int kSeqs = 16, kPrefix = 4000, kTail = 16, kBlock = 16;
  const char* steps_env = std::getenv("SERVAL_BENCH_STEPS");
  const int kSteps = steps_env ? std::clamp(std::atoi(steps_env), 1, 64) : 32;
  std::mt19937 rng(7);
  std::vector<int32_t> prefix = {1};
  while (int(prefix.size()) < kPrefix) prefix.push_back(int32_t(3 + rng() % 500));
  EngineConfig cfg;
  cfg.block_size = kBlock;
  cfg.kv_type = DType::F32;  // the cheapest attention: the forward pass is not what is measured
  // Room for the prefix and the waiter's 125 blocks (so that it could run alone), but with the 16
  // sequences' own blocks (2 to 7 each) too few free blocks for it; no preemption.
  constexpr int kWaiterTail = 2000;
  cfg.num_blocks = kPrefix / kBlock + kWaiterTail / kBlock + 16;
  cfg.scheduler.max_batched_tokens = 2048;
  Engine e(*m, cfg);
  for (int scenario = 0; scenario < 3; ++scenario) {
    const char* name = scenario == 0 ? "greedy" : scenario == 1 ? "api_sampling" : "greedy_blocked_waiter";
    GenerationParams p;
    p.max_tokens = kSteps + 16;
    p.ignore_eos = true;
    p.sampling.temperature = 0;
    if (scenario == 1) {
      p.sampling.temperature = 1.0f;
      p.sampling.top_k = 0;
      p.sampling.top_p = 0.95f;
      p.sampling.min_p = 0;
      p.sampling.presence_penalty = 0.5f;
      p.sampling.frequency_penalty = 0.5f;
      p.sampling.repeat_last_n = -1;
    }
    int64_t generated = 0;
    for (int s = 0; s < kSeqs; ++s) {
      auto prompt = prefix;
      for (int k = 0; k < kTail; ++k) prompt.push_back(int32_t(3 + rng() % 500));
      p.sampling.seed = uint64_t(s);
      e.add_request(prompt, p, [&](const TokenEvent& ev) { generated += !ev.finished; });
      // The first prompt is computed alone (once: later scenarios find it cached); the others find
      // its prefix cached.
      while (s == 0 && generated == 0) e.step();
    }
    // Until every sequence decodes (all prompts computed, one token each step).
    while (generated < kSeqs) e.step(), e.stats();
    if (scenario == 2) {  // the shared prefix (cached) and 2000 more tokens: 125 blocks more than it holds
      auto other = prefix;
      for (int k = 0; k < kWaiterTail; ++k) other.push_back(int32_t(3 + rng() % 500));
      e.add_request(other, p, nullptr);
    }
    for (int i = 0; i < 2; ++i) e.step(), e.stats();
    ASSERT_EQ(e.scheduler().running().size(), size_t(kSeqs));
    ASSERT_EQ(e.scheduler().waiting().size(), scenario == 2 ? 1u : 0u);
    const int64_t preemptions = e.stats().preemptions;
    const auto t0 = std::chrono::steady_clock::now();
#ifdef SERVAL_CALLGRIND
    CALLGRIND_START_INSTRUMENTATION;
    CALLGRIND_ZERO_STATS;
    CALLGRIND_TOGGLE_COLLECT;
#endif
    int64_t stat_sink = 0;
    for (int i = 0; i < kSteps; ++i) {
      e.step();
      stat_sink += e.stats().reserved_slots;
    }
#ifdef SERVAL_CALLGRIND
    CALLGRIND_TOGGLE_COLLECT;
    CALLGRIND_DUMP_STATS_AT(name);
    CALLGRIND_STOP_INSTRUMENTATION;
#endif
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_EQ(e.scheduler().running().size(), size_t(kSeqs));
    ASSERT_EQ(e.scheduler().waiting().size(), scenario == 2 ? 1u : 0u);
    EXPECT_EQ(e.stats().preemptions, preemptions);
    std::printf("%s: %d decode steps of %d sequences at ~%d tokens: %.1f us per step (forward included)%s\n", name,
                kSteps, kSeqs, kPrefix + kTail, us / kSteps, stat_sink > 0 ? "" : "?");
    e.abort_all();
  }
}

}  // namespace
}  // namespace serval
