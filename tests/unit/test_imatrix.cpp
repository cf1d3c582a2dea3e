// Importance matrices: the accumulator and both of llama.cpp's file formats (exact round trips, the
// .dat's ncall rule), and the model's matmul observer (every weight, its width, and layer 0's attention
// input recomputed independently from the embedding and the norm).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <unistd.h>

#include "kernels/ops.h"
#include "model/model.h"
#include "model/session.h"
#include "quant/imatrix.h"
#include "test_support.h"

namespace serval {
namespace {

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("serval_test_imatrix_" + std::to_string(::getpid()) + name)).string();
}

// Two entries with values exact in float: rows of small multiples of 1/4.
Imatrix sample() {
  Imatrix m;
  std::vector<float> a(3 * 4), b(2 * 8);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.25f * float(int(i % 5) - 2);
  for (size_t i = 0; i < b.size(); ++i) b[i] = 0.5f * float(i % 3 + 1);
  m.add("blk.0.attn_q.weight", a.data(), 3, 4);
  m.add("blk.0.attn_q.weight", a.data(), 1, 4);  // a second call: 4 rows in all
  m.add("blk.0.ffn_down.weight", b.data(), 2, 8);
  m.datasets = {"text.txt"};
  m.chunk_count = 2;
  m.chunk_size = 3;
  return m;
}

TEST(Imatrix, AddSumsSquaresPerColumnAndCountsRows) {
  const Imatrix m = sample();
  const auto& e = m.entries.at("blk.0.attn_q.weight");
  ASSERT_EQ(e.n_per_row(), 4);
  EXPECT_EQ(e.counts, std::vector<double>{4.0});
  // Column 0: rows 0, 1, 2 and row 0 again: -0.5, 0.5, 0.25, -0.5.
  EXPECT_DOUBLE_EQ(e.sum2[0], 0.25 + 0.25 + 0.0625 + 0.25);
  const auto imp = m.importance("blk.0.attn_q.weight", 4);
  EXPECT_FLOAT_EQ(imp[0], 0.8125f / 4);
  EXPECT_NE(test::error_message([&] { Imatrix c = sample(); std::vector<float> x(5); c.add("blk.0.attn_q.weight", x.data(), 1, 5); }),
            "no error");
}

TEST(Imatrix, GgufRoundTripIsExact) {
  const Imatrix m = sample();
  const std::string path = temp_file(".gguf");
  save_imatrix(m, path, /*dat=*/false);
  const Imatrix r = load_imatrix(path);
  std::filesystem::remove(path);
  ASSERT_EQ(r.entries.size(), 2u);
  for (const auto& [name, e] : m.entries) {
    EXPECT_EQ(r.entries.at(name).sum2, e.sum2) << name;
    EXPECT_EQ(r.entries.at(name).counts, e.counts) << name;
  }
  EXPECT_EQ(r.datasets, m.datasets);
  EXPECT_EQ(r.chunk_count, 2);
  EXPECT_EQ(r.chunk_size, 3);
}

TEST(Imatrix, DatStoresMeanSquaresTimesNcall) {
  const Imatrix m = sample();
  const std::string path = temp_file(".dat");
  save_imatrix(m, path, /*dat=*/true);
  const std::string bytes = test::read_file(path);
  const Imatrix r = load_imatrix(path);
  std::filesystem::remove(path);
  // ncall = rows / chunk size rounded up: attn_q has 4 rows of chunks of 3 -> 2; ffn_down 2 rows -> 1.
  const auto& q = r.entries.at("blk.0.attn_q.weight");
  EXPECT_EQ(q.counts, std::vector<double>{2.0});
  EXPECT_EQ(r.entries.at("blk.0.ffn_down.weight").counts, std::vector<double>{1.0});
  const auto& mq = m.entries.at("blk.0.attn_q.weight");
  for (size_t j = 0; j < 4; ++j) EXPECT_EQ(q.sum2[j], double(float(mq.sum2[j] / 4 * 2))) << j;
  // The mean squares survive whatever ncall is.
  EXPECT_EQ(r.importance("blk.0.attn_q.weight", 4), m.importance("blk.0.attn_q.weight", 4));
  EXPECT_EQ(r.chunk_count, 2);
  EXPECT_EQ(r.datasets, std::vector<std::string>{"text.txt"});
  // Layout: entry count, then the first entry (the map's order): name length, name, ncall, nval.
  int32_t head[2];
  std::memcpy(head, bytes.data(), 8);
  EXPECT_EQ(head[0], 2);
  EXPECT_EQ(head[1], int32_t(std::strlen("blk.0.attn_q.weight")));
  int32_t ncall_nval[2];
  std::memcpy(ncall_nval, bytes.data() + 8 + head[1], 8);
  EXPECT_EQ(ncall_nval[0], 2);
  EXPECT_EQ(ncall_nval[1], 4);
}

struct Seen {
  int64_t cols = 0, rows = 0, calls = 0;
};

// Runs `tokens` through the model (all logits) with an observer recording what it sees.
std::map<std::string, Seen> observe(Model& model, const std::vector<int32_t>& tokens, Imatrix* im = nullptr) {
  std::map<std::string, Seen> seen;
  model.set_matmul_observer([&](const std::string& name, const float* x, int64_t n_tok, int64_t cols) {
    Seen& s = seen[name];
    EXPECT_TRUE(s.cols == 0 || s.cols == cols) << name;
    s.cols = cols, s.rows += n_tok, ++s.calls;
    if (im) im->add(name, x, n_tok, cols);
  });
  SingleSequence seq(model, int64_t(tokens.size()));
  seq.eval(tokens, /*all_logits=*/true);
  model.set_matmul_observer(nullptr);
  return seen;
}

// Mixture of experts (the tiny Qwen2-MoE of tests/data/families: 6 experts, top 3, a shared expert):
// the router and shared expert are seen as matrices, each expert's rows with its index. Every token's
// normed row goes to k experts, so over the experts the gate inputs add up to k times the router's
// (the same rows), and the rows to k x tokens; the imatrix keeps one row of sums per expert.
// A hand-written .dat: an entry with ncall 0 is taken as one call (its values the mean squares);
// one with no values, or an absurd count, is an error naming the entry.
TEST(Imatrix, DatEdgeCasesAndHostileCounts) {
  auto dat = [](int32_t ncall, std::vector<float> values) {
    std::string b;
    auto i32 = [&](int32_t v) { b.append(reinterpret_cast<const char*>(&v), 4); };
    i32(1);
    i32(1);
    b += "w";
    i32(ncall);
    i32(int32_t(values.size()));
    b.append(reinterpret_cast<const char*>(values.data()), values.size() * 4);
    const std::string path = temp_file(".dat");
    std::ofstream(path, std::ios::binary) << b;
    return path;
  };
  const std::string zero = dat(0, {4.0f, 8.0f});
  const Imatrix m = load_imatrix(zero);
  std::filesystem::remove(zero);
  EXPECT_EQ(m.entries.at("w").counts, std::vector<double>{1.0});
  EXPECT_EQ(m.importance("w", 2), (std::vector<float>{4.0f, 8.0f}));
  const std::string empty = dat(1, {});
  EXPECT_NE(test::error_message([&] { load_imatrix(empty); }).find("entry w has 0 values"), std::string::npos);
  std::filesystem::remove(empty);
}

TEST(MatmulObserver, ExpertsSeenOneByOne) {
  auto model = Model::load(std::string(SERVAL_SOURCE_DIR) + "/tests/data/families/qwen2moe");
  const auto& c = model->config();
  const std::vector<int32_t> tokens = {1, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416};
  Imatrix im;
  std::map<std::string, int64_t> expert_cols;
  model->set_expert_observer([&](const std::string& name, int64_t e, int64_t n_e, const float* x, int64_t rows, int64_t cols) {
    EXPECT_EQ(n_e, c.n_expert);
    expert_cols[name] = cols;
    im.add(name, x, rows, cols, e, n_e);
  });
  const auto seen = observe(*model, tokens, &im);
  model->set_expert_observer(nullptr);
  const int64_t n = int64_t(tokens.size());
  EXPECT_EQ(seen.at("blk.0.ffn_gate_inp.weight").rows, n);
  EXPECT_EQ(seen.at("blk.0.ffn_gate_shexp.weight").rows, n);
  EXPECT_EQ(seen.at("blk.0.ffn_down_shexp.weight").cols, c.n_ff_shexp);
  EXPECT_EQ(expert_cols.at("blk.0.ffn_gate_exps.weight"), c.n_embd);
  EXPECT_EQ(expert_cols.at("blk.0.ffn_down_exps.weight"), c.n_ff_exp);
  const ImatrixEntry& gate = im.entries.at("blk.0.ffn_gate_exps.weight");
  const ImatrixEntry& router = im.entries.at("blk.0.ffn_gate_inp.weight");
  ASSERT_EQ(int64_t(gate.counts.size()), c.n_expert);
  double rows = 0;
  for (double r : gate.counts) rows += r;
  EXPECT_EQ(rows, double(n * c.n_expert_used));
  int64_t used = 0;
  for (double r : gate.counts) used += r > 0;
  EXPECT_GT(used, 1) << "the test needs tokens spread over several experts";
  for (int64_t j = 0; j < c.n_embd; ++j) {
    double total = 0;
    for (int64_t e = 0; e < c.n_expert; ++e) total += gate.sum2[size_t(e * c.n_embd + j)];
    EXPECT_NEAR(total, double(c.n_expert_used) * router.sum2[size_t(j)], 1e-9 * (1 + total)) << j;
  }
  const auto imp = im.importance("blk.0.ffn_gate_exps.weight", c.n_embd, c.n_expert);
  ASSERT_EQ(int64_t(imp.size()), c.n_expert * c.n_embd);
  for (int64_t e = 0; e < c.n_expert; ++e) {
    const double rows_e = gate.counts[size_t(e)];
    EXPECT_FLOAT_EQ(imp[size_t(e * c.n_embd)], rows_e > 0 ? float(gate.sum2[size_t(e * c.n_embd)] / rows_e) : 1.0f);
  }
  EXPECT_THROW(im.importance("blk.0.ffn_gate_exps.weight", c.n_embd, 1), Error);
}

TEST(MatmulObserver, SeesEveryWeightWithItsWidth) {
  auto model = Model::load(test::shared_path("models/stories260K.gguf"));
  const auto tokens = model->tokenizer().encode("Once upon a time, there was a little girl named Lily.", true);
  const auto seen = observe(*model, tokens);
  const auto& c = model->config();
  ASSERT_EQ(int64_t(seen.size()), 7 * c.n_layer + 1);
  for (int64_t il = 0; il < c.n_layer; ++il) {
    const auto& L = model->weights().layers[size_t(il)];
    const std::string p = "blk." + std::to_string(il) + ".";
    const std::map<std::string, const WeightMatrix*> mats = {
        {"attn_q", &L.wq},     {"attn_k", &L.wk},   {"attn_v", &L.wv},    {"attn_output", &L.wo},
        {"ffn_gate", &L.w_gate}, {"ffn_up", &L.w_up}, {"ffn_down", &L.w_down}};
    for (const auto& [kind, w] : mats) {
      const auto it = seen.find(p + kind + ".weight");
      ASSERT_NE(it, seen.end()) << p + kind;
      EXPECT_EQ(it->second.cols, w->cols) << p + kind;
      EXPECT_EQ(it->second.rows, int64_t(tokens.size())) << p + kind;
    }
  }
  EXPECT_EQ(seen.at("output.weight").cols, c.n_embd);
  EXPECT_EQ(seen.at("output.weight").rows, int64_t(tokens.size()));
  // Unset: nothing is called (the forward still works).
  SingleSequence seq(*model, int64_t(tokens.size()));
  EXPECT_FALSE(seq.eval(tokens).empty());
}

// Layer 0's attention input is rms_norm(embedding) * attn_norm: recomputed here in double.
TEST(MatmulObserver, LayerZeroAttentionInputMatchesAnIndependentSum) {
  auto model = Model::load(test::shared_path("models/stories260K.gguf"));
  const auto tokens = model->tokenizer().encode("The little dog ran to the park and played with a red ball all day.", true);
  Imatrix im;
  observe(*model, tokens, &im);
  const auto& c = model->config();
  const auto& w = model->weights();
  std::vector<double> expect(size_t(c.n_embd), 0.0);
  std::vector<float> row(size_t(c.n_embd));
  for (int32_t t : tokens) {
    get_row(w.tok_embd, t, row.data());
    double ss = 0;
    for (float v : row) ss += double(v) * c.embd_scale * v * c.embd_scale;
    const double inv = 1.0 / std::sqrt(ss / double(c.n_embd) + c.norm_eps);
    for (int64_t j = 0; j < c.n_embd; ++j) {
      const double h = double(row[size_t(j)]) * c.embd_scale * inv * w.layers[0].attn_norm[size_t(j)];
      expect[size_t(j)] += h * h;
    }
  }
  const auto& e = im.entries.at("blk.0.attn_q.weight");
  EXPECT_EQ(e.counts, std::vector<double>{double(tokens.size())});
  for (int64_t j = 0; j < c.n_embd; ++j) EXPECT_NEAR(e.sum2[size_t(j)], expect[size_t(j)], 1e-4 * expect[size_t(j)] + 1e-9) << j;
  // The fused products report the same input.
  EXPECT_EQ(im.entries.at("blk.0.attn_k.weight").sum2, e.sum2);
  EXPECT_EQ(im.entries.at("blk.0.attn_v.weight").sum2, e.sum2);
}

}  // namespace
}  // namespace serval
