#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fmt/ranges.h>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"
#include "io/gguf.h"

namespace serval {

constexpr int64_t kMaxLayers = 1024;

namespace {
bool any_swa(const std::vector<uint8_t>& f) { return std::find(f.begin(), f.end(), 1) != f.end(); }
bool any_global(const std::vector<uint8_t>& f) { return std::find(f.begin(), f.end(), 0) != f.end(); }
}  // namespace

int ModelConfig::n_kv_groups() const { return any_swa(layer_is_swa) && any_global(layer_is_swa) ? 2 : 1; }

int ModelConfig::kv_group(int64_t layer) const { return n_kv_groups() == 2 && layer_is_swa[layer] ? 1 : 0; }

bool ModelConfig::kv_group_is_swa(int group) const {
  return n_kv_groups() == 2 ? group == 1 : any_swa(layer_is_swa);
}

void ModelConfig::validate(const std::string& src) const {
  check(n_embd > 0 && n_layer > 0 && n_head > 0 && n_head_kv > 0 && d_head > 0 && n_ff > 0 && n_vocab > 0,
        "{}: hyperparameters must be positive (n_embd {}, n_layer {}, n_head {}, n_head_kv {}, d_head {}, n_ff {}, "
        "n_vocab {})", src, n_embd, n_layer, n_head, n_head_kv, d_head, n_ff, n_vocab);
  check(n_layer <= kMaxLayers && n_head <= 4096 && d_head <= 4096 && n_embd <= (1 << 20) && n_ff <= (1 << 22),
        "{}: hyperparameters are absurdly large", src);
  check(n_head % n_head_kv == 0, "{}: n_head {} is not a multiple of n_head_kv {}", src, n_head, n_head_kv);
  check(d_head % 2 == 0, "{}: head dimension {} must be even for RoPE", src, d_head);
  check(n_rot >= 0 && n_rot <= d_head && n_rot % 2 == 0, "{}: {} rotary dimensions do not fit a head of {}", src, n_rot, d_head);
  check(std::isfinite(norm_eps) && norm_eps > 0 && std::isfinite(rope_base) && rope_base > 0,
        "{}: bad norm epsilon or RoPE base", src);
  check(n_ctx_train > 0, "{}: the training context length {} must be positive", src, n_ctx_train);
  check(n_vocab <= INT32_MAX, "{}: vocabulary size {} does not fit 32-bit token ids", src, n_vocab);
  check(std::isfinite(rope_linear_scale) && rope_linear_scale > 0, "{}: bad RoPE scaling factor {}", src,
        rope_linear_scale);
  check(static_cast<int64_t>(layer_is_swa.size()) == n_layer, "{}: internal: sliding-window flags", src);
  check(std::isfinite(attn_softcap) && attn_softcap >= 0 && std::isfinite(final_softcap) && final_softcap >= 0 &&
            std::isfinite(attn_scale) && attn_scale > 0,
        "{}: bad soft-capping or attention scale", src);
  check(layer_is_moe.empty() || static_cast<int64_t>(layer_is_moe.size()) == n_layer, "{}: internal: MoE flags", src);
  if (n_expert > 0) {
    check(n_expert <= 4096 && n_expert_used >= 1 && n_expert_used <= n_expert,
          "{}: {} experts with {} used per token is not a valid mixture of experts", src, n_expert, n_expert_used);
    check(n_ff_exp > 0 && n_ff_exp <= (1 << 22) && n_ff_shexp >= 0 && n_ff_shexp <= (1 << 22),
          "{}: expert FFN width {} (shared {}) out of range", src, n_ff_exp, n_ff_shexp);
    check(std::isfinite(expert_weights_scale) && expert_weights_scale > 0, "{}: the routed experts' scale must be positive", src);
    check(expert_groups == 0 || (expert_groups > 0 && n_expert % expert_groups == 0 && expert_groups_used >= 1 &&
                                 expert_groups_used <= expert_groups &&
                                 n_expert_used <= expert_groups_used * (n_expert / expert_groups)),
          "{}: {} expert groups with {} used cannot hold {} of {} experts", src, expert_groups, expert_groups_used,
          n_expert_used, n_expert);
  }
  if (mla) {
    check(kv_lora_rank > 0 && qk_nope_dim > 0 && qk_rope_dim > 0 && qk_rope_dim % 2 == 0 && v_head_dim > 0 &&
              q_lora_rank >= 0 && kv_lora_rank + qk_rope_dim <= 4096 && qk_nope_dim <= 4096 && v_head_dim <= 4096 &&
              q_lora_rank <= (1 << 20),
          "{}: latent attention dimensions out of range (kv_lora_rank {}, q_lora_rank {}, qk_nope {}, qk_rope {}, v_head {})",
          src, kv_lora_rank, q_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim);
    check(n_head_kv == 1 && d_head == kv_lora_rank + qk_rope_dim && n_rot == qk_rope_dim, "{}: internal: MLA cache shape", src);
  }
}

namespace {
// What gpt-oss has beyond a Qwen-style MoE (ModelConfig's comment); every layer is MoE.
void set_gpt_oss(ModelConfig& c) {
  c.attn_bias = c.attn_out_bias = c.attn_sinks = c.moe_biases = c.swiglu_oai = true;
  c.expert_weights_norm = true;  // softmax over the chosen logits
  c.layer_is_moe.assign(size_t(c.n_layer), 1);
}

// Multi-head latent attention's cache shape (ModelConfig::mla): one row of the latent and the rotated
// key per token, attended by every head; DeepSeek rotates interleaved pairs (no permutation in
// llama.cpp's converter; transformers' complex form).
void set_mla_shape(ModelConfig& c) {
  c.mla = true;
  c.n_head_kv = 1;
  c.d_head = c.kv_lora_rank + c.qk_rope_dim;
  c.n_rot = c.qk_rope_dim;
  c.rope_style = RopeStyle::Interleaved;
}

// rope.scaling.*: linear (positions divided by the factor), yarn (factor, original context, betas,
// attn_factor as llama.cpp's multiplier of 0.1 ln s + 1) and LongRoPE (rope_factors_long/short
// tensors, which Model reads; attn_factor as the factor itself). Any other type is refused.
void read_gguf_rope_scaling(const GgufFile& g, const std::string& a, ModelConfig& c) {
  const auto type = g.find_string(a + "rope.scaling.type");
  const double mult = g.find_float(a + "rope.scaling.attn_factor").value_or(1.0);
  c.rope_orig_ctx = g.find_int(a + "rope.scaling.original_context_length").value_or(c.n_ctx_train);
  c.longrope = g.find_tensor("rope_factors_long.weight") != nullptr || (type && *type == "longrope");
  if (c.longrope) {
    check(g.find_tensor("rope_factors_long.weight") && g.find_tensor("rope_factors_short.weight"),
          "{}: LongRoPE needs both rope_factors_long and rope_factors_short", g.path());
    c.rope_attn_factor = float(mult);
  } else if (type && *type == "yarn") {
    c.yarn_factor = float(g.get_float(a + "rope.scaling.factor"));
    check(c.yarn_factor > 0, "{}: rope.scaling.factor must be positive", g.path());
    c.yarn_beta_fast = float(g.find_float(a + "rope.scaling.yarn_beta_fast").value_or(32.0));
    c.yarn_beta_slow = float(g.find_float(a + "rope.scaling.yarn_beta_slow").value_or(1.0));
    c.yarn_truncate = g.find_bool("serval.rope.yarn_truncate").value_or(true);
    c.rope_attn_factor = float(mult * (c.yarn_factor > 1 ? 1.0 + 0.1 * std::log(double(c.yarn_factor)) : 1.0));
  } else if (type && *type != "none") {
    check(*type == "linear", "{}: unsupported RoPE scaling '{}' (linear, yarn and longrope are supported)", g.path(), *type);
    c.rope_linear_scale = static_cast<float>(g.get_float(a + "rope.scaling.factor"));
  } else if (auto f = g.find_float(a + "rope.scaling.factor"); !type && f && *f > 0) {
    c.rope_linear_scale = static_cast<float>(*f);
  }
  check(std::isfinite(c.rope_attn_factor) && c.rope_attn_factor > 0 && c.yarn_beta_fast > 0 && c.yarn_beta_slow > 0 &&
            c.rope_orig_ctx > 0 && std::isfinite(c.rope_linear_scale) && c.rope_linear_scale > 0,
        "{}: RoPE scaling parameters out of range", g.path());
}
}  // namespace

namespace {
// deepseek2 as llama.cpp writes it: the MLA ranks; the query/key and value head sizes in key_length /
// value_length (or, in files of llama.cpp's later split-kv_b layout, key_length_mla / value_length_mla);
// the shared experts as a count of expert widths; the routed scale and groups. llama.cpp's YaRN for
// deepseek2: cos and sin keep attn_factor alone, the softmax scale is
// (attn_factor (1 + yarn_log_multiplier ln factor))^2 / sqrt(key_length).
void read_gguf_deepseek2(const GgufFile& g, const std::string& a, ModelConfig& c) {
  c.q_lora_rank = g.find_int(a + "attention.q_lora_rank").value_or(0);
  c.kv_lora_rank = g.get_int(a + "attention.kv_lora_rank");
  c.qk_rope_dim = g.get_int(a + "rope.dimension_count");
  const auto k_mla = g.find_int(a + "attention.key_length_mla"), v_mla = g.find_int(a + "attention.value_length_mla");
  const int64_t k_len = k_mla ? *k_mla : g.get_int(a + "attention.key_length");
  c.v_head_dim = v_mla ? *v_mla : g.get_int(a + "attention.value_length");
  c.qk_nope_dim = k_len - c.qk_rope_dim;
  if (auto f = g.find_int(a + "expert_gating_func"))
    check(*f == 1, "{}: expert gating function {} is not supported (softmax only: DeepSeek-V3's sigmoid is not)", g.path(), *f);
  c.n_ff_shexp = g.find_int(a + "expert_shared_count").value_or(0) * c.n_ff_exp;
  c.expert_weights_scale = float(g.find_float(a + "expert_weights_scale").value_or(1.0));
  c.expert_groups = g.find_int(a + "expert_group_count").value_or(0);
  c.expert_groups_used = g.find_int(a + "expert_group_used_count").value_or(0);
  const double mult = g.find_float(a + "rope.scaling.attn_factor").value_or(1.0);
  const double log_mul = g.find_float(a + "rope.scaling.yarn_log_multiplier").value_or(0.0);
  const double mscale = mult * (c.yarn_factor > 0 ? 1.0 + log_mul * std::log(double(c.yarn_factor)) : 1.0);
  c.rope_attn_factor = float(mult);
  c.attn_scale = float(mscale * mscale / std::sqrt(double(std::max<int64_t>(k_len, 1))));
  set_mla_shape(c);
}
}  // namespace

ModelConfig config_from_gguf(const GgufFile& g) {
  ModelConfig c;
  c.arch = g.get_string("general.architecture");
  static const std::set<std::string> supported = {"llama", "qwen2", "gemma2", "gemma3", "qwen3", "qwen3moe", "qwen2moe", "olmoe", "phi3", "gpt-oss", "deepseek2"};
  if (!supported.count(c.arch))
    fail("{}: unsupported architecture '{}' (supported: {})", g.path(), c.arch, fmt::join(supported, ", "));
  const std::string a = c.arch + ".";
  c.n_embd = g.get_int(a + "embedding_length");
  c.n_layer = g.get_int(a + "block_count");
  c.n_head = g.get_int(a + "attention.head_count");
  c.n_head_kv = g.find_int(a + "attention.head_count_kv").value_or(c.n_head);
  c.n_ff = g.get_int(a + "feed_forward_length");
  c.n_ctx_train = g.find_int(a + "context_length").value_or(2048);
  c.d_head = g.find_int(a + "attention.key_length").value_or(c.n_head > 0 ? c.n_embd / c.n_head : 0);
  if (auto vl = g.find_int(a + "attention.value_length"); vl && c.arch != "deepseek2")
    check(*vl == c.d_head, "{}: value_length {} differs from key_length {} (unsupported)", g.path(), *vl, c.d_head);
  c.norm_eps = static_cast<float>(g.find_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5));
  c.rope_base = static_cast<float>(g.find_float(a + "rope.freq_base").value_or(10000.0));
  c.rope_base_swa = c.rope_base;  // sliding-window layers share the base (Gemma 3 has its own: below)
  c.n_vocab = static_cast<int64_t>(g.get_array("tokenizer.ggml.tokens").size());
  read_gguf_rope_scaling(g, a, c);
  check(c.n_layer > 0 && c.n_layer <= kMaxLayers, "{}: block_count {} is out of range", g.path(), c.n_layer);
  c.layer_is_swa.assign(c.n_layer, 0);
  c.attn_scale = 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(c.d_head, 1)));
  if (c.arch == "qwen2" || c.arch == "qwen2moe") c.attn_bias = true;
  if (c.arch != "llama") c.rope_style = RopeStyle::Neox;  // llama.cpp's NEOX archs (no Q/K permutation)
  if (c.arch == "gemma3" || c.arch == "qwen3" || c.arch == "qwen3moe" || c.arch == "olmoe") c.qk_norm = true;
  c.qk_norm_whole = c.arch == "olmoe";
  if (auto n = g.find_int(a + "expert_count"); n && *n > 0) {  // Mixtral is llama with experts
    c.n_expert = *n;
    c.n_expert_used = g.get_int(a + "expert_used_count");
    c.n_ff_exp = g.find_int(a + "expert_feed_forward_length").value_or(c.n_ff);
    c.n_ff_shexp = g.find_int(a + "expert_shared_feed_forward_length").value_or(0);
    // llama.cpp renormalizes the chosen weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE and OLMoE.
    c.expert_weights_norm = g.find_bool(a + "expert_weights_norm").value_or(c.arch == "llama" || c.arch == "qwen3moe" || c.arch == "gpt-oss");
    // A layer is MoE where the file has its router (Qwen's mlp_only_layers stay dense).
    c.layer_is_moe.assign(c.n_layer, 0);
    for (int64_t il = 0; il < c.n_layer && il < kMaxLayers; ++il)
      c.layer_is_moe[il] = g.find_tensor(fmt::format("blk.{}.ffn_gate_inp.weight", il)) != nullptr;
  }
  if (c.arch == "gemma2" || c.arch == "gemma3") {
    c.ffn_act = FfnActivation::GeluTanh;
    c.post_norms = true;
    c.embd_scale = std::sqrt(static_cast<float>(c.n_embd));
    c.sliding_window = g.find_int(a + "attention.sliding_window").value_or(0);
    c.rope_base_swa = c.arch == "gemma2" ? c.rope_base : static_cast<float>(g.find_float(a + "rope.freq_base_swa").value_or(10000.0));
    // Gemma 3: five sliding-window layers, then one global layer; Gemma 2: alternating, from layer 0.
    const int64_t pattern = c.arch == "gemma3" ? 6 : 2;
    for (int64_t il = 0; il < c.n_layer; ++il) c.layer_is_swa[il] = c.sliding_window > 0 && il % pattern < pattern - 1;
  }
  if (c.arch == "gemma2") {
    c.attn_softcap = static_cast<float>(g.find_float(a + "attn_logit_softcapping").value_or(0.0));
    c.final_softcap = static_cast<float>(g.find_float(a + "final_logit_softcapping").value_or(0.0));
    // llama.cpp scales Gemma 2 27B's (46 layers) queries by 1/sqrt(n_embd / n_head) (its
    // query_pre_attn_scalar, which GGUF does not store); Serval's converter writes attention.scale.
    if (c.n_layer == 46) c.attn_scale = 1.0f / std::sqrt(float(c.n_embd / std::max<int64_t>(c.n_head, 1)));
  }
  if (auto scale = g.find_float(a + "attention.scale")) c.attn_scale = static_cast<float>(*scale);
  if (auto n_rot = g.find_int(a + "rope.dimension_count"); n_rot && *n_rot != c.d_head) c.n_rot = *n_rot;
  if (c.arch == "gpt-oss") {  // llama.cpp's gpt-oss: even layers in the window, OpenAI's SwiGLU constants
    set_gpt_oss(c);
    c.swiglu_limit = float(g.find_float("serval.swiglu_limit").value_or(7.0));
    c.swiglu_alpha = float(g.find_float("serval.swiglu_alpha").value_or(1.702));
    check(c.swiglu_limit > 0, "{}: serval.swiglu_limit must be positive", g.path());
    c.sliding_window = g.find_int(a + "attention.sliding_window").value_or(0);
    for (int64_t il = 0; il < c.n_layer; ++il) c.layer_is_swa[il] = c.sliding_window > 0 && il % 2 == 0;
  }
  if (c.arch == "phi3") {  // every layer in the window (Phi-3 mini 4K: 2047)
    c.sliding_window = g.find_int(a + "attention.sliding_window").value_or(0);
    for (int64_t il = 0; il < c.n_layer; ++il) c.layer_is_swa[il] = c.sliding_window > 0;
  }
  if (c.arch == "deepseek2") read_gguf_deepseek2(g, a, c);
  c.validate(g.path());
  return c;
}

namespace {
// An integer field: a JSON integer (a float such as 1e300 would not fit, 1.5 is not a count).
int64_t json_int(const nlohmann::json& j, const char* key, const std::string& path) {
  const auto& v = j.at(key);
  check(v.is_number_integer() && (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t(INT64_MAX)),
        "{}: '{}' must be an integer", path, key);
  return v.get<int64_t>();
}
int64_t json_int_or(const nlohmann::json& j, const char* key, int64_t fallback, const std::string& path) {
  return j.contains(key) && !j[key].is_null() ? json_int(j, key, path) : fallback;
}
}  // namespace

namespace {
double rope_number(const nlohmann::json& set, const char* key, double fallback, const std::string& path) {
  if (!set.contains(key) || set[key].is_null()) return fallback;
  check(set[key].is_number() && std::isfinite(set[key].get<double>()), "{}: RoPE '{}' must be a number", path, key);
  return set[key].get<double>();
}

std::vector<float> rope_factor_list(const nlohmann::json& set, const char* key, const std::string& path) {
  check(set.contains(key) && set[key].is_array() && !set[key].empty(), "{}: longrope needs a '{}' list", path, key);
  std::vector<float> v;
  for (const auto& x : set[key]) {
    check(x.is_number() && x.get<double>() > 0 && std::isfinite(x.get<double>()), "{}: '{}' entries must be positive numbers", path, key);
    v.push_back(x.get<float>());
  }
  return v;
}

// YaRN's cos/sin factor as transformers derives it: 0.1 m ln(s) + 1 (1 for s <= 1).
double yarn_mscale(double s, double m = 1.0) { return s <= 1 ? 1.0 : 0.1 * m * std::log(s) + 1.0; }

// The pair divisors of Llama 3.1's scaling (transformers' _compute_llama3_parameters as divisors).
std::vector<float> llama3_divisors(const nlohmann::json& set, double base, int64_t dim, const std::string& path) {
  const double factor = rope_number(set, "factor", 0, path), lo = rope_number(set, "low_freq_factor", 0, path),
               hi = rope_number(set, "high_freq_factor", 0, path), old = rope_number(set, "original_max_position_embeddings", 0, path);
  check(factor > 0 && lo > 0 && hi > lo && old > 0 && dim >= 2, "{}: llama3 RoPE needs factor, low_freq_factor < high_freq_factor and original_max_position_embeddings", path);
  std::vector<float> d(size_t(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double wavelen = 2 * M_PI * std::pow(base, 2.0 * double(i) / double(dim));
    if (wavelen < old / hi) d[size_t(i)] = 1.0f;
    else if (wavelen > old / lo) d[size_t(i)] = float(factor);
    else {
      const double smooth = (old / wavelen - lo) / (hi - lo);
      d[size_t(i)] = float(1.0 / ((1 - smooth) / factor + smooth));
    }
  }
  return d;
}

// What hf_rope needs of the config beyond a set: the rotary dimensions and the context lengths.
struct RopeShape {
  int64_t dim = 0, max_pos = 0, orig_top = 0;  // orig_top: a top-level original_max_position_embeddings
};

// The scaling of one set: yarn and longrope fill r; a sliding-window set (r == nullptr) allows only default.
void read_rope_scaling(const nlohmann::json& set, const std::string& type, const RopeShape& shape, double base,
                       const std::string& path, HfRope* r) {
  if (type == "default") return;
  check(r != nullptr, "{}: RoPE type '{}' is supported only for full-attention layers", path, type);
  r->type = type;
  if (type == "linear") {
    check(set.contains("factor") && set["factor"].is_number(), "{}: linear RoPE scaling needs a 'factor'", path);
    r->linear_factor = set["factor"].get<float>();
    return;
  }
  if (type == "llama3") {
    r->llama3_freqs = llama3_divisors(set, base, shape.dim, path);
    return;
  }
  // transformers: a top-level original_max_position_embeddings (Phi-3) wins over the set's.
  const double orig = shape.orig_top > 0 ? double(shape.orig_top)
                                         : rope_number(set, "original_max_position_embeddings", double(shape.max_pos), path);
  check(orig >= 1 && orig <= 1e9, "{}: original_max_position_embeddings {} is out of range", path, orig);
  r->orig_ctx = int64_t(orig);
  const double factor = rope_number(set, "factor", double(shape.max_pos) / orig, path);
  check(factor > 0, "{}: RoPE scaling factor must be positive", path);
  const double given = rope_number(set, "attention_factor", -1, path);
  if (type == "yarn") {
    r->yarn_factor = float(factor);
    r->beta_fast = float(rope_number(set, "beta_fast", 32, path));
    r->beta_slow = float(rope_number(set, "beta_slow", 1, path));
    check(r->beta_fast > 0 && r->beta_slow > 0, "{}: YaRN beta_fast and beta_slow must be positive", path);
    check(!set.contains("truncate") || set["truncate"].is_boolean(), "{}: YaRN 'truncate' must be a boolean", path);
    r->truncate = set.value("truncate", true);
    const double m = rope_number(set, "mscale", 0, path), m_all = rope_number(set, "mscale_all_dim", 0, path);
    r->attn_factor = float(given >= 0 ? given : m && m_all ? yarn_mscale(factor, m) / yarn_mscale(factor, m_all) : yarn_mscale(factor));
  } else if (type == "longrope" || type == "su") {
    r->type = "longrope";
    r->long_factor = rope_factor_list(set, "long_factor", path);
    r->short_factor = rope_factor_list(set, "short_factor", path);
    check(int64_t(r->long_factor.size()) == shape.dim / 2 && r->short_factor.size() == r->long_factor.size(),
          "{}: longrope factors must have {} entries (half the rotary dimensions)", path, shape.dim / 2);
    r->attn_factor = float(given >= 0 ? given : factor <= 1 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(orig)));
  } else {
    fail("{}: unsupported RoPE type '{}' (default, linear, llama3, yarn and longrope are supported)", path, type);
  }
  check(std::isfinite(r->attn_factor) && r->attn_factor > 0, "{}: RoPE attention factor must be positive", path);
}

// One rope_parameters / rope_scaling set: its base, and its scaling (r: the full-attention set's).
void read_rope_set(const nlohmann::json& set, const RopeShape& shape, const std::string& path, float& theta,
                   HfRope* r, bool& has_theta) {
  check(set.is_object(), "{}: a RoPE parameter set must be an object", path);
  const nlohmann::json& t = set.contains("rope_type") ? set["rope_type"] : set.contains("type") ? set["type"] : nlohmann::json("default");
  check(t.is_string(), "{}: RoPE type must be a string", path);
  if (set.contains("rope_theta")) {
    check(set["rope_theta"].is_number(), "{}: 'rope_theta' must be a number", path);
    theta = set["rope_theta"].get<float>();
    has_theta = true;
  }
  read_rope_scaling(set, t.get<std::string>(), shape, theta, path, r);
}

RopeShape rope_shape(const nlohmann::json& j) {
  RopeShape s;
  const int64_t heads = j.contains("num_attention_heads") && j["num_attention_heads"].is_number_integer() ? j["num_attention_heads"].get<int64_t>() : 0;
  const int64_t hidden = j.contains("hidden_size") && j["hidden_size"].is_number_integer() ? j["hidden_size"].get<int64_t>() : 0;
  int64_t d = j.contains("head_dim") && j["head_dim"].is_number_integer() ? j["head_dim"].get<int64_t>() : heads > 0 ? hidden / heads : 0;
  if (j.contains("partial_rotary_factor") && j["partial_rotary_factor"].is_number())
    d = int64_t(double(d) * j["partial_rotary_factor"].get<double>());
  s.dim = d;
  s.max_pos = j.contains("max_position_embeddings") && j["max_position_embeddings"].is_number_integer() ? j["max_position_embeddings"].get<int64_t>() : 2048;
  if (j.contains("original_max_position_embeddings") && j["original_max_position_embeddings"].is_number_integer())
    s.orig_top = j["original_max_position_embeddings"].get<int64_t>();
  return s;
}
}  // namespace

HfRope hf_rope(const nlohmann::json& j, const std::string& path) {
  HfRope r;
  const RopeShape shape = rope_shape(j);
  if (j.contains("rope_theta") && !j["rope_theta"].is_null()) {
    check(j["rope_theta"].is_number(), "{}: 'rope_theta' must be a number", path);
    r.theta = j["rope_theta"].get<float>();
    r.has_theta = true;
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) read_rope_set(j["rope_scaling"], shape, path, r.theta, &r, r.has_theta);
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const auto& rp = j["rope_parameters"];
    check(rp.is_object(), "{}: 'rope_parameters' must be an object", path);
    if (rp.contains("full_attention") || rp.contains("sliding_attention")) {
      for (const auto& [key, set] : rp.items())
        check(key == "full_attention" || key == "sliding_attention", "{}: unknown layer type '{}' in rope_parameters", path, key);
      check(rp.contains("full_attention"), "{}: rope_parameters has no full_attention set", path);
      read_rope_set(rp["full_attention"], shape, path, r.theta, &r, r.has_theta);
      check(r.has_theta, "{}: rope_parameters.full_attention has no rope_theta", path);
      r.theta_swa = r.theta;
      if (rp.contains("sliding_attention")) {
        bool swa_has = false;
        read_rope_set(rp["sliding_attention"], shape, path, r.theta_swa, nullptr, swa_has);
        check(swa_has, "{}: rope_parameters.sliding_attention has no rope_theta", path);
      }
    } else {  // one set for every layer
      read_rope_set(rp, shape, path, r.theta, &r, r.has_theta);
      check(r.has_theta, "{}: rope_parameters has no rope_theta", path);
      r.theta_swa = r.theta;
    }
  }
  if (!j.contains("rope_parameters")) r.theta_swa = r.theta;
  if (j.contains("rope_local_base_freq") && j["rope_local_base_freq"].is_number())  // transformers 4's Gemma 3
    r.theta_swa = j["rope_local_base_freq"].get<float>();
  check(std::isfinite(r.theta) && r.theta > 0 && std::isfinite(r.theta_swa) && r.theta_swa > 0 &&
            std::isfinite(r.linear_factor) && r.linear_factor > 0,
        "{}: RoPE base and scaling factor must be positive", path);
  return r;
}

namespace {
// gpt-oss's config.json: layer_types (else even layers sliding), the SwiGLU constants.
void read_hf_gpt_oss(const nlohmann::json& j, const std::string& path, ModelConfig& c) {
  set_gpt_oss(c);
  c.n_ff_exp = c.n_ff;
  c.attn_bias = c.attn_out_bias = j.value("attention_bias", true);
  c.swiglu_alpha = float(rope_number(j, "swiglu_alpha", 1.702, path));
  c.swiglu_limit = float(rope_number(j, "swiglu_limit", 7.0, path));
  check(c.swiglu_limit > 0, "{}: swiglu_limit must be positive", path);
  c.sliding_window = json_int_or(j, "sliding_window", 0, path);
  const auto& types = j.value("layer_types", nlohmann::json());
  for (int64_t il = 0; il < c.n_layer; ++il) {
    bool swa = il % 2 == 0;
    if (types.is_array()) {
      check(int64_t(types.size()) == c.n_layer, "{}: layer_types has {} entries for {} layers", path, types.size(), c.n_layer);
      const auto& t = types[size_t(il)];
      check(t == "sliding_attention" || t == "full_attention", "{}: unknown layer type {}", path, t.dump());
      swa = t == "sliding_attention";
    }
    c.layer_is_swa[il] = swa && c.sliding_window > 0;
  }
}

// YaRN and LongRoPE of config.json (the llama3 divisors become the rope_freqs the weights carry).
void apply_hf_rope_scaling(const HfRope& r, ModelConfig& c) {
  c.rope_orig_ctx = r.orig_ctx;
  c.rope_attn_factor = r.attn_factor;
  c.yarn_factor = r.yarn_factor;
  c.yarn_beta_fast = r.beta_fast;
  c.yarn_beta_slow = r.beta_slow;
  c.yarn_truncate = r.truncate;
  c.longrope = r.type == "longrope";
  c.rope_long_factors = r.long_factor;
  c.rope_short_factors = r.short_factor;
  c.rope_llama3_freqs = r.llama3_freqs;
}

// The experts of a Qwen2/Qwen3-MoE or OLMoE config.json (num_experts, or num_local_experts as
// transformers 5 spells it for Qwen3-MoE); every layer is MoE unless mlp_only_layers or
// decoder_sparse_step say otherwise.
void read_hf_moe(const nlohmann::json& j, const std::string& path, ModelConfig& c) {
  c.n_expert = json_int_or(j, "num_experts", json_int_or(j, "num_local_experts", 0, path), path);
  if (c.n_expert <= 0) return;
  check(c.n_layer > 0 && c.n_layer <= kMaxLayers, "{}: num_hidden_layers {} is out of range", path, c.n_layer);
  c.n_expert_used = json_int(j, "num_experts_per_tok", path);
  c.n_ff_exp = json_int_or(j, "moe_intermediate_size", c.n_ff, path);
  c.n_ff_shexp = json_int_or(j, "shared_expert_intermediate_size", 0, path);
  // Mixtral takes the softmax of the chosen logits: the same as renormalizing the chosen probabilities.
  c.expert_weights_norm = j.value("norm_topk_prob", j.value("model_type", "") == "mixtral");
  const int64_t step = json_int_or(j, "decoder_sparse_step", 1, path);
  check(step >= 1, "{}: decoder_sparse_step must be at least 1", path);
  std::set<int64_t> dense;
  for (const auto& v : j.value("mlp_only_layers", nlohmann::json::array())) dense.insert(v.get<int64_t>());
  c.layer_is_moe.assign(c.n_layer, 0);
  for (int64_t il = 0; il < c.n_layer; ++il) c.layer_is_moe[il] = !dense.count(il) && (il + 1) % step == 0;
}
}  // namespace

namespace {
// Gemma 2 / Gemma 3 (text) config.json: GeGLU, four norms per layer stored as w - 1, embeddings
// scaled by sqrt(hidden), queries by 1/sqrt(query_pre_attn_scalar), soft-capping (Gemma 2),
// sliding-window layers as layer_types lists them (else Gemma 2's even layers, Gemma 3's five of six).
void read_hf_gemma(const nlohmann::json& j, const std::string& path, ModelConfig& c) {
  c.ffn_act = FfnActivation::GeluTanh;
  c.post_norms = c.norm_plus_one = true;
  c.qk_norm = c.arch == "gemma3";
  c.embd_scale = std::sqrt(static_cast<float>(c.n_embd));
  if (j.contains("query_pre_attn_scalar") && j["query_pre_attn_scalar"].is_number())
    c.attn_scale = 1.0f / std::sqrt(j["query_pre_attn_scalar"].get<float>());
  auto number = [&](const char* key) {
    return j.contains(key) && j[key].is_number() ? j[key].get<float>() : 0.0f;
  };
  c.attn_softcap = number("attn_logit_softcapping");
  c.final_softcap = number("final_logit_softcapping");
  c.sliding_window = json_int_or(j, "sliding_window", 0, path);
  const auto& types = j.value("layer_types", nlohmann::json());
  if (types.is_array()) {
    check(int64_t(types.size()) == c.n_layer, "{}: layer_types has {} entries for {} layers", path, types.size(), c.n_layer);
    for (int64_t il = 0; il < c.n_layer; ++il) {
      const std::string t = types[size_t(il)].is_string() ? types[size_t(il)].get<std::string>() : "";
      check(t == "sliding_attention" || t == "full_attention", "{}: unknown layer type '{}'", path, t);
      c.layer_is_swa[il] = t == "sliding_attention" && c.sliding_window > 0;
    }
  } else {
    const int64_t pattern = c.arch == "gemma3" ? json_int_or(j, "sliding_window_pattern", 6, path) : 2;
    check(pattern >= 1, "{}: bad sliding_window_pattern", path);
    for (int64_t il = 0; il < c.n_layer; ++il) c.layer_is_swa[il] = c.sliding_window > 0 && il % pattern < pattern - 1;
  }
}
}  // namespace

namespace {
// DeepSeek-V2's config.json: the MLA ranks (q_lora_rank null: an uncompressed query), experts after
// the first first_k_dense_replace layers (every moe_layer_freq-th), the shared experts, the routed
// scale and the routing method; YaRN's mscale_all_dim also scales the softmax (transformers'
// yarn_apply_mscale). Only softmax scoring without a correction bias (V2, not V3) is supported.
void read_hf_deepseek2(const nlohmann::json& j, const std::string& path, ModelConfig& c) {
  check(!j.value("attention_bias", false), "{}: DeepSeek-V2 with attention biases is not supported", path);
  check(j.value("scoring_func", "softmax") == "softmax", "{}: expert scoring '{}' is not supported (softmax only)", path,
        j.value("scoring_func", ""));
  c.q_lora_rank = json_int_or(j, "q_lora_rank", 0, path);
  c.kv_lora_rank = json_int(j, "kv_lora_rank", path);
  c.qk_nope_dim = json_int(j, "qk_nope_head_dim", path);
  c.qk_rope_dim = json_int(j, "qk_rope_head_dim", path);
  c.v_head_dim = json_int(j, "v_head_dim", path);
  c.n_expert = json_int(j, "n_routed_experts", path);
  c.n_expert_used = json_int(j, "num_experts_per_tok", path);
  c.n_ff_exp = json_int(j, "moe_intermediate_size", path);
  c.n_ff_shexp = json_int_or(j, "n_shared_experts", 0, path) * c.n_ff_exp;
  c.expert_weights_norm = j.value("norm_topk_prob", false);
  c.expert_weights_scale = float(rope_number(j, "routed_scaling_factor", 1.0, path));
  const std::string method = j.value("topk_method", "greedy");
  check(method == "greedy" || method == "group_limited_greedy", "{}: topk_method '{}' is not supported (greedy, group_limited_greedy)", path, method);
  if (method == "group_limited_greedy") {
    c.expert_groups = json_int(j, "n_group", path);
    c.expert_groups_used = json_int(j, "topk_group", path);
  }
  const int64_t first_moe = json_int_or(j, "first_k_dense_replace", 0, path), freq = json_int_or(j, "moe_layer_freq", 1, path);
  check(first_moe >= 0 && freq >= 1, "{}: first_k_dense_replace and moe_layer_freq out of range", path);
  c.layer_is_moe.assign(size_t(c.n_layer), 0);
  for (int64_t il = 0; il < c.n_layer; ++il) c.layer_is_moe[size_t(il)] = c.n_expert > 0 && il >= first_moe && il % freq == 0;
  const auto& set = j.contains("rope_parameters") ? j["rope_parameters"] : j.value("rope_scaling", nlohmann::json());
  double mscale = 1.0;
  if (set.is_object() && set.value("rope_type", set.value("type", "default")) != "default") {
    const double m_all = rope_number(set, "mscale_all_dim", 0, path);
    if (m_all != 0) mscale = yarn_mscale(rope_number(set, "factor", 1.0, path), m_all);
  }
  c.attn_scale = float(mscale * mscale / std::sqrt(double(c.qk_nope_dim + c.qk_rope_dim)));
  set_mla_shape(c);
}
}  // namespace

ModelConfig config_from_hf(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text_file(path));
  } catch (const std::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
  ModelConfig c;
  try {
    const std::string type = j.value("model_type", "");
    static const std::map<std::string, std::string> archs = {{"llama", "llama"}, {"qwen2", "qwen2"}, {"qwen3", "qwen3"},
        {"qwen3_moe", "qwen3moe"}, {"qwen2_moe", "qwen2moe"}, {"olmoe", "olmoe"}, {"mixtral", "llama"},
        {"gemma2", "gemma2"}, {"gemma3_text", "gemma3"}, {"phi3", "phi3"}, {"gpt_oss", "gpt-oss"},
        {"deepseek_v2", "deepseek2"}};
    const auto arch = archs.find(type);
    check(arch != archs.end(), "{}: unsupported model_type '{}' (llama, mixtral, qwen2, qwen3, qwen3_moe, qwen2_moe, olmoe, gemma2, gemma3_text, phi3, gpt_oss, deepseek_v2)", path, type);
    c.arch = arch->second;
    c.n_embd = json_int(j, "hidden_size", path);
    c.n_layer = json_int(j, "num_hidden_layers", path);
    c.n_head = json_int(j, "num_attention_heads", path);
    c.n_head_kv = json_int_or(j, "num_key_value_heads", c.n_head, path);
    c.n_ff = json_int(j, "intermediate_size", path);
    c.n_vocab = json_int(j, "vocab_size", path);
    c.n_ctx_train = json_int_or(j, "max_position_embeddings", 2048, path);
    c.d_head = json_int_or(j, "head_dim", c.n_head > 0 ? c.n_embd / c.n_head : 0, path);
    c.norm_eps = j.value("rms_norm_eps", 1e-6f);
    read_hf_moe(j, path, c);
    c.attn_bias = c.arch == "qwen2" || (c.arch == "qwen2moe" && j.value("qkv_bias", true));
    c.qk_norm = c.arch == "qwen3" || c.arch == "qwen3moe" || c.arch == "olmoe";
    c.qk_norm_whole = c.arch == "olmoe";
    const HfRope rope = hf_rope(j, path);
    c.rope_base = rope.theta;
    c.rope_base_swa = rope.theta_swa;
    c.rope_linear_scale = rope.linear_factor;
    apply_hf_rope_scaling(rope, c);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: missing or mistyped field: {}", path, e.what());
  }
  // Hugging Face keeps Q/K in rotate-half order; GGUF conversion permutes them to interleaved pairs.
  c.rope_style = RopeStyle::Neox;
  check(c.n_layer > 0 && c.n_layer <= kMaxLayers, "{}: num_hidden_layers {} is out of range", path, c.n_layer);
  c.layer_is_swa.assign(c.n_layer, 0);
  c.attn_scale = 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(c.d_head, 1)));
  if (c.arch == "gemma2" || c.arch == "gemma3") read_hf_gemma(j, path, c);
  if (j.contains("partial_rotary_factor") && j["partial_rotary_factor"].is_number()) {
    const double f = j["partial_rotary_factor"].get<double>();
    check(f > 0 && f <= 1, "{}: partial_rotary_factor {} is not in (0, 1]", path, f);
    const int64_t n_rot = int64_t(double(c.d_head) * f);
    if (n_rot != c.d_head) c.n_rot = n_rot;
  }
  if (c.arch == "phi3") {
    c.sliding_window = json_int_or(j, "sliding_window", 0, path);
    for (int64_t il = 0; il < c.n_layer; ++il) c.layer_is_swa[il] = c.sliding_window > 0;
  }
  if (c.arch == "gpt-oss") read_hf_gpt_oss(j, path, c);
  if (c.arch == "deepseek2") {
    try {
      read_hf_deepseek2(j, path, c);
    } catch (const nlohmann::json::exception& e) {
      fail("{}: missing or mistyped field: {}", path, e.what());
    }
  }
  c.validate(path);
  return c;
}

}  // namespace serval
