// Mixture of experts: the grouped, tiled execution against a per-token reference built from the
// scalar reference kernels (ref::matmul) and a routing computed here in double; batch invariance
// across batch compositions; the edge case where every token chooses the same expert.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "kernels/ops.h"
#include "model/moe.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

// A weight matrix owning its bytes, in F32 or quantized, repacked like a loaded model's.
struct OwnedMatrix {
  std::vector<uint8_t> bytes;
  WeightMatrix m;
  OwnedMatrix(DType type, int64_t rows, int64_t cols, std::mt19937& rng, float scale) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> x(size_t(rows * cols));
    for (float& v : x) v = dist(rng);
    const size_t stride = row_bytes(type, size_t(cols));
    bytes.resize(stride * size_t(rows));
    for (int64_t r = 0; r < rows; ++r) quantize_row(type, x.data() + r * cols, bytes.data() + size_t(r) * stride, size_t(cols));
    m = {type, rows, cols, bytes.data(), stride};
    cpu::prepare_weights(m);
  }
};

struct TinyMoe {
  ModelConfig c;
  std::vector<OwnedMatrix> owned;
  LayerWeights L;

  TinyMoe(DType type, bool shared, bool norm, uint32_t seed = 7, bool oai = false) {
    c.n_embd = 256, c.n_expert = 6, c.n_expert_used = 2, c.n_ff_exp = 256, c.expert_weights_norm = norm;
    c.moe_biases = c.swiglu_oai = oai;
    c.swiglu_limit = 1.5f;  // low enough that the clamps bind
    c.n_ff_shexp = shared ? 256 : 0;
    std::mt19937 rng(seed);
    owned.reserve(64);
    auto add = [&](DType t, int64_t rows, int64_t cols, float scale) -> WeightMatrix {
      owned.emplace_back(t, rows, cols, rng, scale);
      return owned.back().m;
    };
    L.router = add(DType::F32, c.n_expert, c.n_embd, 0.5f);
    for (int64_t e = 0; e < c.n_expert; ++e) {
      L.exp_gate.push_back(add(type, c.n_ff_exp, c.n_embd, 0.2f));
      L.exp_up.push_back(add(type, c.n_ff_exp, c.n_embd, 0.2f));
      L.exp_down.push_back(add(type, c.n_embd, c.n_ff_exp, 0.2f));
    }
    if (oai) {  // gpt-oss: router and expert biases
      std::normal_distribution<float> dist(0.0f, 0.5f);
      for (auto* v : {&L.router_b, &L.exp_gate_b, &L.exp_up_b, &L.exp_down_b}) {
        const int64_t n = v == &L.router_b ? c.n_expert : c.n_expert * (v == &L.exp_down_b ? c.n_embd : c.n_ff_exp);
        for (int64_t i = 0; i < n; ++i) v->push_back(dist(rng));
      }
    }
    if (shared) {
      L.sh_gate = add(type, c.n_ff_shexp, c.n_embd, 0.2f);
      L.sh_up = add(type, c.n_ff_shexp, c.n_embd, 0.2f);
      L.sh_down = add(type, c.n_embd, c.n_ff_shexp, 0.2f);
      std::normal_distribution<float> dist(0.0f, 0.3f);
      for (int64_t i = 0; i < c.n_embd; ++i) L.sh_router.push_back(dist(rng));
    }
  }
};

std::vector<float> random_rows(int64_t n, int64_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(size_t(n * d));
  for (float& v : x) v = dist(rng);
  return x;
}

// SwiGLU of one row with the reference kernels; with `c` (gpt-oss) the biases of expert `e` and OpenAI's
// clamped form, (min(g, L) + ...): (clamp(u) + 1) * g * sigmoid(alpha g).
std::vector<double> ref_swiglu(const WeightMatrix& g, const WeightMatrix& u, const WeightMatrix& d, const float* x,
                               const TinyMoe* oai = nullptr, int e = 0) {
  std::vector<float> gate(size_t(g.rows)), up(size_t(u.rows)), out(size_t(d.rows));
  ref::matmul(g, x, gate.data(), 1);
  ref::matmul(u, x, up.data(), 1);
  for (size_t i = 0; i < gate.size(); ++i) {
    if (!oai) {
      gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
      continue;
    }
    const auto& c = oai->c;
    const double lim = c.swiglu_limit;
    const double gi = std::min(double(gate[i]) + oai->L.exp_gate_b[size_t(e) * gate.size() + i], lim);
    const double ui = std::clamp(double(up[i]) + oai->L.exp_up_b[size_t(e) * up.size() + i], -lim, lim);
    gate[i] = float((ui + 1) * gi / (1 + std::exp(-double(c.swiglu_alpha) * gi)));
  }
  ref::matmul(d, gate.data(), out.data(), 1);
  std::vector<double> y(out.begin(), out.end());
  if (oai)
    for (size_t i = 0; i < y.size(); ++i) y[i] += oai->L.exp_down_b[size_t(e) * y.size() + i];
  return y;
}

// One token alone: softmax in double, the k largest, renormalized when asked, experts summed.
std::vector<double> ref_token(const TinyMoe& m, const float* x) {
  const auto& c = m.c;
  std::vector<float> logits(size_t(c.n_expert));
  ref::matmul(m.L.router, x, logits.data(), 1);
  std::vector<double> p(logits.begin(), logits.end());
  for (size_t i = 0; i < m.L.router_b.size(); ++i) p[i] += m.L.router_b[i];
  const double mx = *std::max_element(p.begin(), p.end());
  double z = 0;
  for (double& v : p) z += (v = std::exp(v - mx));
  for (double& v : p) v /= z;
  std::vector<int> order(size_t(c.n_expert));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[size_t(a)] > p[size_t(b)]; });
  double sum = 0;
  for (int j = 0; j < c.n_expert_used; ++j) sum += p[size_t(order[size_t(j)])];
  std::vector<double> out(size_t(c.n_embd), 0.0);
  for (int j = 0; j < c.n_expert_used; ++j) {
    const int e = order[size_t(j)];
    const double w = c.expert_weights_norm ? p[size_t(e)] / sum : p[size_t(e)];
    const auto y = ref_swiglu(m.L.exp_gate[size_t(e)], m.L.exp_up[size_t(e)], m.L.exp_down[size_t(e)], x,
                              m.c.swiglu_oai ? &m : nullptr, e);
    for (size_t i = 0; i < out.size(); ++i) out[i] += w * y[i];
  }
  if (c.n_ff_shexp > 0) {
    double dot = 0;
    for (int64_t i = 0; i < c.n_embd; ++i) dot += double(m.L.sh_router[size_t(i)]) * x[i];
    const auto y = ref_swiglu(m.L.sh_gate, m.L.sh_up, m.L.sh_down, x);
    for (size_t i = 0; i < out.size(); ++i) out[i] += y[i] / (1.0 + std::exp(-dot));
  }
  return out;
}

struct MoeCase {
  DType type;
  bool shared, norm;
  bool oai = false;  // gpt-oss: biases and OpenAI's SwiGLU
};

class MoeTest : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeTest, GroupedExecutionMatchesPerTokenReference) {
  const TinyMoe m(GetParam().type, GetParam().shared, GetParam().norm, 7, GetParam().oai);
  // 3 tokens: at most 3 rows per expert, the experts run side by side; 23: one after another.
  for (const int64_t n : {3, 23}) {
  const int64_t d = m.c.n_embd;
  const auto h = random_rows(n, d, 11);
  std::vector<float> out(size_t(n * d));
  std::vector<std::atomic<uint64_t>> counts(size_t(m.c.n_expert));
  moe_ffn(m.c, m.L, h.data(), n, out.data(), counts.data());
  uint64_t routed = 0;
  for (auto& c : counts) routed += c.load();
  EXPECT_EQ(routed, uint64_t(n * m.c.n_expert_used));
  // F16 weights multiply F16-rounded activations (llama.cpp's semantics, in the reference too): an
  // intermediate that rounds the other way moves an output by up to ~1e-3.
  const double tol = GetParam().type == DType::F16 ? 3e-3 : 2e-4;
  for (int64_t t = 0; t < n; ++t) {
    const auto want = ref_token(m, h.data() + t * d);
    for (int64_t i = 0; i < d; ++i)
      ASSERT_NEAR(out[size_t(t * d + i)], want[size_t(i)], tol * (1 + std::abs(want[size_t(i)]))) << "token " << t << " value " << i;
  }
  }
}

// A token's row is the same bits whatever else is in the batch and whichever experts the others chose.
TEST_P(MoeTest, BatchInvariantAcrossCompositions) {
  const TinyMoe m(GetParam().type, GetParam().shared, GetParam().norm, 7, GetParam().oai);
  const int64_t d = m.c.n_embd;
  const auto pool = random_rows(40, d, 5);
  auto run = [&](const std::vector<int>& rows) {
    std::vector<float> h, out(rows.size() * size_t(d));
    for (int r : rows) h.insert(h.end(), pool.begin() + r * d, pool.begin() + (r + 1) * d);
    moe_ffn(m.c, m.L, h.data(), int64_t(rows.size()), out.data());
    return out;
  };
  std::vector<int> all(40);
  std::iota(all.begin(), all.end(), 0);
  const auto together = run(all);
  std::vector<int> reversed(all.rbegin(), all.rend());
  const auto backwards = run(reversed);
  for (int r = 0; r < 40; ++r) {
    const auto alone = run({r});
    const auto pair = run({r, (r * 7 + 3) % 40});
    for (int64_t i = 0; i < d; ++i) {
      const float v = together[size_t(r * d + i)];
      ASSERT_EQ(alone[size_t(i)], v) << "row " << r;
      ASSERT_EQ(pair[size_t(i)], v) << "row " << r;
      ASSERT_EQ(backwards[size_t((39 - r) * d + i)], v) << "row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, MoeTest,
                         ::testing::Values(MoeCase{DType::F32, false, true}, MoeCase{DType::Q8_0, false, true},
                                           MoeCase{DType::Q4_K, true, false}, MoeCase{DType::F16, true, true},
                                           MoeCase{DType::Q8_0, false, true, true}, MoeCase{DType::MXFP4, false, true, true}),
                         [](const auto& info) {
                           return std::string(dtype_info(info.param.type).name) + (info.param.shared ? "_shared" : "") +
                                  (info.param.norm ? "_norm" : "") + (info.param.oai ? "_gptoss" : "");
                         });

// Every token chooses expert 3 first: one group of all the tokens, still each token's own result.
TEST(Moe, AllTokensChooseOneExpert) {
  TinyMoe m(DType::Q8_0, false, true);
  const int64_t n = 17, d = m.c.n_embd;
  auto h = random_rows(n, d, 3);
  for (float& v : h) v = std::abs(v) + 0.1f;  // every row positive
  std::vector<float> router(size_t(m.c.n_expert * d), 0.0f);
  std::fill(router.begin() + 3 * d, router.begin() + 4 * d, 1.0f);  // logit 3 = sum of the row, others 0
  m.L.router = {DType::F32, m.c.n_expert, d, reinterpret_cast<const uint8_t*>(router.data()), size_t(d) * 4};
  std::vector<float> out(size_t(n * d));
  std::vector<std::atomic<uint64_t>> counts(size_t(m.c.n_expert));
  moe_ffn(m.c, m.L, h.data(), n, out.data(), counts.data());
  EXPECT_EQ(counts[3].load(), uint64_t(n));
  for (int64_t t = 0; t < n; ++t) {
    const auto want = ref_token(m, h.data() + t * d);
    for (int64_t i = 0; i < d; ++i) ASSERT_NEAR(out[size_t(t * d + i)], want[size_t(i)], 2e-4 * (1 + std::abs(want[size_t(i)])));
  }
}

TEST(Moe, RoutingOrderTiesAndWeights) {
  ModelConfig c;
  c.n_expert = 5, c.n_expert_used = 3;
  // Token 0: experts 1 and 3 tie for first; token 1: all equal.
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f, 2.0f, -1.0f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  c.expert_weights_norm = false;
  auto r = route_tokens(c, logits.data(), 2);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{1, 3, 2, 0, 1, 2}));
  const double z = 2 * std::exp(2.0) + std::exp(1.0) + 1 + std::exp(-1.0);
  EXPECT_NEAR(r.weight[0], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(r.weight[2], std::exp(1.0) / z, 1e-6);
  EXPECT_NEAR(r.weight[3], 0.2, 1e-6);
  c.expert_weights_norm = true;
  r = route_tokens(c, logits.data(), 2);
  EXPECT_NEAR(r.weight[0] + r.weight[1] + r.weight[2], 1.0, 1e-6);
  EXPECT_NEAR(r.weight[3], 1.0 / 3, 1e-6);
}

TEST(Moe, GroupLimitedRoutingAndScale) {
  // DeepSeek-V2's group-limited greedy: 6 experts in 3 groups {0,1} {2,3} {4,5}, each scored by its
  // best expert; only the best group's experts compete here. Token 0: expert 0 is the second most
  // probable overall, but its group loses to {2,3}, so expert 3 (logit 0) is taken instead. Token 1:
  // groups {0,1} and {4,5} tie; the lower one wins.
  ModelConfig c;
  c.n_expert = 6, c.n_expert_used = 2, c.expert_groups = 3, c.expert_groups_used = 1, c.expert_weights_scale = 2.5f;
  const std::vector<float> logits = {2.9f, 2.8f, 3.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.5f, 0.0f, 1.0f, 0.0f};
  auto r = route_tokens(c, logits.data(), 2);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{2, 3, 0, 1}));
  double z = 0;
  for (int i = 0; i < 6; ++i) z += std::exp(double(logits[size_t(i)]));
  EXPECT_NEAR(r.weight[0], 2.5 * std::exp(3.0) / z, 1e-6);  // the probability over all experts, times the scale
  EXPECT_NEAR(r.weight[1], 2.5 * 1.0 / z, 1e-6);
  c.expert_groups_used = 2;  // {2,3} and {0,1}: expert 0 competes again
  r = route_tokens(c, logits.data(), 1);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{2, 0}));
  c.expert_groups = 0;  // plain greedy
  c.n_expert_used = 3;
  r = route_tokens(c, logits.data(), 2);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{2, 0, 1, 0, 4, 2}));
}

}  // namespace
}  // namespace serval
