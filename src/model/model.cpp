#include "model/model.h"

#include <algorithm>
#include <map>
#include <cmath>
#include <limits>
#include <utility>
#include <climits>
#include <cstring>

#include "base/error.h"
#include "base/thread_pool.h"
#include "model/moe.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {

KvCache::KvCache(const ModelConfig& c, std::vector<int64_t> n_slots, DType type)
    : n_slots_(std::move(n_slots)), kv_dim_(c.local_kv_dim()), type_(type), d_head_(c.d_head),
      n_head_kv_(c.local_kv_dim() / c.d_head), row_bytes_(0), head_scale_(size_t(c.n_layer * n_head_kv_), 1.0f),
      v_rotated_(type == DType::F8_E4M3 && !c.mla && c.d_head > 0 && (c.d_head & (c.d_head - 1)) == 0),
      shared_v_(c.mla),
      record_copies_(c.shard.split() && c.shard.rank() == 0) {
  check(type == DType::F16 || type == DType::F32 || type == DType::BF16 || type == DType::Q8_0 ||
            type == DType::F8_E4M3,
        "KV cache type must be f32, f16, bf16, q8_0 or fp8_e4m3");
  check(type != DType::Q8_0 || c.d_head % 32 == 0, "a q8_0 KV cache needs a head dimension that is a multiple of 32 (this model's is {})", c.d_head);
  check(int(n_slots_.size()) == c.n_kv_groups(), "KV cache needs {} groups", c.n_kv_groups());
  row_bytes_ = row_bytes(type, size_t(kv_dim_));
  for (int64_t il = 0; il < c.n_layer; ++il) {
    layer_group_.push_back(c.kv_group(il));
    // Another pipeline stage's layers hold nothing here.
    const size_t bytes = c.owns_layer(il) ? size_t(n_slots_[layer_group_.back()]) * row_bytes_ : 0;
    k_.push_back({alloc_huge(bytes), bytes});
    const size_t v_bytes = shared_v_ ? 0 : bytes;  // MLA: V is read from the K rows
    v_.push_back({alloc_huge(v_bytes), v_bytes});
    check((bytes == 0 || k_.back().data) && (v_bytes == 0 || v_.back().data), "out of memory for the KV cache ({} bytes a layer)", bytes + v_bytes);
  }
}

KvCache::KvCache(const ModelConfig& c, int64_t n_slots, DType type)
    : KvCache(c, std::vector<int64_t>(c.n_kv_groups(), n_slots), type) {}

uint64_t KvCache::bytes() const {
  uint64_t total = 0;
  for (size_t il = 0; il < k_.size(); ++il) total += k_[il].bytes + v_[il].bytes;
  return total;
}

void KvCache::set_head_scale(int64_t layer, int64_t head, float scale) {
  check(scale > 0 && std::isfinite(scale), "a KV head scale must be positive and finite");
  head_scale_[layer * n_head_kv_ + head] = scale;
}

namespace {

// One K or V row (kv_dim values) in the cache's type; FP8 divides each head's values by its scale.
void store_row(DType type, const float* x, uint8_t* out, int64_t kv_dim, int64_t d_head, const float* scale) {
  switch (type) {
    case DType::F32: std::memcpy(out, x, size_t(kv_dim) * 4); return;
    case DType::F16: f32_to_fp16_row(x, reinterpret_cast<uint16_t*>(out), size_t(kv_dim)); return;
    case DType::F8_E4M3:
      for (int64_t i = 0; i < kv_dim; ++i) out[i] = f32_to_fp8_e4m3(x[i] / scale[i / d_head]);
      return;
    default: quantize_row(type, x, out, size_t(kv_dim));  // BF16, Q8_0: per 32 values of one head
  }
}

}  // namespace

void KvCache::write(int64_t layer, int32_t slot, const float* k, const float* v) {
  const float* scale = head_scale_.data() + layer * n_head_kv_;
  store_row(type_, k, k_[layer].data.get() + int64_t(slot) * row_bytes_, kv_dim_, d_head_, scale);
  if (shared_v_) return;
  if (v_rotated_) {
    thread_local std::vector<float> rotated;
    rotated.assign(v, v + kv_dim_);
    for (int64_t h = 0; h < n_head_kv_; ++h) hadamard_rotate(rotated.data() + h * d_head_, d_head_);
    v = rotated.data();
  }
  store_row(type_, v, v_[layer].data.get() + int64_t(slot) * row_bytes_, kv_dim_, d_head_, scale);
}

void KvCache::copy_slot(int group, int32_t from, int32_t to) {
  check(group >= 0 && group < n_groups() && from >= 0 && to >= 0 && from < n_slots_[group] && to < n_slots_[group],
        "KV slot copy out of range");
  if (record_copies_) copies_.push_back({group, from, to});
  const size_t row = row_bytes_;
  for (size_t il = 0; il < layer_group_.size(); ++il) {
    if (layer_group_[il] != group || k_[il].bytes == 0) continue;
    std::memcpy(k_[il].data.get() + size_t(to) * row, k_[il].data.get() + size_t(from) * row, row);
    if (!shared_v_) std::memcpy(v_[il].data.get() + size_t(to) * row, v_[il].data.get() + size_t(from) * row, row);
  }
}

KvLayerView KvCache::view(int64_t layer) const {
  const uint8_t* k = k_[layer].data.get();
  return {type_, k, shared_v_ ? k : v_[layer].data.get(), kv_dim_, d_head_, head_scale_.data() + layer * n_head_kv_,
          v_rotated_};
}

void Batch::add(int32_t token, int32_t pos, int32_t seq, int32_t slot, bool logits) {
  tokens.push_back(token);
  positions.push_back(pos);
  seq_ids.push_back(seq);
  for (auto& g : slots) g.push_back(slot);
  want_logits.push_back(logits);
}

namespace {

// out[t] = rms_norm(in[t]) * w for each of n_tok rows of width n.
void rms_norm_rows(const float* in, const std::vector<float>& w, float* out, int64_t n_tok, int64_t n, float eps) {
  parallel_for(n_tok, [&](int64_t t) { rms_norm(in + t * n, w.data(), out + t * n, n, eps); });
}

// x[i] += y[i] over n_tok rows of width n.
void add_rows(float* x, const float* y, int64_t n_tok, int64_t n) {
  parallel_for(n_tok, [&](int64_t t) {
    for (int64_t i = t * n; i < (t + 1) * n; ++i) x[i] += y[i];
  });
}

// OLMoE's query and key norms span all heads; a TP rank holds some of them. Each rank's sums of squares
// per token (its query values; its key values where it is the first rank of its KV heads, which ranks
// beyond the KV heads' count replicate) are added over the ranks, then each rank scales its own
// values as rms_norm does, by its slice of the norm weights.
void split_whole_qk_norm(float* q, int64_t q_dim, const float* wq, float* k, int64_t kv_dim, const float* wk,
                         bool k_owner, int64_t n_tok, const ModelConfig& c, ShardIo& io) {
  std::vector<float> ss(static_cast<size_t>(2 * n_tok));
  parallel_for(n_tok, [&](int64_t t) {
    double a = 0, b = 0;
    for (int64_t i = 0; i < q_dim; ++i) a += double(q[t * q_dim + i]) * q[t * q_dim + i];
    for (int64_t i = 0; k_owner && i < kv_dim; ++i) b += double(k[t * kv_dim + i]) * k[t * kv_dim + i];
    ss[size_t(2 * t)] = float(a), ss[size_t(2 * t + 1)] = float(b);
  });
  io.tp_sum(ss.data(), 2 * n_tok);
  parallel_for(n_tok, [&](int64_t t) {
    const float sq = float(1.0 / std::sqrt(double(ss[size_t(2 * t)]) / double(c.q_dim()) + c.norm_eps));
    const float sk = float(1.0 / std::sqrt(double(ss[size_t(2 * t + 1)]) / double(c.kv_dim()) + c.norm_eps));
    for (int64_t i = 0; i < q_dim; ++i) q[t * q_dim + i] = q[t * q_dim + i] * sq * wq[i];
    for (int64_t i = 0; i < kv_dim; ++i) k[t * kv_dim + i] = k[t * kv_dim + i] * sk * wk[i];
  });
}

void add_bias(float* y, const std::vector<float>& b, int64_t n_tok) {
  if (b.empty()) return;
  const int64_t n = static_cast<int64_t>(b.size());
  for (int64_t t = 0; t < n_tok; ++t)
    for (int64_t i = 0; i < n; ++i) y[t * n + i] += b[i];
}

}  // namespace

double Model::rope_angle(double pos, int64_t i, bool swa_layer) const {
  const auto& c = config_;
  const double base = swa_layer ? c.rope_base_swa : c.rope_base;
  const double p = pos / (swa_layer ? 1.0 : c.rope_linear_scale);
  double theta = p * std::pow(base, -2.0 * double(i) / double(c.rot_dims()));
  if (!rope_div_.empty()) theta /= rope_div_[i];
  if (!yarn_ramp_.empty()) theta = theta / c.yarn_factor * (1.0 - yarn_ramp_[i]) + theta * yarn_ramp_[i];
  return theta;
}

void Model::init_yarn() {
  const auto& c = config_;
  yarn_ramp_.clear();
  if (c.yarn_factor <= 0) return;
  // transformers' find_correction_range: the pair index where a pair turns `rot` times over the
  // original context, floored/ceiled (truncate) and clamped to [0, dim - 1].
  const double dim = double(c.rot_dims()), base = c.rope_base, orig = double(c.rope_orig_ctx);
  auto corr = [&](double rot) { return dim * std::log(orig / (rot * 2 * M_PI)) / (2 * std::log(base)); };
  double lo = corr(c.yarn_beta_fast), hi = corr(c.yarn_beta_slow);
  if (c.yarn_truncate) lo = std::floor(lo), hi = std::ceil(hi);
  lo = std::max(lo, 0.0), hi = std::min(hi, dim - 1);
  if (lo == hi) hi += 0.001;
  yarn_ramp_.resize(size_t(c.rot_dims() / 2));
  for (size_t i = 0; i < yarn_ramp_.size(); ++i)
    yarn_ramp_[i] = 1.0 - std::clamp((double(i) - lo) / (hi - lo), 0.0, 1.0);
}

void Model::set_context_length(int64_t n_ctx) {
  const auto& c = config_;
  // The other ranks of a split model loaded with the trained context: their set cannot change here.
  check(!context_set_ || !c.shard.split() || !c.longrope || (n_ctx > c.rope_orig_ctx) == long_rope_,
        "LongRoPE's short factors (a context of at most {} tokens) are not available with --tp / --pp", c.rope_orig_ctx);
  context_set_ = true;
  rope_div_ = weights_.rope_freqs;
  long_rope_ = c.longrope && n_ctx > c.rope_orig_ctx;
  if (c.longrope) rope_div_ = long_rope_ ? weights_.rope_long : weights_.rope_short;
  init_yarn();
  k_centres_ = compute_k_centres();
}

Model::RopeTable Model::rope_table(const Batch& batch, bool swa_layer) const {
  const auto& c = config_;
  // Rows of d_head / 2 entries; the first rot_dims() / 2 are used (partial rotary leaves the rest).
  const int64_t half = c.d_head / 2, n_tok = int64_t(batch.size());
  RopeTable r{std::vector<float>(n_tok * half), std::vector<float>(n_tok * half)};
  const double mscale = c.rope_attn_factor;  // YaRN / LongRoPE scale cos and sin (1: exact as before)
  parallel_for(n_tok, [&](int64_t t) {
    for (int64_t i = 0; i < c.rot_dims() / 2; ++i) {
      const double theta = rope_angle(batch.positions[t], i, swa_layer);
      r.cs[t * half + i] = float(std::cos(theta) * mscale);
      r.sn[t * half + i] = float(std::sin(theta) * mscale);
    }
  });
  return r;
}

void Model::apply_rope(float* vec, int64_t n_heads, const float* cs, const float* sn) const {
  const auto& c = config_;
  const int64_t d = c.d_head, half = c.rot_dims() / 2;  // pairs among the first rot_dims() values
  const bool neox = c.rope_style == RopeStyle::Neox;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* x = vec + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
      const float x0 = x[a], x1 = x[b];
      x[a] = x0 * cs[i] - x1 * sn[i];
      x[b] = x0 * sn[i] + x1 * cs[i];
    }
  }
}

std::vector<std::vector<float>> Model::compute_k_centres() const {
  const auto& c = config_;
  std::vector<std::vector<float>> centres(weights_.layers.size());
  if (c.qk_norm || c.d_head < 2 || c.rot_dims() != c.d_head) return centres;  // the norm comes after the bias: no fixed centre
  const int64_t d = c.d_head, half = d / 2;
  const bool neox = c.rope_style == RopeStyle::Neox;
  const double n = double(c.n_ctx_train > 0 ? c.n_ctx_train : 4096);
  for (size_t il = 0; il < centres.size(); ++il) {
    const std::vector<float>& bk = weights_.layers[il].bk;
    if (bk.empty()) continue;
    const bool swa = c.layer_is_swa[il];
    std::vector<float> centre(bk.size());
    for (int64_t i = 0; i < half; ++i) {
      // The angle per position step; the mean of e^{i theta p} over p < n in closed form.
      const double theta = rope_angle(1.0, i, swa);
      const double s = std::sin(theta / 2);
      const double amp = std::abs(s) < 1e-12 ? 1.0 : std::sin(n * theta / 2) / (n * s);
      const double g = c.rope_attn_factor;  // YaRN / LongRoPE scale the rotated keys
      const double mc = g * amp * std::cos(theta * (n - 1) / 2), ms = g * amp * std::sin(theta * (n - 1) / 2);
      for (size_t h = 0; h < bk.size() / size_t(d); ++h) {
        const size_t a = h * d + (neox ? i : 2 * i), b = h * d + (neox ? i + half : 2 * i + 1);
        centre[a] = float(bk[a] * mc - bk[b] * ms);
        centre[b] = float(bk[a] * ms + bk[b] * mc);
      }
    }
    centres[il] = std::move(centre);
  }
  return centres;
}

const float* Model::k_centre(int64_t il, const KvCache& kv) const {
  if (size_t(il) >= k_centres_.size() || k_centres_[il].empty() || k_centring_ == KCentring::Never) return nullptr;
  const bool quantized = kv.type() == DType::Q8_0 || kv.type() == DType::F8_E4M3;
  return k_centring_ == KCentring::Always || quantized ? k_centres_[il].data() : nullptr;
}

void Model::observe(int64_t il, std::initializer_list<const char*> kinds, const float* x, int64_t n_tok,
                    int64_t cols) const {
  if (!observer_) return;
  const std::string prefix = il < 0 ? "" : "blk." + std::to_string(il) + ".";
  for (const char* kind : kinds) observer_(prefix + kind + ".weight", x, n_tok, cols);
}

namespace {

// RoPE on n_pairs interleaved pairs (2i, 2i + 1) of x (DeepSeek's rotated query and key values).
void rope_interleaved(float* x, int64_t n_pairs, const float* cs, const float* sn) {
  for (int64_t i = 0; i < n_pairs; ++i) {
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * cs[i] - x1 * sn[i];
    x[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
  }
}

// For each head h: out[t][h * out_step ..] = W[h] in[t][h * in_step ..] over n_tok tokens (W[h]
// [rows, cols]; rows of in and out in_stride and out_stride floats apart). The heads run side by side,
// each product inline on its thread: a row's result is the same function of its inputs either way.
void per_head_products(const std::vector<WeightMatrix>& w, const float* in, int64_t in_stride, int64_t in_step,
                       float* out, int64_t out_stride, int64_t out_step, int64_t n_tok) {
  parallel_for(int64_t(w.size()), [&](int64_t h) {
    const WeightMatrix& m = w[size_t(h)];
    std::vector<float> x(size_t(n_tok * m.cols)), y(size_t(n_tok * m.rows));
    for (int64_t t = 0; t < n_tok; ++t) std::copy_n(in + t * in_stride + h * in_step, m.cols, x.data() + t * m.cols);
    cpu::matmul(m, x.data(), y.data(), n_tok);
    for (int64_t t = 0; t < n_tok; ++t) std::copy_n(y.data() + t * m.rows, m.rows, out + t * out_stride + h * out_step);
  });
}

}  // namespace

void Model::attention_block(int64_t il, const Batch& batch, const RopeTable* ropes, KvCache& kv,
                            std::vector<float>& x, ShardIo* io) const {
  const auto& c = config_;
  if (c.mla) return mla_attention_block(il, batch, ropes[0], kv, x, io);
  const auto& L = weights_.layers[il];
  const int64_t n_tok = static_cast<int64_t>(batch.size()), half = c.d_head / 2;
  const bool swa = c.layer_is_swa[il];
  const int group = c.kv_group(il);
  // This rank's heads (all of them unless the model is split over TP ranks).
  const int64_t q_dim = L.wq.rows, kv_dim = L.wk.rows, n_head = q_dim / c.d_head, n_head_kv = kv_dim / c.d_head;
  std::vector<float> h(n_tok * c.n_embd), q(n_tok * q_dim), k(n_tok * kv_dim), v(n_tok * kv_dim);
  rms_norm_rows(x.data(), L.attn_norm, h.data(), n_tok, c.n_embd, c.norm_eps);
  observe(il, {"attn_q", "attn_k", "attn_v"}, h.data(), n_tok, c.n_embd);
  const cpu::MatmulOut qkv[] = {{&L.wq, q.data()}, {&L.wk, k.data()}, {&L.wv, v.data()}};
  cpu::matmul_many(qkv, h.data(), n_tok);
  apply_lora(il, LoraTarget::Q, batch, h.data(), c.n_embd, q.data());
  apply_lora(il, LoraTarget::K, batch, h.data(), c.n_embd, k.data());
  apply_lora(il, LoraTarget::V, batch, h.data(), c.n_embd, v.data());
  add_bias(q.data(), L.bq, n_tok);
  add_bias(k.data(), L.bk, n_tok);
  add_bias(v.data(), L.bv, n_tok);
  const RopeTable& rope = ropes[swa ? 1 : 0];
  const float* centre = k_centre(il, kv);
  const bool split_norm = c.qk_norm_whole && io && c.shard.tp > 1;
  if (split_norm)
    split_whole_qk_norm(q.data(), q_dim, L.q_norm.data(), k.data(), kv_dim, L.k_norm.data(),
                        c.shard.head_begin == c.shard.kv_head_begin * (c.n_head / c.n_head_kv), n_tok, c, *io);
  parallel_for(n_tok, [&](int64_t t) {
    float* qt = q.data() + t * q_dim;
    float* kt = k.data() + t * kv_dim;
    if (c.qk_norm_whole) {  // OLMoE: one norm over all heads (split over TP ranks: done above)
      if (!split_norm) {
        rms_norm(qt, L.q_norm.data(), qt, q_dim, c.norm_eps);
        rms_norm(kt, L.k_norm.data(), kt, kv_dim, c.norm_eps);
      }
    } else if (c.qk_norm) {
      for (int64_t hd = 0; hd < n_head; ++hd) rms_norm(qt + hd * c.d_head, L.q_norm.data(), qt + hd * c.d_head, c.d_head, c.norm_eps);
      for (int64_t hd = 0; hd < n_head_kv; ++hd) rms_norm(kt + hd * c.d_head, L.k_norm.data(), kt + hd * c.d_head, c.d_head, c.norm_eps);
    }
    apply_rope(qt, n_head, rope.cs.data() + t * half, rope.sn.data() + t * half);
    apply_rope(kt, n_head_kv, rope.cs.data() + t * half, rope.sn.data() + t * half);
    if (centre)
      for (int64_t i = 0; i < kv_dim; ++i) kt[i] -= centre[i];
    kv.write(il, batch.slots[group][t], kt, v.data() + t * kv_dim);
  });
  std::vector<float> attn(n_tok * q_dim);
  std::vector<AttentionQuery> queries(n_tok);
  for (int64_t t = 0; t < n_tok; ++t) {
    const int32_t pos = batch.positions[t];
    const int64_t first = swa ? std::max<int64_t>(0, pos - c.sliding_window + 1) : 0;
    const KvSpan keys{batch.block_tables[group][batch.seq_ids[t]], batch.block_size_of(batch.seq_ids[t]), first, pos};
    queries[t] = {q.data() + t * q_dim, keys, attn.data() + t * q_dim};
  }
  const AttentionShape shape{int(n_head), int(n_head_kv), int(c.d_head), c.attn_scale, c.attn_softcap,
                             L.sinks.empty() ? nullptr : L.sinks.data()};
  cpu::attention_batch(shape, queries, kv.view(il));
  std::vector<float> o(n_tok * c.n_embd);
  observe(il, {"attn_output"}, attn.data(), n_tok, q_dim);
  cpu::matmul(L.wo, attn.data(), o.data(), n_tok);
  apply_lora(il, LoraTarget::O, batch, attn.data(), q_dim, o.data());
  add_bias(o.data(), L.bo, n_tok);  // gpt-oss (TP rank 0 only: the bias is added once)
  if (io && c.shard.tp > 1) io->tp_sum(o.data(), n_tok * c.n_embd);  // row-parallel: partial sums
  if (c.post_norms) rms_norm_rows(o.data(), L.post_attn_norm, o.data(), n_tok, c.n_embd, c.norm_eps);
  add_rows(x.data(), o.data(), n_tok, c.n_embd);
}

void Model::mla_attention_block(int64_t il, const Batch& batch, const RopeTable& rope, KvCache& kv, std::vector<float>& x,
                                ShardIo* io) const {
  const auto& c = config_;
  const auto& L = weights_.layers[il];
  // This rank's heads (all of them unless split over TP ranks; each rank keeps the whole latent).
  const int64_t n_tok = int64_t(batch.size()), nh = int64_t(L.wv_b.size()), nope = c.qk_nope_dim, qk = nope + c.qk_rope_dim;
  const int64_t lat = c.kv_lora_rank, row = c.d_head, half = c.d_head / 2, vd = c.v_head_dim;
  std::vector<float> h(n_tok * c.n_embd), q(n_tok * nh * qk), kv_a(n_tok * row);
  rms_norm_rows(x.data(), L.attn_norm, h.data(), n_tok, c.n_embd, c.norm_eps);
  // The query (through its low-rank pair when q_lora_rank) and the cache row, from the same input.
  std::vector<float> qa(size_t(n_tok * c.q_lora_rank));
  const WeightMatrix& q_in = c.q_lora_rank > 0 ? L.wq_a : L.wq;
  observe(il, {c.q_lora_rank > 0 ? "attn_q_a" : "attn_q", "attn_kv_a_mqa"}, h.data(), n_tok, c.n_embd);
  const cpu::MatmulOut first[] = {{&q_in, c.q_lora_rank > 0 ? qa.data() : q.data()}, {&L.wkv_a, kv_a.data()}};
  cpu::matmul_many(first, h.data(), n_tok);
  if (c.q_lora_rank > 0) {
    rms_norm_rows(qa.data(), L.q_a_norm, qa.data(), n_tok, c.q_lora_rank, c.norm_eps);
    observe(il, {"attn_q_b"}, qa.data(), n_tok, c.q_lora_rank);
    cpu::matmul(L.wq_b, qa.data(), q.data(), n_tok);
  }
  // Absorbed queries [n_tok][nh][row]: the latent part from each head's key up-projection (below), the
  // rotated part as it is; the cache row: the normed latent, then the rotated key.
  std::vector<float> qabs(n_tok * nh * row);
  parallel_for(n_tok, [&](int64_t t) {
    float* r = kv_a.data() + t * row;
    const float *cs = rope.cs.data() + t * half, *sn = rope.sn.data() + t * half;
    rms_norm(r, L.kv_a_norm.data(), r, lat, c.norm_eps);
    rope_interleaved(r + lat, c.qk_rope_dim / 2, cs, sn);
    kv.write(il, batch.slots[0][t], r, nullptr);
    for (int64_t hd = 0; hd < nh; ++hd) {
      float* qr = q.data() + (t * nh + hd) * qk + nope;
      rope_interleaved(qr, c.qk_rope_dim / 2, cs, sn);
      std::copy_n(qr, c.qk_rope_dim, qabs.data() + (t * nh + hd) * row + lat);
    }
  });
  per_head_products(L.wk_b, q.data(), nh * qk, qk, qabs.data(), nh * row, row, n_tok);
  // One KV head of `row` values shared by every head; V is the same row (its latent part is used).
  std::vector<float> attn(n_tok * nh * row);
  std::vector<AttentionQuery> queries(n_tok);
  for (int64_t t = 0; t < n_tok; ++t) {
    const KvSpan keys{batch.block_tables[0][batch.seq_ids[t]], batch.block_size_of(batch.seq_ids[t]), 0, batch.positions[t]};
    queries[t] = {qabs.data() + t * nh * row, keys, attn.data() + t * nh * row};
  }
  cpu::attention_batch(AttentionShape{int(nh), 1, int(row), c.attn_scale, c.attn_softcap, nullptr}, queries, kv.view(il));
  std::vector<float> vo(n_tok * nh * vd), o(n_tok * c.n_embd);
  per_head_products(L.wv_b, attn.data(), nh * row, row, vo.data(), nh * vd, vd, n_tok);
  observe(il, {"attn_output"}, vo.data(), n_tok, nh * vd);
  cpu::matmul(L.wo, vo.data(), o.data(), n_tok);
  if (io && c.shard.tp > 1) io->tp_sum(o.data(), n_tok * c.n_embd);
  add_rows(x.data(), o.data(), n_tok, c.n_embd);
}

void Model::ffn_block(int64_t il, const Batch& batch, std::vector<float>& x, ShardIo* io) const {
  const auto& c = config_;
  const int64_t n_tok = int64_t(batch.size());
  const auto& L = weights_.layers[il];
  if (!L.exp_gate.empty()) {
    std::vector<float> h(n_tok * c.n_embd), out(n_tok * c.n_embd);
    rms_norm_rows(x.data(), L.ffn_norm, h.data(), n_tok, c.n_embd, c.norm_eps);
    // The observers see the router's and shared expert's inputs as matrices, the experts' by expert.
    const MoeObserver sight = [&](const char* kind, int64_t e, const float* in, int64_t rows, int64_t cols) {
      const std::string name = "blk." + std::to_string(il) + "." + kind + ".weight";
      if (e < 0 && observer_) observer_(name, in, rows, cols);
      if (e >= 0 && expert_observer_) expert_observer_(name, e, c.n_expert, in, rows, cols);
    };
    // Each row's adapter updates the expert it runs (the shared expert's: LoraTarget::ShGate ...).
    const MoeLora lora = [&](int64_t e, int kind, const int64_t* tokens, int64_t m, const float* in, int64_t cols, float* y) {
      lora_rows(batch, [&](const LoraAdapter& a) {
        return e < 0 ? &a.layers[size_t(il)][size_t(LoraTarget::ShGate) + size_t(kind)] : a.expert_pair(il, e, kind);
      }, tokens, m, in, cols, y);
    };
    moe_ffn(c, L, h.data(), n_tok, out.data(), expert_tokens_.data() + il * c.n_expert,
            observer_ || expert_observer_ ? &sight : nullptr, batch.adapter.empty() ? nullptr : &lora);
    if (io && c.shard.tp > 1) io->tp_sum(out.data(), n_tok * c.n_embd);  // each rank's expert columns
    return add_rows(x.data(), out.data(), n_tok, c.n_embd);
  }
  const int64_t n_ff = L.w_gate.rows;  // this rank's FFN columns
  std::vector<float> h(n_tok * c.n_embd), gate(n_tok * n_ff), up(n_tok * n_ff), down(n_tok * c.n_embd);
  rms_norm_rows(x.data(), L.ffn_norm, h.data(), n_tok, c.n_embd, c.norm_eps);
  observe(il, {"ffn_gate", "ffn_up"}, h.data(), n_tok, c.n_embd);
  const cpu::MatmulOut gate_up[] = {{&L.w_gate, gate.data()}, {&L.w_up, up.data()}};
  cpu::matmul_many(gate_up, h.data(), n_tok);
  apply_lora(il, LoraTarget::Gate, batch, h.data(), c.n_embd, gate.data());
  apply_lora(il, LoraTarget::Up, batch, h.data(), c.n_embd, up.data());
  const auto act = c.ffn_act == FfnActivation::GeluTanh ? cpu::GluKind::GeluTanh : cpu::GluKind::Silu;
  parallel_for(n_tok, [&](int64_t t) {
    float* g = gate.data() + t * n_ff;
    cpu::glu(act, g, up.data() + t * n_ff, g, n_ff);
  });
  observe(il, {"ffn_down"}, gate.data(), n_tok, n_ff);
  cpu::matmul(L.w_down, gate.data(), down.data(), n_tok);
  apply_lora(il, LoraTarget::Down, batch, gate.data(), n_ff, down.data());
  if (io && c.shard.tp > 1) io->tp_sum(down.data(), n_tok * c.n_embd);
  if (c.post_norms) rms_norm_rows(down.data(), L.post_ffn_norm, down.data(), n_tok, c.n_embd, c.norm_eps);
  add_rows(x.data(), down.data(), n_tok, c.n_embd);
}

std::vector<float> Model::output_row(int32_t token) const {
  check(!config_.shard.split(), "output rows are read on a whole model only (not with --tp / --pp)");
  const WeightMatrix& w = weights_.output;
  check(token >= 0 && token < w.rows, "token {} is outside the output matrix ({} rows)", token, w.rows);
  std::vector<float> row(size_t(w.cols));
  dequantize_row(w.type, w.data + size_t(token) * w.row_stride, row.data(), w.cols);
  return row;
}

void Model::set_adapter(size_t id, std::shared_ptr<const LoraAdapter> adapter) {
  check(id < size_t(std::numeric_limits<int16_t>::max()), "too many LoRA adapters");
  std::shared_ptr<const LoraAdapter> old;  // freed outside the lock
  std::lock_guard<std::mutex> lock(adapters_mu_);
  if (adapters_.size() <= id) adapters_.resize(id + 1);
  old = std::exchange(adapters_[id], std::move(adapter));
}

bool Model::has_adapter(int32_t id) const {
  std::lock_guard<std::mutex> lock(adapters_mu_);
  return id >= 0 && size_t(id) < adapters_.size() && adapters_[size_t(id)];
}

void Model::apply_lora(int64_t il, LoraTarget target, const Batch& batch, const float* x, int64_t cols, float* y) const {
  if (batch.adapter.empty()) return;
  lora_rows(batch, [&](const LoraAdapter& a) { return &a.layers[size_t(il)][size_t(target)]; }, nullptr,
            int64_t(batch.size()), x, cols, y);
}

void Model::lora_rows(const Batch& batch, const std::function<const LoraPair*(const LoraAdapter&)>& pair_of,
                      const int64_t* tokens, int64_t m, const float* x, int64_t cols, float* y) const {
  // The rows grouped by adapter (Punica / S-LoRA's segments), in order of first appearance.
  struct Group {
    const LoraPair* pair;
    std::vector<int64_t> tokens;
    std::vector<float> factors;
  };
  std::vector<Group> groups;
  std::vector<int> group_of(adapters_.size(), -1);
  for (int64_t i = 0; i < m; ++i) {
    const size_t t = size_t(tokens ? tokens[i] : i);
    const int ai = batch.adapter[t];
    if (ai < 0) continue;
    const LoraAdapter& a = *adapters_[size_t(ai)];
    const LoraPair* p = pair_of(a);
    if (!p || p->empty()) continue;
    if (group_of[size_t(ai)] < 0) {
      group_of[size_t(ai)] = int(groups.size());
      groups.push_back({p, {}, {}});
    }
    Group& g = groups[size_t(group_of[size_t(ai)])];
    g.tokens.push_back(i);
    g.factors.push_back(a.factor(batch.adapter_scale[t]));
  }
  if (groups.empty()) return;
  std::vector<cpu::LoraSegment> segments;
  for (const Group& g : groups)
    segments.push_back({reinterpret_cast<const float*>(g.pair->a.data), g.pair->bt, g.pair->a.rows, g.tokens, g.factors});
  cpu::lora_update(segments, cols, groups[0].pair->b.rows, x, y);
}

void Model::validate_batch(const Batch& batch, const KvCache& kv) const {
  const auto& c = config_;
  check(batch.n_groups() == c.n_kv_groups() && kv.n_groups() == c.n_kv_groups(), "batch or KV cache has the wrong number of KV groups");
  check(batch.block_size > 0, "block size must be positive");
  check(batch.adapter.empty() || (batch.adapter.size() == batch.size() && batch.adapter_scale.size() == batch.size()),
        "batch adapters incomplete");
  check(batch.want_logits.size() == batch.size() && (batch.want_hidden.empty() || batch.want_hidden.size() == batch.size()),
        "batch output rows incomplete");
  check(batch.want_hidden.empty() || !c.shard.split(), "hidden-state rows without logits need a whole model (not --tp / --pp)");
  for (int16_t a : batch.adapter) check(a == -1 || has_adapter(a), "LoRA adapter {} is not loaded", a);
  for (int32_t bs : batch.table_block_size) check(bs > 0, "block size must be positive");
  for (int g = 0; g < batch.n_groups(); ++g) {
    check(batch.slots[g].size() == batch.size(), "batch slots of group {} incomplete", g);
    // Per sequence, the span of positions its tokens attend to: checked once per block, not once
    // per token.
    std::vector<std::pair<int64_t, int64_t>> span(batch.block_tables[g].size(), {INT64_MAX, -1});
    for (size_t t = 0; t < batch.size(); ++t) {
      check(batch.tokens[t] >= 0 && batch.tokens[t] < c.n_vocab, "token id {} is outside the vocabulary", batch.tokens[t]);
      check(batch.positions[t] >= 0, "negative position");
      check(batch.slots[g][t] >= 0 && batch.slots[g][t] < kv.n_slots(g), "KV slot {} out of range", batch.slots[g][t]);
      check(batch.seq_ids[t] >= 0 && batch.seq_ids[t] < int32_t(span.size()), "bad sequence id");
      const int64_t pos = batch.positions[t];
      const int64_t first = c.kv_group_is_swa(g) ? std::max<int64_t>(0, pos - c.sliding_window + 1) : 0;
      auto& sp = span[batch.seq_ids[t]];
      sp = {std::min(sp.first, first), std::max(sp.second, pos)};
    }
    for (size_t s = 0; s < span.size(); ++s) {
      const int64_t bs = batch.block_size_of(int32_t(s)), n_blocks = kv.n_slots(g) / bs;
      const auto& table = batch.block_tables[g][s];
      if (span[s].second < 0) continue;
      check(span[s].second / bs < int64_t(table.size()), "position {} has no KV block", span[s].second);
      for (int64_t b = span[s].first / bs; b <= span[s].second / bs; ++b)
        check(table[b] >= 0 && table[b] < n_blocks, "block {} of sequence {} is not a valid KV block", b, s);
    }
  }
}

void Model::forward(const Batch& batch, KvCache& kv, std::vector<float>& logits, std::vector<float>* hidden) const {
  if (driver_) return driver_->forward(batch, kv, logits, hidden);
  forward_shard(batch, kv, nullptr, logits, hidden);
}

namespace {

// Tokens [t0, t1) of `b` (block tables whole).
Batch token_range(const Batch& b, int64_t t0, int64_t t1) {
  auto sub = [&](const auto& v) { return std::decay_t<decltype(v)>(v.begin() + t0, v.begin() + t1); };
  Batch r(b.n_groups());
  r.tokens = sub(b.tokens), r.positions = sub(b.positions), r.seq_ids = sub(b.seq_ids);
  r.want_logits = sub(b.want_logits);
  for (int g = 0; g < b.n_groups(); ++g) r.slots[size_t(g)] = sub(b.slots[size_t(g)]);
  r.block_tables = b.block_tables;
  r.block_size = b.block_size;
  r.table_block_size = b.table_block_size;
  return r;
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> Model::micro_batches(int64_t n_tok) const {
  // At least 16 tokens each (the GEMM keeps its speed), at most two per stage (the fill and drain of
  // the pipeline cost 1 / (n + 1) of a step with two stages).
  const int64_t n = config_.shard.pp > 1 ? std::clamp<int64_t>(n_tok / 16, 1, 2 * config_.shard.pp) : 1;
  std::vector<std::pair<int64_t, int64_t>> r;
  for (int64_t i = 0; i < n; ++i) r.push_back({i * n_tok / n, (i + 1) * n_tok / n});
  return r;
}

bool Model::forward_shard(const Batch& batch, KvCache& kv, ShardIo* io, std::vector<float>& logits,
                          std::vector<float>* hidden) const {
  check(io || !config_.shard.split(), "a split model needs its ranks (ShardIo)");
  const auto parts = micro_batches(int64_t(batch.size()));
  if (parts.size() == 1) return forward_rows(batch, kv, io, logits, hidden);
  logits.clear();
  if (hidden) hidden->clear();
  std::vector<float> part_logits, part_hidden;
  bool last = false;
  for (const auto& [t0, t1] : parts) {
    last = forward_rows(token_range(batch, t0, t1), kv, io, part_logits, hidden ? &part_hidden : nullptr);
    logits.insert(logits.end(), part_logits.begin(), part_logits.end());
    if (hidden) hidden->insert(hidden->end(), part_hidden.begin(), part_hidden.end());
  }
  return last;
}

bool Model::forward_rows(const Batch& batch, KvCache& kv, ShardIo* io, std::vector<float>& logits,
                         std::vector<float>* hidden) const {
  const auto& c = config_;
  std::vector<float> local;
  std::vector<float>& out_rows = hidden ? *hidden : local;
  if (!final_rows(batch, kv, out_rows, io)) return false;
  const auto n_out = int64_t(std::count(batch.want_logits.begin(), batch.want_logits.end(), uint8_t(1)));
  logits.resize(n_out * weights_.output.rows);
  if (n_out == 0) return true;
  observe(-1, {"output"}, out_rows.data(), n_out, c.n_embd);
  cpu::matmul(weights_.output, out_rows.data(), logits.data(), n_out);
  if (c.final_softcap > 0)  // Gemma 2: logits soft-capped, cap * tanh(logit / cap)
    parallel_for(n_out, [&](int64_t r) {
      float* l = logits.data() + r * weights_.output.rows;
      for (int64_t i = 0; i < weights_.output.rows; ++i) l[i] = c.final_softcap * std::tanh(l[i] / c.final_softcap);
    });
  return true;
}

void Model::forward_hidden(const Batch& batch, KvCache& kv, std::vector<float>& hidden) const {
  check(!config_.shard.split(), "hidden states only without --tp / --pp");
  final_rows(batch, kv, hidden);
}

bool Model::final_rows(const Batch& batch, KvCache& kv, std::vector<float>& out_rows, ShardIo* io) const {
  const auto& c = config_;
  const int64_t n_tok = static_cast<int64_t>(batch.size());
  check(n_tok > 0, "forward: empty batch");
  validate_batch(batch, kv);
  std::vector<float> x(n_tok * c.n_embd);
  if (c.shard.first_stage()) {
    for (int64_t t = 0; t < n_tok; ++t) {
      get_row(weights_.tok_embd, batch.tokens[t], x.data() + t * c.n_embd);
      if (c.embd_scale != 1.0f)
        for (int64_t i = 0; i < c.n_embd; ++i) x[t * c.n_embd + i] *= c.embd_scale;
    }
  } else {
    io->recv_prev(x.data(), n_tok * c.n_embd);
  }
  RopeTable ropes[2];
  ropes[0] = rope_table(batch, false);
  if (std::find(c.layer_is_swa.begin(), c.layer_is_swa.end(), true) != c.layer_is_swa.end()) ropes[1] = rope_table(batch, true);
  for (int64_t il = 0; il < c.n_layer; ++il) {
    if (!c.owns_layer(il)) continue;
    attention_block(il, batch, ropes, kv, x, io);
    ffn_block(il, batch, x, io);
  }
  out_rows.clear();
  if (!c.shard.last_stage()) {
    io->send_next(x.data(), n_tok * c.n_embd);
    return false;
  }
  for (int pass = 0; pass < 2; ++pass)  // the want_logits rows, then the want_hidden ones
    for (int64_t t = 0; t < n_tok; ++t) {
      const bool wanted = pass == 0 ? batch.want_logits[t] : !batch.want_hidden.empty() && batch.want_hidden[t] && !batch.want_logits[t];
      if (!wanted) continue;
      out_rows.resize(out_rows.size() + c.n_embd);
      rms_norm(x.data() + t * c.n_embd, weights_.output_norm.data(), out_rows.data() + out_rows.size() - c.n_embd,
               c.n_embd, c.norm_eps);
    }
  return true;
}

}  // namespace serval
