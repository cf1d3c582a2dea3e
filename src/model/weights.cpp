#include "model/weights.h"

#include <fmt/ranges.h>

#include "base/error.h"
#include "tensor/dequant.h"

namespace serval {
namespace {

class Binder {
 public:
  Binder(const TensorLookup& lookup, const std::string& source, uint64_t& bytes)
      : lookup_(lookup), source_(source), bytes_(bytes) {}

  const TensorRef* find(const std::string& name, bool required) {
    const TensorRef* t = lookup_(name);
    check(t || !required, "{}: missing tensor '{}'", source_, name);
    return t;
  }

  void expect_shape(const TensorRef& t, std::vector<uint64_t> ne) {
    check(t.ne == ne, "{}: tensor '{}' has shape [{}], expected [{}]", source_, t.name, fmt::join(t.ne, ", "),
          fmt::join(ne, ", "));
  }

  WeightMatrix matrix(const std::string& name, int64_t rows, int64_t cols, bool required = true) {
    const TensorRef* t = find(name, required);
    if (!t) return {};
    expect_shape(*t, {uint64_t(cols), uint64_t(rows)});
    bytes_ += t->nbytes;
    return {t->type, rows, cols, t->data, row_bytes(t->type, cols)};
  }

  std::vector<float> vector(const std::string& name, int64_t n, bool required = true) {
    const TensorRef* t = find(name, required);
    if (!t) return {};
    expect_shape(*t, {uint64_t(n)});
    bytes_ += t->nbytes;
    std::vector<float> out(n);
    dequantize_row(t->type, t->data, out.data(), n);
    return out;
  }

 private:
  const TensorLookup& lookup_;
  const std::string& source_;
  uint64_t& bytes_;
};

}  // namespace

ModelWeights bind_weights(const ModelConfig& c, const TensorLookup& lookup, const std::string& source) {
  ModelWeights w;
  Binder b(lookup, source, w.weight_bytes);
  w.tok_embd = b.matrix("token_embd.weight", c.n_vocab, c.n_embd);
  w.output_norm = b.vector("output_norm.weight", c.n_embd);
  w.output = b.matrix("output.weight", c.n_vocab, c.n_embd, /*required=*/false);
  if (w.output.empty()) w.output = w.tok_embd;
  w.rope_freqs = b.vector("rope_freqs.weight", c.d_head / 2, /*required=*/false);
  for (int64_t il = 0; il < c.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    LayerWeights L;
    L.attn_norm = b.vector(p + "attn_norm.weight", c.n_embd);
    L.wq = b.matrix(p + "attn_q.weight", c.q_dim(), c.n_embd);
    L.wk = b.matrix(p + "attn_k.weight", c.kv_dim(), c.n_embd);
    L.wv = b.matrix(p + "attn_v.weight", c.kv_dim(), c.n_embd);
    L.wo = b.matrix(p + "attn_output.weight", c.n_embd, c.q_dim());
    const bool bias_required = c.arch == "qwen2";
    L.bq = b.vector(p + "attn_q.bias", c.q_dim(), bias_required);
    L.bk = b.vector(p + "attn_k.bias", c.kv_dim(), bias_required);
    L.bv = b.vector(p + "attn_v.bias", c.kv_dim(), bias_required);
    if (c.qk_norm) {
      L.q_norm = b.vector(p + "attn_q_norm.weight", c.d_head);
      L.k_norm = b.vector(p + "attn_k_norm.weight", c.d_head);
    }
    if (c.post_norms) {
      L.post_attn_norm = b.vector(p + "post_attention_norm.weight", c.n_embd);
      L.post_ffn_norm = b.vector(p + "post_ffw_norm.weight", c.n_embd);
    }
    L.ffn_norm = b.vector(p + "ffn_norm.weight", c.n_embd);
    L.w_gate = b.matrix(p + "ffn_gate.weight", c.n_ff, c.n_embd);
    L.w_up = b.matrix(p + "ffn_up.weight", c.n_ff, c.n_embd);
    L.w_down = b.matrix(p + "ffn_down.weight", c.n_embd, c.n_ff);
    for (WeightMatrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) cpu::prepare_weights(*m);
    w.layers.push_back(std::move(L));
  }
  cpu::prepare_weights(w.output);  // the embedding itself stays as in the file (rows read by get_row)
  return w;
}

}  // namespace serval
