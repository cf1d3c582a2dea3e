#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/thread_pool.h"
#include "kernels/ops.h"

namespace serval {
namespace {

// The rows of h that expert e runs ([token * k + j] entries), gathered per expert in token order.
std::vector<std::vector<int64_t>> entries_by_expert(const MoeRouting& r, int64_t n_expert) {
  std::vector<std::vector<int64_t>> by;
  by.resize(size_t(n_expert));
  for (size_t i = 0; i < r.expert.size(); ++i) by[size_t(r.expert[i])].push_back(int64_t(i));
  return by;
}

// Per-expert biases (gpt-oss): null pointers where there are none.
struct ExpertBias {
  const float *gate = nullptr, *up = nullptr, *down = nullptr;
};

void add_row_bias(float* y, const float* b, int64_t m, int64_t n) {
  if (!b) return;
  for (int64_t t = 0; t < m; ++t)
    for (int64_t i = 0; i < n; ++i) y[t * n + i] += b[i];
}

// One expert's SwiGLU over the rows of x [m][n_embd]: y [m][n_embd]. gpt-oss: biases after each
// product and OpenAI's clamped SwiGLU (ModelConfig::swiglu_oai).
// Reports an FFN's two inputs to `observe` (null: none): x for gate and up, the activations for down.
struct FfnSight {
  const MoeObserver* observe = nullptr;
  const char *gate = "", *up = "", *down = "";
  int64_t expert = -1;
  const MoeLora* lora = nullptr;     // adapters' updates (null: none) of this expert's products
  const int64_t* tokens = nullptr;   // the step's token of each row, for lora (null: row i is token i)
};

void expert_ffn(const ModelConfig& c, const WeightMatrix& gate_w, const WeightMatrix& up_w, const WeightMatrix& down_w,
                const float* x, int64_t m, float* y, ExpertBias bias = {}, const FfnSight& sight = {}) {
  const int64_t n_ff = gate_w.rows;
  std::vector<float> gate(size_t(m * n_ff)), up(size_t(m * n_ff));
  if (sight.observe) {
    (*sight.observe)(sight.gate, sight.expert, x, m, gate_w.cols);
    (*sight.observe)(sight.up, sight.expert, x, m, up_w.cols);
  }
  const cpu::MatmulOut gate_up[] = {{&gate_w, gate.data()}, {&up_w, up.data()}};
  cpu::matmul_many(gate_up, x, m);
  if (sight.lora) {
    (*sight.lora)(sight.expert, 0, sight.tokens, m, x, gate_w.cols, gate.data());
    (*sight.lora)(sight.expert, 1, sight.tokens, m, x, up_w.cols, up.data());
  }
  add_row_bias(gate.data(), bias.gate, m, n_ff);
  add_row_bias(up.data(), bias.up, m, n_ff);
  parallel_for(m, [&](int64_t t) {
    float* g = gate.data() + t * n_ff;
    if (c.swiglu_oai) cpu::glu_oai(g, up.data() + t * n_ff, g, n_ff, c.swiglu_alpha, c.swiglu_limit);
    else cpu::glu(cpu::GluKind::Silu, g, up.data() + t * n_ff, g, n_ff);
  });
  if (sight.observe) (*sight.observe)(sight.down, sight.expert, gate.data(), m, n_ff);
  cpu::matmul(down_w, gate.data(), y, m);
  if (sight.lora) (*sight.lora)(sight.expert, 2, sight.tokens, m, gate.data(), n_ff, y);
  add_row_bias(y, bias.down, m, down_w.rows);
}

// out[t] += sigmoid(gate . h[t]) * SwiGLU_shared(h[t]) (Qwen2-MoE's shared expert; DeepSeek's have no
// gate: added as they are).
void add_shared_expert(const ModelConfig& c, const LayerWeights& L, const float* h, int64_t n_tok, float* out,
                       const MoeObserver* observe, const MoeLora* lora) {
  std::vector<float> y(size_t(n_tok * c.n_embd));
  expert_ffn(c, L.sh_gate, L.sh_up, L.sh_down, h, n_tok, y.data(), {},
             {observe, "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", -1, lora, nullptr});
  parallel_for(n_tok, [&](int64_t t) {
    const float g = L.sh_router.empty() ? 1.0f : 1.0f / (1.0f + std::exp(-cpu::dot(L.sh_router.data(), h + t * c.n_embd, c.n_embd)));
    float* o = out + t * c.n_embd;
    const float* s = y.data() + t * c.n_embd;
    for (int64_t i = 0; i < c.n_embd; ++i) o[i] += g * s[i];
  });
}

// Group-limited greedy routing (DeepSeek-V2): the experts split into expert_groups groups in index
// order, each scored by its best expert's probability; the experts of all but the expert_groups_used
// best groups (ties: the lower group) get probability 0, so the top k come from those groups only.
void drop_groups(const ModelConfig& c, std::vector<float>& p) {
  const int64_t n_groups = c.expert_groups, per = c.n_expert / n_groups;
  std::vector<float> best(static_cast<size_t>(n_groups));
  std::vector<int64_t> order(static_cast<size_t>(n_groups));
  for (int64_t g = 0; g < n_groups; ++g) best[size_t(g)] = *std::max_element(p.begin() + g * per, p.begin() + (g + 1) * per);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return best[size_t(a)] > best[size_t(b)]; });
  for (size_t i = size_t(c.expert_groups_used); i < order.size(); ++i)
    std::fill(p.begin() + order[i] * per, p.begin() + (order[i] + 1) * per, 0.0f);
}

}  // namespace

MoeRouting route_tokens(const ModelConfig& c, const float* logits, int64_t n_tok) {
  MoeRouting r;
  r.k = c.n_expert_used;
  r.expert.resize(size_t(n_tok * r.k));
  r.weight.resize(size_t(n_tok * r.k));
  std::vector<float> p(size_t(c.n_expert));
  std::vector<int32_t> order(size_t(c.n_expert));
  for (int64_t t = 0; t < n_tok; ++t) {
    std::copy(logits + t * c.n_expert, logits + (t + 1) * c.n_expert, p.begin());
    softmax_inplace(p.data(), c.n_expert);
    if (c.expert_groups > 0) drop_groups(c, p);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + r.k, order.end(),
                      [&](int32_t a, int32_t b) { return p[size_t(a)] > p[size_t(b)] || (p[size_t(a)] == p[size_t(b)] && a < b); });
    float sum = 0.0f;
    for (int64_t j = 0; j < r.k; ++j) sum += p[size_t(order[size_t(j)])];
    for (int64_t j = 0; j < r.k; ++j) {
      const float w = p[size_t(order[size_t(j)])];
      r.expert[size_t(t * r.k + j)] = order[size_t(j)];
      r.weight[size_t(t * r.k + j)] = (c.expert_weights_norm ? w / sum : w) * c.expert_weights_scale;
    }
  }
  return r;
}

void moe_ffn(const ModelConfig& c, const LayerWeights& L, const float* h, int64_t n_tok, float* out,
             std::atomic<uint64_t>* expert_tokens, const MoeObserver* observe, const MoeLora* lora) {
  const int64_t d = c.n_embd;
  std::vector<float> logits(size_t(n_tok * c.n_expert));
  if (observe) (*observe)("ffn_gate_inp", -1, h, n_tok, d);
  cpu::matmul(L.router, h, logits.data(), n_tok);
  add_row_bias(logits.data(), L.router_b.empty() ? nullptr : L.router_b.data(), n_tok, c.n_expert);
  const MoeRouting r = route_tokens(c, logits.data(), n_tok);
  // ys[t * k + j]: the output of token t's j-th expert, unweighted.
  std::vector<float> ys(size_t(n_tok * r.k * d));
  const auto by_expert = entries_by_expert(r, c.n_expert);
  std::vector<int64_t> active;
  int64_t most = 0;
  for (int64_t e = 0; e < c.n_expert; ++e) {
    const int64_t m = int64_t(by_expert[size_t(e)].size());
    if (m == 0) continue;
    active.push_back(e);
    most = std::max(most, m);
    if (expert_tokens) expert_tokens[e].fetch_add(uint64_t(m), std::memory_order_relaxed);
  }
  auto run_expert = [&](int64_t e) {
    const auto& entries = by_expert[size_t(e)];
    const int64_t m = int64_t(entries.size());
    std::vector<float> x(size_t(m * d)), y(size_t(m * d));
    std::vector<int64_t> tokens(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) {
      tokens[size_t(i)] = entries[size_t(i)] / r.k;
      std::copy_n(h + tokens[size_t(i)] * d, d, x.begin() + i * d);
    }
    ExpertBias bias;  // split over TP ranks: this rank's columns of gate and up; down's on rank 0 only
    const int64_t n_ff = L.exp_gate[size_t(e)].rows;
    if (!L.exp_gate_b.empty()) bias.gate = L.exp_gate_b.data() + e * n_ff, bias.up = L.exp_up_b.data() + e * n_ff;
    if (!L.exp_down_b.empty()) bias.down = L.exp_down_b.data() + e * d;
    expert_ffn(c, L.exp_gate[size_t(e)], L.exp_up[size_t(e)], L.exp_down[size_t(e)], x.data(), m, y.data(), bias,
               {observe, "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", e, lora, tokens.data()});
    for (int64_t i = 0; i < m; ++i) std::copy_n(y.begin() + i * d, d, ys.begin() + entries[size_t(i)] * d);
  };
  // Decode and small batches: each expert's few rows are matrix-vector products, so the experts run
  // side by side, one task each (their own products then run inline), instead of one parallel job per
  // product. Larger batches: the experts one after another, each product tiled over the threads.
  // Either way each row is the same function of its inputs (the kernels do not depend on the split).
  if (!observe && int64_t(active.size()) >= 2 * pool_threads() && most <= 4)
    parallel_for(int64_t(active.size()), [&](int64_t i) { run_expert(active[size_t(i)]); });
  else
    for (int64_t e : active) run_expert(e);
  // Each token's experts summed in its own choice order (never in the order of the grouping).
  parallel_for(n_tok, [&](int64_t t) {
    float* o = out + t * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t j = 0; j < r.k; ++j) {
      const float w = r.weight[size_t(t * r.k + j)];
      const float* yj = ys.data() + (t * r.k + j) * d;
      for (int64_t i = 0; i < d; ++i) o[i] += w * yj[i];
    }
  });
  if (c.n_ff_shexp > 0) add_shared_expert(c, L, h, n_tok, out, observe, lora);
}

}  // namespace serval
