#include "model/weights.h"

#include <fmt/ranges.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/error.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

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
    return {t->type, rows, cols, t->data, row_bytes(t->type, cols)};
  }

  // A [n_rows, n] tensor (GGUF ne {n, n_rows}) as floats, row after row.
  std::vector<float> rows(const std::string& name, int64_t n, int64_t n_rows) {
    const TensorRef* t = find(name, true);
    expect_shape(*t, {uint64_t(n), uint64_t(n_rows)});
    bytes_ += t->nbytes;
    std::vector<float> out(size_t(n * n_rows));
    for (int64_t r = 0; r < n_rows; ++r) dequantize_row(t->type, t->data + r * row_bytes(t->type, n), out.data() + r * n, n);
    return out;
  }

  std::vector<float> vector(const std::string& name, int64_t n, bool required = true) {
    const TensorRef* t = find(name, required);
    if (!t) return {};
    if (t->ne.size() == 2 && t->ne[1] == 1) expect_shape(*t, {uint64_t(n), 1});  // a [1, n] matrix: one row
    else expect_shape(*t, {uint64_t(n)});
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

// The experts' matrices [rows, cols] of one kind: slices of llama.cpp's 3-D tensor `stacked`
// ([cols, rows, n_expert]), or else one tensor per expert named `each` with {} for the expert.
std::vector<WeightMatrix> expert_matrices(Binder& b, const std::string& stacked, const std::string& each, int64_t n_expert,
                                          int64_t rows, int64_t cols) {
  std::vector<WeightMatrix> out;
  if (const TensorRef* t = b.find(stacked, false)) {
    b.expect_shape(*t, {uint64_t(cols), uint64_t(rows), uint64_t(n_expert)});
    const size_t stride = row_bytes(t->type, cols);
    for (int64_t e = 0; e < n_expert; ++e)
      out.push_back({t->type, rows, cols, t->data + size_t(e) * size_t(rows) * stride, stride});
    return out;
  }
  for (int64_t e = 0; e < n_expert; ++e) out.push_back(b.matrix(fmt::format(fmt::runtime(each), e), rows, cols));
  return out;
}

// Rows [r0, r1) of `m` (no copy).
WeightMatrix rows_of(WeightMatrix m, int64_t r0, int64_t r1) {
  m.data += r0 * int64_t(m.row_stride);
  m.rows = r1 - r0;
  return m;
}

// Columns [c0, c1) of `m` (no copy; the row stride stays): the cuts must fall on block boundaries.
WeightMatrix cols_of(WeightMatrix m, int64_t c0, int64_t c1, const std::string& name) {
  const auto& info = dtype_info(m.type);
  const int64_t be = int64_t(info.block_elems);
  check(c0 % be == 0 && (c1 == m.cols || c1 % be == 0),
        "cannot split '{}' ({}) at columns {}..{} for --tp: not on {}-element block boundaries", name, info.name, c0,
        c1, be);
  m.data += c0 / be * int64_t(info.block_bytes);
  m.cols = c1 - c0;
  return m;
}

// After a matrix is repacked its bytes in the mapped file are not read again: the pages wholly inside
// it are given back, so that a model's resident memory is about its packed copy, not that plus the
// file (a 7.4 GB MoE file: 14.6 GB peak before, see docs/models.md). A column slice shares every page
// of its rows with the other ranks' columns, so without this a TP rank would also keep the whole
// matrix resident. The mapping is read-only and file-backed, so a page read again later (a tied
// embedding's rows) is simply mapped again from the page cache or the file.
void release_file_pages(const WeightMatrix& m) {
  if (m.empty() || (!m.packed && !m.packed_float)) return;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (uintptr_t(m.data) + page - 1) / page * page;
  const uintptr_t end = (uintptr_t(m.data) + uintptr_t(m.rows - 1) * m.row_stride + row_bytes(m.type, m.cols)) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

uint64_t matrix_bytes(const WeightMatrix& m) { return m.empty() ? 0 : uint64_t(m.rows) * row_bytes(m.type, m.cols); }

std::vector<float> slice(const std::vector<float>& v, int64_t begin, int64_t end) {
  if (v.empty()) return v;
  return std::vector<float>(v.begin() + begin, v.begin() + end);
}

// FFN columns [begin, end) of this rank for an FFN of width n_ff whose down projection is `down`: all of
// them unless the model is split over TP ranks (then cut on the down projection's blocks, shard.h).
std::pair<int64_t, int64_t> ffn_cols(const ModelConfig& c, int64_t n_ff, const WeightMatrix& down) {
  if (c.shard.tp <= 1) return {0, n_ff};
  return ffn_share(n_ff, int64_t(dtype_info(down.type).block_elems), c.shard.tp, c.shard.tp_rank);
}

// Entries [begin, end) of each of the n_rows rows of width n in `v` (the whole vector when they are all).
std::vector<float> row_slices(const std::vector<float>& v, int64_t n, int64_t n_rows, int64_t begin, int64_t end) {
  if (v.empty() || (begin == 0 && end == n)) return v;
  std::vector<float> out;
  for (int64_t r = 0; r < n_rows; ++r) out.insert(out.end(), v.begin() + r * n + begin, v.begin() + r * n + end);
  return out;
}

// A mixture-of-experts layer's router (whole on every TP rank, so that all ranks route alike) and this
// rank's columns of every expert and of the shared expert, cut as a dense FFN's: gate and up rows,
// down columns, so each rank's output is a partial sum for the all-reduce. The down projection's
// bias is added once, by TP rank 0.
void bind_moe(const ModelConfig& c, Binder& b, const std::string& p, LayerWeights& L) {
  L.router = b.matrix(p + "ffn_gate_inp.weight", c.n_expert, c.n_embd);
  L.exp_gate = expert_matrices(b, p + "ffn_gate_exps.weight", p + "ffn_gate.{}.weight", c.n_expert, c.n_ff_exp, c.n_embd);
  L.exp_up = expert_matrices(b, p + "ffn_up_exps.weight", p + "ffn_up.{}.weight", c.n_expert, c.n_ff_exp, c.n_embd);
  L.exp_down = expert_matrices(b, p + "ffn_down_exps.weight", p + "ffn_down.{}.weight", c.n_expert, c.n_embd, c.n_ff_exp);
  const auto [f0, f1] = ffn_cols(c, c.n_ff_exp, L.exp_down[0]);
  for (int64_t e = 0; e < c.n_expert; ++e) {
    L.exp_gate[size_t(e)] = rows_of(L.exp_gate[size_t(e)], f0, f1);
    L.exp_up[size_t(e)] = rows_of(L.exp_up[size_t(e)], f0, f1);
    L.exp_down[size_t(e)] = cols_of(L.exp_down[size_t(e)], f0, f1, p + "ffn_down_exps.weight");
  }
  if (c.moe_biases) {  // GGUF [n, n_expert]: read as n_expert rows of n
    L.router_b = b.vector(p + "ffn_gate_inp.bias", c.n_expert);
    L.exp_gate_b = row_slices(b.rows(p + "ffn_gate_exps.bias", c.n_ff_exp, c.n_expert), c.n_ff_exp, c.n_expert, f0, f1);
    L.exp_up_b = row_slices(b.rows(p + "ffn_up_exps.bias", c.n_ff_exp, c.n_expert), c.n_ff_exp, c.n_expert, f0, f1);
    L.exp_down_b = b.rows(p + "ffn_down_exps.bias", c.n_embd, c.n_expert);
    if (c.shard.tp_rank > 0) L.exp_down_b.clear();
  }
  if (c.n_ff_shexp > 0) {
    L.sh_down = b.matrix(p + "ffn_down_shexp.weight", c.n_embd, c.n_ff_shexp);
    const auto [s0, s1] = ffn_cols(c, c.n_ff_shexp, L.sh_down);
    L.sh_down = cols_of(L.sh_down, s0, s1, p + "ffn_down_shexp.weight");
    L.sh_gate = rows_of(b.matrix(p + "ffn_gate_shexp.weight", c.n_ff_shexp, c.n_embd), s0, s1);
    L.sh_up = rows_of(b.matrix(p + "ffn_up_shexp.weight", c.n_ff_shexp, c.n_embd), s0, s1);
    if (!c.mla) L.sh_router = b.vector(p + "ffn_gate_inp_shexp.weight", c.n_embd);  // DeepSeek's shared experts: no gate
  }
}

// Per head h of [h0, h1), rows [h * per_head + begin, h * per_head + begin + n) of `m` (no copy).
std::vector<WeightMatrix> head_rows(const WeightMatrix& m, int64_t h0, int64_t h1, int64_t per_head, int64_t begin, int64_t n) {
  std::vector<WeightMatrix> out;
  for (int64_t h = h0; h < h1; ++h) out.push_back(rows_of(m, h * per_head + begin, h * per_head + begin + n));
  return out;
}

// The key up-projection of heads [h0, h1) transposed ([head][kv_lora][nope]) from llama.cpp's fused
// attn_kv_b (per head nope key rows, then v_head value rows, of kv_lora columns), in F32 when the file
// holds F32 and F16 otherwise (its values, rounded once), owned by the layer.
void transpose_k_b(const ModelConfig& c, const WeightMatrix& kv_b, int64_t h0, int64_t h1, LayerWeights& L) {
  const int64_t nope = c.qk_nope_dim, lat = c.kv_lora_rank, per_head = nope + c.v_head_dim;
  const DType type = kv_b.type == DType::F32 ? DType::F32 : DType::F16;
  const size_t row = row_bytes(type, size_t(nope));
  L.mla_owned.resize(size_t((h1 - h0) * lat) * row);
  std::vector<float> k(static_cast<size_t>(nope * lat)), t(static_cast<size_t>(nope));
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t i = 0; i < nope; ++i)
      dequantize_row(kv_b.type, kv_b.data + size_t(h * per_head + i) * kv_b.row_stride, k.data() + i * lat, lat);
    uint8_t* base = L.mla_owned.data() + size_t((h - h0) * lat) * row;
    for (int64_t j = 0; j < lat; ++j) {
      for (int64_t i = 0; i < nope; ++i) t[size_t(i)] = k[size_t(i * lat + j)];
      quantize_row(type, t.data(), base + size_t(j) * row, size_t(nope));
    }
    L.wk_b.push_back({type, lat, nope, base, row});
  }
}

// DeepSeek-V2's latent attention (LayerWeights' MLA fields) under llama.cpp's names: attn_q or
// attn_q_a / attn_q_a_norm / attn_q_b, attn_kv_a_mqa, attn_kv_a_norm, and attn_kv_b (llama.cpp until
// 2025-04) or its split attn_k_b ([n_head][kv_lora][nope], already transposed) and attn_v_b.
// Split over TP ranks: this rank's heads (query rows, up-projections, output columns); the latent and
// its projection are every rank's (the one KV head is replicated, shard.cpp).
void bind_mla(const ModelConfig& c, Binder& b, const std::string& p, LayerWeights& L) {
  const int64_t nh = c.n_head, nope = c.qk_nope_dim, qk = nope + c.qk_rope_dim, lat = c.kv_lora_rank, v = c.v_head_dim;
  const bool split = c.shard.split();
  const int64_t h0 = split ? c.shard.head_begin : 0, h1 = split ? c.shard.head_end : nh;
  if (c.q_lora_rank > 0) {
    L.wq_a = b.matrix(p + "attn_q_a.weight", c.q_lora_rank, c.n_embd);
    L.q_a_norm = b.vector(p + "attn_q_a_norm.weight", c.q_lora_rank);
    L.wq_b = rows_of(b.matrix(p + "attn_q_b.weight", nh * qk, c.q_lora_rank), h0 * qk, h1 * qk);
  } else {
    L.wq = rows_of(b.matrix(p + "attn_q.weight", nh * qk, c.n_embd), h0 * qk, h1 * qk);
  }
  L.wkv_a = b.matrix(p + "attn_kv_a_mqa.weight", lat + c.qk_rope_dim, c.n_embd);
  L.kv_a_norm = b.vector(p + "attn_kv_a_norm.weight", lat);
  L.wo = cols_of(b.matrix(p + "attn_output.weight", c.n_embd, nh * v), h0 * v, h1 * v, p + "attn_output.weight");
  if (const TensorRef* kb = b.find(p + "attn_k_b.weight", false)) {
    b.expect_shape(*kb, {uint64_t(nope), uint64_t(lat), uint64_t(nh)});
    L.wk_b = head_rows({kb->type, nh * lat, nope, kb->data, row_bytes(kb->type, nope)}, h0, h1, lat, 0, lat);
    const TensorRef* vb = b.find(p + "attn_v_b.weight", true);
    b.expect_shape(*vb, {uint64_t(lat), uint64_t(v), uint64_t(nh)});
    L.wv_b = head_rows({vb->type, nh * v, lat, vb->data, row_bytes(vb->type, lat)}, h0, h1, v, 0, v);
    return;
  }
  const WeightMatrix kv_b = b.matrix(p + "attn_kv_b.weight", nh * (nope + v), lat);
  transpose_k_b(c, kv_b, h0, h1, L);
  L.wv_b = head_rows(kv_b, h0, h1, nope + v, nope, v);
}

// The attention weights of this rank's heads and its FFN columns (all of them without a split).
void bind_layer(const ModelConfig& c, Binder& b, int64_t il, LayerWeights& L) {
  const std::string p = fmt::format("blk.{}.", il);
  const ShardLayout& s = c.shard;
  const bool split = s.split();
  const int64_t d = c.d_head;
  const int64_t q0 = split ? s.head_begin * d : 0, q1 = split ? s.head_end * d : c.q_dim();
  const int64_t k0 = split ? s.kv_head_begin * d : 0, k1 = split ? s.kv_head_end * d : c.kv_dim();
  L.attn_norm = b.vector(p + "attn_norm.weight", c.n_embd);
  if (c.mla) {
    bind_mla(c, b, p, L);
  } else if (b.find(p + "attn_q.weight", false) || !b.find(p + "attn_qkv.weight", false)) {
    L.wq = rows_of(b.matrix(p + "attn_q.weight", c.q_dim(), c.n_embd), q0, q1);
    L.wk = rows_of(b.matrix(p + "attn_k.weight", c.kv_dim(), c.n_embd), k0, k1);
    L.wv = rows_of(b.matrix(p + "attn_v.weight", c.kv_dim(), c.n_embd), k0, k1);
  } else {  // Phi-3: one fused matrix, Q then K then V rows
    const WeightMatrix qkv = b.matrix(p + "attn_qkv.weight", c.q_dim() + 2 * c.kv_dim(), c.n_embd);
    L.wq = rows_of(qkv, q0, q1);
    L.wk = rows_of(qkv, c.q_dim() + k0, c.q_dim() + k1);
    L.wv = rows_of(qkv, c.q_dim() + c.kv_dim() + k0, c.q_dim() + c.kv_dim() + k1);
  }
  if (!c.mla) L.wo = cols_of(b.matrix(p + "attn_output.weight", c.n_embd, c.q_dim()), q0, q1, p + "attn_output.weight");
  const bool bias_required = c.attn_bias;
  L.bq = slice(b.vector(p + "attn_q.bias", c.q_dim(), bias_required), q0, q1);
  L.bk = slice(b.vector(p + "attn_k.bias", c.kv_dim(), bias_required), k0, k1);
  L.bv = slice(b.vector(p + "attn_v.bias", c.kv_dim(), bias_required), k0, k1);
  if (c.attn_out_bias && s.tp_rank == 0) L.bo = b.vector(p + "attn_output.bias", c.n_embd);  // added once
  if (c.attn_sinks) L.sinks = slice(b.vector(p + "attn_sinks.weight", c.n_head), q0 / d, q1 / d);
  if (c.qk_norm) {
    L.q_norm = b.vector(p + "attn_q_norm.weight", c.qk_norm_whole ? c.q_dim() : c.d_head);
    L.k_norm = b.vector(p + "attn_k_norm.weight", c.qk_norm_whole ? c.kv_dim() : c.d_head);
    if (c.qk_norm_whole) L.q_norm = slice(L.q_norm, q0, q1), L.k_norm = slice(L.k_norm, k0, k1);  // this rank's heads
  }
  if (c.post_norms) {
    L.post_attn_norm = b.vector(p + "post_attention_norm.weight", c.n_embd);
    L.post_ffn_norm = b.vector(p + "post_ffw_norm.weight", c.n_embd);
  }
  // gpt-oss's GGUF names the pre-FFN norm after Hugging Face's post_attention_layernorm.
  L.ffn_norm = b.vector(p + (c.arch == "gpt-oss" ? "post_attention_norm.weight" : "ffn_norm.weight"), c.n_embd);
  if (!c.layer_is_moe.empty() && c.layer_is_moe[il]) return bind_moe(c, b, p, L);
  L.w_down = b.matrix(p + "ffn_down.weight", c.n_embd, c.n_ff);
  const auto [f0, f1] = ffn_cols(c, c.n_ff, L.w_down);
  L.w_down = cols_of(L.w_down, f0, f1, p + "ffn_down.weight");
  if (c.arch != "phi3") {
    L.w_gate = rows_of(b.matrix(p + "ffn_gate.weight", c.n_ff, c.n_embd), f0, f1);
    L.w_up = rows_of(b.matrix(p + "ffn_up.weight", c.n_ff, c.n_embd), f0, f1);
  } else {  // Phi-3: ffn_up holds the gate rows, then the up rows
    const WeightMatrix gate_up = b.matrix(p + "ffn_up.weight", 2 * c.n_ff, c.n_embd);
    L.w_gate = rows_of(gate_up, f0, f1);
    L.w_up = rows_of(gate_up, c.n_ff + f0, c.n_ff + f1);
  }
}

}  // namespace

ModelWeights bind_weights(const ModelConfig& c, const TensorLookup& lookup, const std::string& source, bool reloadable) {
  ModelWeights w;
  Binder b(lookup, source, w.weight_bytes);
  const ShardLayout& s = c.shard;
  w.tok_embd = b.matrix("token_embd.weight", c.n_vocab, c.n_embd);
  if (!s.split() || s.first_stage()) w.weight_bytes += matrix_bytes(w.tok_embd);
  w.output_norm = b.vector("output_norm.weight", c.n_embd);
  w.output = b.matrix("output.weight", c.n_vocab, c.n_embd, /*required=*/false);
  const bool tied = w.output.empty();
  if (tied) w.output = w.tok_embd;
  if (c.logit_rows > 0) w.output = rows_of(w.output, 0, c.logit_rows);  // its first rows only (a draft's head)
  if (!tied && !s.split()) w.weight_bytes += matrix_bytes(w.output);
  if (s.split()) {  // the last stage's TP ranks each compute their rows of the logits
    w.output = s.last_stage() ? rows_of(w.output, s.vocab_begin, s.vocab_end) : WeightMatrix{};
    w.weight_bytes += matrix_bytes(w.output);
  }
  w.rope_freqs = b.vector("rope_freqs.weight", c.rot_dims() / 2, /*required=*/false);
  if (w.rope_freqs.empty()) w.rope_freqs = c.rope_llama3_freqs;
  if (c.longrope) {
    w.rope_long = b.vector("rope_factors_long.weight", c.rot_dims() / 2, /*required=*/false);
    w.rope_short = b.vector("rope_factors_short.weight", c.rot_dims() / 2, /*required=*/false);
    if (w.rope_long.empty()) w.rope_long = c.rope_long_factors;
    if (w.rope_short.empty()) w.rope_short = c.rope_short_factors;
    check(int64_t(w.rope_long.size()) == c.rot_dims() / 2 && w.rope_short.size() == w.rope_long.size(),
          "{}: LongRoPE factors must have {} entries", source, c.rot_dims() / 2);
  }
  check(w.rope_freqs.empty() || int64_t(w.rope_freqs.size()) == c.rot_dims() / 2, "{}: rope_freqs must have {} entries", source, c.rot_dims() / 2);
  for (const auto* v : {&w.rope_freqs, &w.rope_long, &w.rope_short})
    for (float f : *v) check(std::isfinite(f) && f > 0, "{}: RoPE frequency factors must be positive", source);
  w.layers.resize(size_t(c.n_layer));
  for (int64_t il = 0; il < c.n_layer; ++il) {
    if (!c.owns_layer(il)) continue;  // another stage's: not bound, so its pages are never read
    LayerWeights& L = w.layers[size_t(il)];
    bind_layer(c, b, il, L);
    std::vector<WeightMatrix*> mats = {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.router, &L.sh_gate, &L.sh_up, &L.sh_down,
                                       &L.wq_a, &L.wq_b, &L.wkv_a};
    for (auto* experts : {&L.exp_gate, &L.exp_up, &L.exp_down, &L.wv_b})
      for (WeightMatrix& m : *experts) mats.push_back(&m);
    if (L.mla_owned.empty())
      for (WeightMatrix& m : L.wk_b) mats.push_back(&m);
    for (WeightMatrix& m : L.wk_b)  // transposed copies: packed, never released (they are not file pages)
      if (!L.mla_owned.empty()) w.weight_bytes += matrix_bytes(m), cpu::prepare_weights(m);
    for (WeightMatrix* m : mats) {
      w.weight_bytes += matrix_bytes(*m);
      cpu::prepare_weights(*m);
      release_file_pages(*m);
    }
  }
  if (c.norm_plus_one) {  // Hugging Face Gemma: the RMSNorm weight is stored as w - 1
    auto plus_one = [](std::vector<float>& v) { for (float& x : v) x += 1.0f; };
    plus_one(w.output_norm);
    for (auto& L : w.layers)
      for (auto* v : {&L.attn_norm, &L.ffn_norm, &L.post_attn_norm, &L.post_ffn_norm, &L.q_norm, &L.k_norm}) plus_one(*v);
  }
  cpu::prepare_weights(w.output);  // the embedding itself stays as in the file (rows read by get_row)
  if (reloadable || w.output.data != w.tok_embd.data) release_file_pages(w.output);
  return w;
}

}  // namespace serval
