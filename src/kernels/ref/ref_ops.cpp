// Scalar reference ops: slow and obvious; the oracle for every other backend.
#include <cmath>
#include <vector>

#include "kernels/act_quant.h"
#include "kernels/ops.h"
#include "tensor/dequant.h"

namespace serval::ref {

void matmul(const WeightMatrix& w, const float* x, float* y, int64_t n_tok) {
  const ActType at = act_type_for(w.type);
  std::vector<uint8_t> act(act_row_bytes(at, w.cols));
  for (int64_t t = 0; t < n_tok; ++t) {
    quantize_act_row(at, x + t * w.cols, w.cols, act.data());
    for (int64_t r = 0; r < w.rows; ++r) y[t * w.rows + r] = vec_dot(w.type, w.data + r * w.row_stride, act.data(), w.cols);
  }
}

void attention(const AttentionShape& s, const float* q, KvLayerView kv, std::span<const int32_t> slots, float* out) {
  const int group = s.n_head / s.n_head_kv;
  // Every cache but F32 has F16's rounding points (the query and the normalised weights); K and V
  // are the cache's values, dequantized exactly (KvLayerView::load).
  const bool half = kv.type != DType::F32;
  auto round = [&](float x) { return half ? fp16_to_f32(f32_to_fp16(x)) : x; };
  std::vector<double> p(slots.size());
  std::vector<float> k(s.d_head), v(s.d_head);
  for (int h = 0; h < s.n_head; ++h) {
    const int g = h / group;
    double mx = -INFINITY;
    for (size_t j = 0; j < slots.size(); ++j) {
      kv.load(kv.k, slots[j], g * s.d_head, s.d_head, k.data());
      double acc = 0;
      for (int d = 0; d < s.d_head; ++d) acc += double(round(q[h * s.d_head + d])) * k[d];
      p[j] = acc * s.scale;
      if (s.softcap > 0) p[j] = s.softcap * std::tanh(p[j] / s.softcap);
      mx = std::max(mx, p[j]);
    }
    if (s.sinks) mx = std::max(mx, double(s.sinks[h]));
    double sum = s.sinks ? std::exp(double(s.sinks[h]) - mx) : 0.0;
    for (auto& x : p) sum += (x = std::exp(x - mx));
    std::vector<double> acc(s.d_head, 0.0);
    for (size_t j = 0; j < slots.size(); ++j) {
      kv.load(kv.v, slots[j], g * s.d_head, s.d_head, v.data());
      const double pj = round(float(p[j] / sum));
      for (int d = 0; d < s.d_head; ++d) acc[d] += pj * v[d];
    }
    for (int d = 0; d < s.d_head; ++d) out[h * s.d_head + d] = float(acc[d]);
    if (kv.v_rotated) hadamard_rotate(out + h * s.d_head, s.d_head);
  }
}

void lora_update(std::span<const cpu::LoraSegment> segments, int64_t in, int64_t out, const float* x, float* y) {
  for (const auto& g : segments)
    for (size_t k = 0; k < g.tokens.size(); ++k) {
      const float* xt = x + g.tokens[k] * in;
      std::vector<double> mid(size_t(g.rank), 0.0);
      for (int64_t r = 0; r < g.rank; ++r)
        for (int64_t c = 0; c < in; ++c) mid[size_t(r)] += double(g.a[r * in + c]) * xt[c];
      for (int64_t i = 0; i < out; ++i) {
        double acc = 0;
        for (int64_t r = 0; r < g.rank; ++r) acc += mid[size_t(r)] * g.bt[r * out + i];
        y[g.tokens[k] * out + i] = float(y[g.tokens[k] * out + i] + double(g.factors[k]) * acc);
      }
    }
}

}  // namespace serval::ref
