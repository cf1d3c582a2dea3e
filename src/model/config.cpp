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
  }
}

ModelConfig config_from_gguf(const GgufFile& g) {
  ModelConfig c;
  c.arch = g.get_string("general.architecture");
  static const std::set<std::string> supported = {"llama", "qwen2", "gemma2", "gemma3", "qwen3", "qwen3moe", "qwen2moe", "olmoe", "phi3"};
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
  if (auto vl = g.find_int(a + "attention.value_length"))
    check(*vl == c.d_head, "{}: value_length {} differs from key_length {} (unsupported)", g.path(), *vl, c.d_head);
  c.norm_eps = static_cast<float>(g.find_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5));
  c.rope_base = static_cast<float>(g.find_float(a + "rope.freq_base").value_or(10000.0));
  c.n_vocab = static_cast<int64_t>(g.get_array("tokenizer.ggml.tokens").size());
  if (auto type = g.find_string(a + "rope.scaling.type"); type && *type != "none") {
    check(*type == "linear", "{}: unsupported RoPE scaling '{}' (linear is supported)", g.path(), *type);
    c.rope_linear_scale = static_cast<float>(g.get_float(a + "rope.scaling.factor"));
  } else if (auto f = g.find_float(a + "rope.scaling.factor"); f && *f > 0) {
    c.rope_linear_scale = static_cast<float>(*f);
  }
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
    c.expert_weights_norm = g.find_bool(a + "expert_weights_norm").value_or(c.arch == "llama" || c.arch == "qwen3moe");
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
  if (c.arch == "phi3") {  // every layer in the window (Phi-3 mini 4K: 2047)
    c.sliding_window = g.find_int(a + "attention.sliding_window").value_or(0);
    for (int64_t il = 0; il < c.n_layer; ++il) c.layer_is_swa[il] = c.sliding_window > 0;
    check(!g.find_tensor("rope_factors_long.weight") && !g.find_tensor("rope_factors_short.weight"),
          "{}: LongRoPE (rope_factors_long / rope_factors_short, Phi-3 128K, Phi-3.5, Phi-4-mini) is not supported",
          g.path());
  }
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
// One rope_parameters / rope_scaling set: its type must be default or linear.
void read_rope_set(const nlohmann::json& set, const std::string& path, float& theta, float* factor, bool& has_theta) {
  check(set.is_object(), "{}: a RoPE parameter set must be an object", path);
  const std::string type = set.value("rope_type", set.value("type", "default"));
  if (type == "linear") {
    check(factor && set.contains("factor") && set["factor"].is_number(), "{}: linear RoPE scaling needs a 'factor'", path);
    *factor = set["factor"].get<float>();
  } else {
    check(type == "default", "{}: unsupported RoPE type '{}' (default and linear are supported)", path, type);
  }
  if (set.contains("rope_theta")) {
    check(set["rope_theta"].is_number(), "{}: 'rope_theta' must be a number", path);
    theta = set["rope_theta"].get<float>();
    has_theta = true;
  }
}
}  // namespace

HfRope hf_rope(const nlohmann::json& j, const std::string& path) {
  HfRope r;
  if (j.contains("rope_theta") && !j["rope_theta"].is_null()) {
    check(j["rope_theta"].is_number(), "{}: 'rope_theta' must be a number", path);
    r.theta = j["rope_theta"].get<float>();
    r.has_theta = true;
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) read_rope_set(j["rope_scaling"], path, r.theta, &r.linear_factor, r.has_theta);
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const auto& rp = j["rope_parameters"];
    check(rp.is_object(), "{}: 'rope_parameters' must be an object", path);
    if (rp.contains("full_attention") || rp.contains("sliding_attention")) {
      for (const auto& [key, set] : rp.items())
        check(key == "full_attention" || key == "sliding_attention", "{}: unknown layer type '{}' in rope_parameters", path, key);
      check(rp.contains("full_attention"), "{}: rope_parameters has no full_attention set", path);
      read_rope_set(rp["full_attention"], path, r.theta, &r.linear_factor, r.has_theta);
      check(r.has_theta, "{}: rope_parameters.full_attention has no rope_theta", path);
      r.theta_swa = r.theta;
      if (rp.contains("sliding_attention")) {
        bool swa_has = false;
        read_rope_set(rp["sliding_attention"], path, r.theta_swa, nullptr, swa_has);
        check(swa_has, "{}: rope_parameters.sliding_attention has no rope_theta", path);
      }
    } else {
      read_rope_set(rp, path, r.theta, &r.linear_factor, r.has_theta);
      check(r.has_theta, "{}: rope_parameters has no rope_theta", path);
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
        {"gemma2", "gemma2"}, {"gemma3_text", "gemma3"}, {"phi3", "phi3"}};
    const auto arch = archs.find(type);
    check(arch != archs.end(), "{}: unsupported model_type '{}' (llama, mixtral, qwen2, qwen3, qwen3_moe, qwen2_moe, olmoe, gemma2, gemma3_text, phi3)", path, type);
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
  c.validate(path);
  return c;
}

}  // namespace serval
