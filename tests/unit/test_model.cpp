// Model forward pass against independent references: llama.cpp's recorded stories260K run, the
// F32 safetensors twin of a Q8_0 GGUF, and batch invariance (alone vs together, any chunking).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/error.h"

#include "io/gguf.h"
#include "model/model.h"
#include "model/requant.h"
#include "model/session.h"
#include "quant/quantize_model.h"
#include "sampling/sampler.h"
#include "test_support.h"

namespace serval {
namespace {

TEST(Golden, Stories260kMatchesLlamaCppTokenByToken) {
  const auto ref = nlohmann::json::parse(test::read_file(test::shared_path("models/reference/stories260K-once-upon-a-time.json")));
  auto model = Model::load(test::shared_path("models/stories260K.gguf"));
  const auto prompt = model->tokenizer().encode(ref["prompt"].get<std::string>(), true);
  ASSERT_EQ(prompt, ref["prompt_tokens_with_bos"].get<std::vector<int32_t>>());
  SingleSequence seq(*model, 512);
  auto logits = seq.eval(prompt);
  double max_err = 0;
  std::string text;
  for (const auto& step : ref["generated"]) {
    const auto r = logprobs_of(logits, argmax(logits), 5);
    ASSERT_EQ(r.token, step["id"].get<int32_t>()) << "after: " << text;
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_EQ(r.top[i].id, step["top"][i]["id"].get<int32_t>());
      const double err = std::abs(r.top[i].logprob - step["top"][i]["logprob"].get<double>());
      max_err = std::max(max_err, err);
      EXPECT_LT(err, 2e-3) << "position " << text.size();
    }
    text += model->tokenizer().token_to_piece(r.token);
    logits = seq.eval(std::vector<int32_t>{r.token});
  }
  EXPECT_EQ(text, ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, "
                  "red ball. She wanted to play with it,");
  RecordProperty("max_logprob_error", std::to_string(max_err));
}

// Logits of every position of `tokens` evaluated in one sequence.
std::vector<float> all_logits(const Model& m, const std::vector<int32_t>& tokens, int64_t n_batch = 512,
                              DType kv_type = DType::F16) {
  SingleSequence seq(m, int64_t(tokens.size()), kv_type);
  return seq.eval(tokens, true, n_batch);
}

TEST(Golden, TinyStoriesSafetensorsAndQ8GgufAgree) {
  const std::string dir = test::shared_path("models/TinyStories-656K");
  auto f32 = Model::load(dir);
  auto q8 = Model::load(test::shared_path("models/TinyStories-656K-Q8_0.gguf"), {dir + "/tokenizer.json"});
  auto tokens = f32->tokenizer().encode(test::read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/tinystory.txt"), true);
  ASSERT_GE(tokens.size(), 500u);
  tokens.resize(500);
  const auto a = all_logits(*f32, tokens), b = all_logits(*q8, tokens);
  const int64_t n_vocab = f32->config().n_vocab;
  int same_top1 = 0;
  double kl_sum = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::span<const float> la(a.data() + t * n_vocab, n_vocab), lb(b.data() + t * n_vocab, n_vocab);
    same_top1 += argmax(la) == argmax(lb);
    const auto za = logprobs_of(la, 0, 0).logprob - la[0], zb = logprobs_of(lb, 0, 0).logprob - lb[0];
    double kl = 0;
    for (int64_t v = 0; v < n_vocab; ++v) {
      const double lpa = la[v] + za, lpb = lb[v] + zb;
      kl += std::exp(lpa) * (lpa - lpb);
    }
    kl_sum += kl;
  }
  const double top1 = same_top1 / double(tokens.size()), mean_kl = kl_sum / double(tokens.size());
  EXPECT_GE(top1, 0.95);
  EXPECT_LT(mean_kl, 0.01);
  EXPECT_GT(mean_kl, 0.0) << "Q8_0 and F32 cannot be bit-identical; the comparison would be vacuous";
  RecordProperty("top1_agreement", std::to_string(top1));
  RecordProperty("mean_kl", std::to_string(mean_kl));
}

// Every KV cache type stories260K can hold (its d_head of 8 rules out Q8_0's blocks of 32; the
// engine tests run Q8_0 on Qwen2.5-0.5B).
class BatchInvariance : public ::testing::TestWithParam<DType> {};

TEST_P(BatchInvariance, ChunkSizeDoesNotChangeLogits) {
  auto model = Model::load(test::shared_path("models/stories260K.gguf"));
  const auto tokens = model->tokenizer().encode("Once upon a time, there was a big dog who liked to run in the sun.", true);
  const auto whole = all_logits(*model, tokens, 512, GetParam());
  for (int64_t chunk : {1, 3, 7}) EXPECT_EQ(all_logits(*model, tokens, chunk, GetParam()), whole) << "chunk " << chunk;
  if (GetParam() != DType::F16)
    EXPECT_NE(whole, all_logits(*model, tokens)) << "the cache type must change something (else the test is vacuous)";
}

TEST_P(BatchInvariance, SequencesTogetherEqualSequencesAlone) {
  auto model = Model::load(test::shared_path("models/stories260K.gguf"));
  const auto& tok = model->tokenizer();
  const std::vector<std::vector<int32_t>> prompts = {tok.encode("Once upon a time", true),
                                                     tok.encode("The cat sat on the mat and looked at the", true),
                                                     tok.encode("Lily", true)};
  const int64_t n_vocab = model->config().n_vocab;
  // One batch holding all three sequences, KV slots interleaved in one cache.
  KvCache kv(model->config(), 64, GetParam());
  Batch batch;
  batch.block_tables[0].resize(prompts.size());
  int32_t next_slot = 0;
  for (size_t pos = 0;; ++pos) {
    bool any = false;
    for (size_t s = 0; s < prompts.size(); ++s) {
      if (pos >= prompts[s].size()) continue;
      batch.block_tables[0][s].push_back(next_slot);
      batch.add(prompts[s][pos], int32_t(pos), int32_t(s), next_slot++, true);
      any = true;
    }
    if (!any) break;
  }
  std::vector<float> together;
  model->forward(batch, kv, together);
  for (size_t s = 0; s < prompts.size(); ++s) {
    const auto alone = all_logits(*model, prompts[s], 512, GetParam());
    size_t row = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      if (batch.seq_ids[i] != int32_t(s)) continue;
      const std::vector<float> got(together.begin() + i * n_vocab, together.begin() + (i + 1) * n_vocab);
      const std::vector<float> want(alone.begin() + row * n_vocab, alone.begin() + (row + 1) * n_vocab);
      EXPECT_EQ(got, want) << "sequence " << s << " position " << row;
      ++row;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KvTypes, BatchInvariance,
                         ::testing::Values(DType::F16, DType::F32, DType::BF16, DType::F8_E4M3),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_info(i.param).name); });

TEST(Model, ForwardRejectsBadBatches) {
  auto model = Model::load(test::shared_path("models/stories260K.gguf"));
  KvCache kv(model->config(), 4);
  std::vector<float> logits;
  Batch b;
  b.block_tables[0] = {{0, 1}};
  b.add(9999, 0, 0, 0, true);  // token outside the vocabulary
  EXPECT_THROW(model->forward(b, kv, logits), Error);
  Batch c;
  c.block_tables[0] = {{0}};
  c.add(1, 0, 0, 7, true);  // slot outside the cache
  EXPECT_THROW(model->forward(c, kv, logits), Error);
  SingleSequence seq(*model, 3);
  EXPECT_THROW(seq.eval(std::vector<int32_t>{1, 2, 3, 4}), Error);  // longer than the context
}


// A model loaded for the vocabulary's first N logits (a draft model's reduced head) gives, for every
// row, exactly the first N logits of the whole model: the cut output matrix is the same rows packed
// alone. Stories260K (its output matrix its own) and the Qwen 0.5B (tied to its Q8_0 embedding).
TEST(Model, LogitRowsAreThePrefixOfTheWholeVocabulary) {
  std::vector<std::pair<std::string, int64_t>> cases = {{test::shared_path("models/stories260K.gguf"), 300}};
  if (const std::string q = test::cached_model("qwen2.5-coder-0.5b-instruct"); !q.empty()) cases.push_back({q, 65536});
  for (const auto& [path, n] : cases) {
    auto whole = Model::load(path);
    LoadOptions cut;
    cut.logit_rows = n;
    auto head = Model::load(path, cut);
    EXPECT_EQ(head->n_logits(), n);
    EXPECT_EQ(whole->n_logits(), whole->config().n_vocab);
    const auto tokens = whole->tokenizer().encode("def add(a, b):\n    return a + b\n", true);
    const auto all = all_logits(*whole, tokens), part = all_logits(*head, tokens);
    const int64_t V = whole->config().n_vocab;
    ASSERT_EQ(part.size(), tokens.size() * size_t(n));
    for (size_t t = 0; t < tokens.size(); ++t)
      ASSERT_EQ(std::memcmp(part.data() + t * n, all.data() + t * V, size_t(n) * 4), 0) << path << " row " << t;
    LoadOptions everything;
    everything.logit_rows = V;  // as many as the vocabulary: all of them
    EXPECT_EQ(Model::load(path, everything)->n_logits(), V);
  }
}

// A model requantized as it loads (LoadOptions::requant, the draft's --draft-quantization) is the model
// `serval quantize --allow-requantize --pure` writes: the same tensors converted, the same bytes, and
// so bitwise the same logits. TinyStories-656K's Q8_0 to Q4_0, and to Q5_0 for a second type.
TEST(Model, RequantizedAtLoadIsTheRequantizedFile) {
  const std::string src = test::shared_path("models/TinyStories-656K-Q8_0.gguf");
  const std::string tok = test::shared_path("models/TinyStories-656K") + "/tokenizer.json";
  for (const char* type : {"Q4_0", "Q5_0"}) {
    const auto file = std::filesystem::temp_directory_path() / ("serval-requant-" + std::string(type) + "-" + std::to_string(::getpid()) + ".gguf");
    QuantizeOptions qo;
    qo.pure = true, qo.allow_requantize = true;
    const QuantizeReport report = quantize_file(src, file.string(), parse_file_type(type), qo);
    const GgufFile in(src), written(file.string());
    const auto made = requantized_tensors(in, parse_tensor_type(type));
    EXPECT_EQ(int64_t(made->size()), report.converted) << type;
    for (const TensorRef& t : written.tensors()) {
      const TensorRef* m = made->find(t.name);
      if (!m) {
        EXPECT_EQ(t.type, in.find_tensor(t.name)->type) << t.name << " kept by one, converted by the other";
        continue;
      }
      ASSERT_EQ(m->type, t.type) << t.name;
      ASSERT_EQ(m->nbytes, t.nbytes) << t.name;
      EXPECT_EQ(std::memcmp(m->data, t.data, t.nbytes), 0) << t.name << " " << type;
    }
    LoadOptions lo;
    lo.tokenizer_json = tok;
    auto from_file = Model::load(file.string(), lo);
    lo.requant = parse_tensor_type(type);
    auto at_load = Model::load(src, lo);
    LoadOptions plain;
    plain.tokenizer_json = tok;
    auto original = Model::load(src, plain);
    const auto tokens = original->tokenizer().encode("Once upon a time, there was a little dog.", true);
    const auto a = all_logits(*at_load, tokens);
    EXPECT_EQ(a, all_logits(*from_file, tokens)) << type;
    EXPECT_NE(a, all_logits(*original, tokens)) << type << ": requantizing must change the logits (else the test is vacuous)";
    std::filesystem::remove(file);
  }
  LoadOptions bad;
  bad.requant = DType::F8_E4M3;
  EXPECT_THROW(Model::load(src, bad), Error);
  bad.requant = DType::Q4_0;
  bad.dummy = true;
  EXPECT_THROW(Model::load(src, bad), Error);
}

// Mean absolute difference of two logit arrays.
double mean_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += std::abs(double(a[i]) - b[i]);
  return sum / double(a.size());
}

// LongRoPE picks its factor set by the context in use (llama.cpp's rule): the tiny Phi-3 of
// tests/data/families (original context 4, trained 64) loads with the long set; a context of 4 takes
// the short set and changes the logits; going back gives the very same logits again.
TEST(Model, LongRopeFactorSetFollowsTheContextLength) {
  auto m = Model::load(std::string(SERVAL_SOURCE_DIR) + "/tests/data/families/phi3_longrope");
  ASSERT_TRUE(m->config().longrope);
  EXPECT_TRUE(m->uses_long_rope());
  const std::vector<int32_t> tokens = {1, 400, 401, 402, 403, 404, 405, 406};
  const auto long_set = all_logits(*m, tokens, 512, DType::F32);
  m->set_context_length(4);
  EXPECT_FALSE(m->uses_long_rope());
  EXPECT_GT(mean_abs_diff(long_set, all_logits(*m, tokens, 512, DType::F32)), 1e-3);
  m->set_context_length(5);
  EXPECT_EQ(long_set, all_logits(*m, tokens, 512, DType::F32));
  // A TP rank's share cannot switch sets (its peers loaded the long one): a clear error.
  LoadOptions split;
  split.tp = 2;
  auto share = Model::load(std::string(SERVAL_SOURCE_DIR) + "/tests/data/families/phi3_longrope", split);
  EXPECT_THROW(share->set_context_length(4), Error);
  EXPECT_NO_THROW(share->set_context_length(64));
}

// DeepSeek-V2's latent attention on the tiny model of tests/data/families (its logits are checked
// against transformers by tests/py/test_families.py): the cache holds one row of 48 latent + 16 rotated
// key values per token and layer (no V), so its bytes are layers x 64 x dtype bytes per token; the
// absorbed path gives the same bits whether a prompt runs at once or token by token (decode); every
// cache type stays close to F32 (Q8_0's 32-value blocks fit the 64-value row; FP8 stores V unrotated,
// since V is the K row).
TEST(Model, LatentAttentionCacheAndDecode) {
  auto m = Model::load(std::string(SERVAL_SOURCE_DIR) + "/tests/data/families/deepseek2");
  const auto& c = m->config();
  ASSERT_TRUE(c.mla);
  EXPECT_EQ(c.n_head_kv, 1);
  EXPECT_EQ(c.d_head, 48 + 16);
  EXPECT_EQ(c.kv_bytes_per_token(2), 3 * 64 * 2);
  for (DType t : {DType::F16, DType::F32, DType::Q8_0, DType::F8_E4M3}) {
    KvCache kv(c, 100, t);
    EXPECT_EQ(kv.bytes(), uint64_t(100 * c.kv_bytes_per_token(t == DType::Q8_0 ? 34.0 / 32 : double(dtype_info(t).block_bytes) / double(dtype_info(t).block_elems))))
        << dtype_info(t).name;
    EXPECT_EQ(kv.view(0).v, kv.view(0).k);
  }
  const std::vector<int32_t> tokens = {1, 400, 401, 402, 403, 404, 405, 406, 407, 408};
  const auto whole = all_logits(*m, tokens, 512, DType::F32);
  EXPECT_EQ(all_logits(*m, tokens, 1, DType::F32), whole);
  EXPECT_EQ(all_logits(*m, tokens, 3, DType::F32), whole);
  for (DType t : {DType::F16, DType::BF16, DType::Q8_0, DType::F8_E4M3}) {
    const double d = mean_abs_diff(all_logits(*m, tokens, 512, t), whole);
    EXPECT_GT(d, 0.0) << dtype_info(t).name;
    EXPECT_LT(d, t == DType::F8_E4M3 ? 0.05 : 0.01) << dtype_info(t).name;
  }
}

// Qwen's K bias holds outliers (|b| up to 158 on the 0.5B) that a quantized cache spent its range on;
// keys are centred on the bias's rotary mean before a q8_0 or FP8 cache stores them
// (Model::KCentring). The centre is checked against the mean of the rotated bias summed position by
// position; the centring against F32's logits: it brings q8_0's and FP8's closer. (Softmax's
// indifference to the shift is checked on the kernel, KvCacheTypes.ShiftedKeysLeaveAttentionUnchanged:
// on the model any change of K, however small, moves the logits by about 0.06 on average, because the
// matrix products quantize their inputs to int8 and some roundings flip.)
TEST(RealModelKv, KeyCentringHelpsQuantizedCaches) {
  const std::string path = test::cached_model("qwen2.5-coder-0.5b-instruct");
  ASSERT_FALSE(path.empty()) << "run scripts/setup";
  auto m = Model::load(path);
  const ModelConfig& c = m->config();
  const int64_t d = c.d_head, half = d / 2;
  ASSERT_EQ(c.rope_style, RopeStyle::Neox);
  ASSERT_GT(c.n_ctx_train, 0);
  for (int64_t il : {0, 1, 13}) {
    const auto& bias = m->weights().layers[size_t(il)].bk;
    const auto& centre = m->k_centres().at(size_t(il));
    ASSERT_EQ(centre.size(), bias.size());
    for (int64_t i : {int64_t(0), half / 2, half - 1}) {
      const double theta = std::pow(double(c.rope_base), -2.0 * double(i) / double(d));
      double mc = 0, ms = 0;
      for (int64_t p = 0; p < c.n_ctx_train; ++p) mc += std::cos(theta * double(p)), ms += std::sin(theta * double(p));
      mc /= double(c.n_ctx_train), ms /= double(c.n_ctx_train);
      for (size_t h = 0; h < bias.size() / size_t(d); ++h) {
        const size_t a = h * d + size_t(i), b = a + size_t(half);
        const double tol = 1e-4 * (std::abs(bias[a]) + std::abs(bias[b])) + 1e-5;
        EXPECT_NEAR(centre[a], bias[a] * mc - bias[b] * ms, tol) << il << " " << i << " " << h;
        EXPECT_NEAR(centre[b], bias[a] * ms + bias[b] * mc, tol) << il << " " << i << " " << h;
      }
    }
  }
  auto tokens = m->tokenizer().encode(test::read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/tinystory.txt"), true);
  ASSERT_GE(tokens.size(), 400u);
  tokens.resize(400);
  auto logits = [&](Model::KCentring mode, DType type) {
    m->set_k_centring(mode);
    return all_logits(*m, tokens, 512, type);
  };
  const auto f32 = logits(Model::KCentring::Never, DType::F32);
  for (DType type : {DType::Q8_0, DType::F8_E4M3}) {
    const double plain = mean_abs_diff(f32, logits(Model::KCentring::Never, type));
    const double centred = mean_abs_diff(f32, logits(Model::KCentring::QuantizedCaches, type));
    const std::string name = type == DType::Q8_0 ? "q8_0" : "fp8_e4m3";
    RecordProperty(name + "_not_centred", std::to_string(plain));
    RecordProperty(name + "_centred", std::to_string(centred));
    std::printf("%s: mean |logit - F32's| %.4f not centred, %.4f centred\n", name.c_str(), plain, centred);
    EXPECT_LT(centred, 0.8 * plain) << name;
  }
  const auto f16 = logits(Model::KCentring::QuantizedCaches, DType::F16);
  EXPECT_EQ(f16, logits(Model::KCentring::Never, DType::F16)) << "an F16 cache stores keys as they are";
}

}  // namespace
}  // namespace serval
