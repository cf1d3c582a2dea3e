#include "quant/awq.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>

#include "base/error.h"
#include "base/thread_pool.h"
#include "io/gguf.h"
#include "quant/imatrix.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

constexpr int kRowsSampled = 128;  // rows of each matrix the search quantizes per alpha

// Matrices that read one input, and where the inverse of their scale goes.
struct Group {
  std::vector<std::string> weights;
  std::string fold;       // the 1-D norm (col_div) or the matrix whose rows are divided (row_div)
  bool fold_rows = false;
};

std::vector<Group> groups_of(const GgufFile& in) {
  const std::string arch = in.find_string("general.architecture").value_or("");
  check(arch == "llama" || arch == "qwen2", "--method awq supports llama and qwen2 models, not '{}'", arch);
  const int64_t n_layer = in.get_int(arch + ".block_count");
  std::vector<Group> g;
  for (int64_t il = 0; il < n_layer; ++il) {
    const std::string b = fmt::format("blk.{}.", il);
    // ffn_down first: its fold divides ffn_up's rows, which the gate/up group then measures.
    g.push_back({{b + "ffn_down.weight"}, b + "ffn_up.weight", true});
    g.push_back({{b + "ffn_gate.weight", b + "ffn_up.weight"}, b + "ffn_norm.weight", false});
    g.push_back({{b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"}, b + "attn_norm.weight", false});
  }
  return g;
}

std::vector<float> scales_for(const std::vector<float>& imp, float alpha) {
  std::vector<float> s(imp.size());
  float lo = INFINITY, hi = 0;
  for (size_t j = 0; j < imp.size(); ++j) {
    s[j] = std::pow(std::sqrt(std::max(imp[j], 1e-12f)), alpha);
    lo = std::min(lo, s[j]), hi = std::max(hi, s[j]);
  }
  const float norm = std::sqrt(lo * hi);
  for (float& v : s) v /= norm;
  return s;
}

// One matrix of a group: its float rows (a sample), type and row divisors.
struct Sampled {
  DType to;
  int64_t cols;
  std::vector<float> rows;  // [n][cols]
};

Sampled sample(const TensorRef& t, DType to, const std::vector<float>& row_div) {
  const int64_t cols = int64_t(t.row_len()), n_rows = int64_t(t.n_rows());
  const int64_t stride = std::max<int64_t>(1, n_rows / kRowsSampled);
  Sampled s{to, cols, {}};
  const size_t rb = row_bytes(t.type, size_t(cols));
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < n_rows; r += stride) {
    dequantize_row(t.type, t.data + size_t(r) * rb, row.data(), size_t(cols));
    if (!row_div.empty())
      for (float& v : row) v /= row_div[size_t(r)];
    s.rows.insert(s.rows.end(), row.begin(), row.end());
  }
  return s;
}

// sum over the sampled rows of sum_j imp_j (w_j - q(w s)_j / s_j)^2, the rows quantized with
// importance imp / s^2 (what the activations x / s give).
double group_error(const std::vector<Sampled>& mats, const std::vector<float>& imp, const std::vector<float>& s) {
  const size_t cols = imp.size();
  std::vector<float> qimp(cols);
  for (size_t j = 0; j < cols; ++j) qimp[j] = imp[j] / (s[j] * s[j]);
  double total = 0;
  for (const Sampled& m : mats) {
    const int64_t n = int64_t(m.rows.size() / cols);
    std::vector<double> err(static_cast<size_t>(n));
    parallel_for(n, [&](int64_t r) {
      std::vector<float> ws(cols), back(cols);
      std::vector<uint8_t> q(row_bytes(m.to, cols));
      const float* w = m.rows.data() + size_t(r) * cols;
      for (size_t j = 0; j < cols; ++j) ws[j] = w[j] * s[j];
      quantize_row(m.to, ws.data(), q.data(), cols, qimp.data());
      dequantize_row(m.to, q.data(), back.data(), cols);
      double e = 0;
      for (size_t j = 0; j < cols; ++j) e += double(imp[j]) * std::pow(double(w[j]) - double(back[j]) / s[j], 2);
      err[size_t(r)] = e;
    });
    for (double e : err) total += e;
  }
  return total;
}

}  // namespace

AwqPlan awq_plan(const GgufFile& in, const std::vector<TensorChoice>& choices, const Imatrix& im) {
  std::map<std::string, DType> quantized;
  for (const auto& c : choices)
    if (c.convert && c.to != DType::F32 && c.to != DType::F16 && c.to != DType::BF16) quantized[c.name] = c.to;
  AwqPlan plan;
  for (const Group& g : groups_of(in)) {
    if (!std::all_of(g.weights.begin(), g.weights.end(), [&](const std::string& w) { return quantized.count(w); })) continue;
    const TensorRef* first = in.find_tensor(g.weights[0]);
    const auto imp = im.importance(g.weights[0], int64_t(first->row_len()));
    check(!imp.empty(), "--method awq: the imatrix has no entry for {}", g.weights[0]);
    std::vector<Sampled> mats;
    for (const auto& w : g.weights) mats.push_back(sample(*in.find_tensor(w), quantized[w], plan.rescale[w].row_div));
    float best_alpha = 0;
    double best = group_error(mats, imp, scales_for(imp, 0.f));
    for (int k = 1; k <= 10; ++k) {
      const double e = group_error(mats, imp, scales_for(imp, 0.1f * k));
      if (e < best) best = e, best_alpha = 0.1f * k;
    }
    plan.alphas.emplace_back(g.weights[0], best_alpha);
    if (best_alpha == 0) continue;
    const auto s = scales_for(imp, best_alpha);
    for (const auto& w : g.weights) plan.rescale[w].col_mul = s;
    if (g.fold_rows) plan.rescale[g.fold].row_div = s;
    else plan.rescale[g.fold].col_div = s;
  }
  return plan;
}

}  // namespace serval
