#include "quant/convert.h"

#include <cmath>
#include <filesystem>
#include <fmt/ranges.h>

#include <map>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "base/error.h"
#include "base/file_util.h"
#include "io/gguf_writer.h"
#include "io/safetensors.h"
#include "io/tensor_names.h"
#include "model/config.h"
#include "model/gpt_oss.h"
#include "model/lora.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"
#include "tokenizer/load.h"

namespace serval {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr uint32_t kQuantizationVersion = 2;  // GGML_QNT_VERSION

json read_json(const fs::path& path) {
  check(fs::is_regular_file(path), "{}: no such file", path.string());
  try {
    return json::parse(read_text_file(path.string()));
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", path.string(), e.what());
  }
}

// The safetensors files of a checkpoint and its tensors by name (sorted, as llama.cpp lists them).
struct Checkpoint {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, const TensorRef*> tensors;

  void add_file(const fs::path& path) {
    files.push_back(std::make_unique<SafetensorsFile>(path.string()));
    for (const auto& t : files.back()->tensors())
      check(tensors.emplace(t.name, &t).second, "{}: tensor '{}' is in more than one shard", path.string(), t.name);
  }
};

// model.safetensors, or the shards that model.safetensors.index.json names (each must hold its tensors).
Checkpoint open_checkpoint(const fs::path& dir) {
  Checkpoint c;
  const fs::path index = dir / "model.safetensors.index.json";
  if (!fs::exists(index)) {
    check(fs::exists(dir / "model.safetensors"), "{}: no model.safetensors nor model.safetensors.index.json",
          dir.string());
    c.add_file(dir / "model.safetensors");
    return c;
  }
  const json j = read_json(index);
  check(j.contains("weight_map") && j["weight_map"].is_object(), "{}: no weight_map object", index.string());
  std::set<std::string> shards;
  for (const auto& [name, file] : j["weight_map"].items()) {
    check(file.is_string(), "{}: weight_map entry '{}' is not a file name", index.string(), name);
    const std::string f = file.get<std::string>();
    check(fs::path(f).filename().string() == f, "{}: shard '{}' is not a plain file name", index.string(), f);
    shards.insert(f);
  }
  for (const auto& f : shards) c.add_file(dir / f);
  for (const auto& [name, file] : j["weight_map"].items())
    check(c.tensors.count(name), "{}: tensor '{}' is not in {}", index.string(), name, file.get<std::string>());
  return c;
}

// config.json's architecture: LlamaForCausalLM -> llama, Qwen2ForCausalLM -> qwen2, Gemma3ForCausalLM -> gemma3.
std::string arch_of(const json& config, const std::string& path) {
  static const std::map<std::string, std::string> known = {
      {"LlamaForCausalLM", "llama"}, {"Qwen2ForCausalLM", "qwen2"}, {"Gemma3ForCausalLM", "gemma3"},
      {"Gemma2ForCausalLM", "gemma2"}, {"Phi3ForCausalLM", "phi3"}, {"Qwen3ForCausalLM", "qwen3"}, {"Qwen3MoeForCausalLM", "qwen3moe"}, {"Qwen2MoeForCausalLM", "qwen2moe"},
      {"OlmoeForCausalLM", "olmoe"}, {"MixtralForCausalLM", "llama"}, {"GptOssForCausalLM", "gpt-oss"},
      {"DeepseekV2ForCausalLM", "deepseek2"},
      {"BertModel", "bert"}, {"BertForSequenceClassification", "bert"}, {"BertForMaskedLM", "bert"}};
  const auto& a = config.value("architectures", json::array());
  check(a.is_array() && !a.empty() && a[0].is_string(), "{}: no 'architectures' list", path);
  const auto it = known.find(a[0].get<std::string>());
  check(it != known.end(),
        "{}: unsupported architecture '{}' (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
        "Qwen2MoeForCausalLM, OlmoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM, DeepseekV2ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, BertModel, BertForSequenceClassification)",
        path, a[0].get<std::string>());
  return it->second;
}

uint32_t file_type_of(DType outtype) {
  switch (outtype) {
    case DType::F32: return 0;   // ALL_F32
    case DType::F16: return 1;   // MOSTLY_F16
    case DType::Q8_0: return 7;  // MOSTLY_Q8_0
    case DType::BF16: return 32; // MOSTLY_BF16
    default: fail("internal: convert type {}", dtype_info(outtype).name);
  }
}

// A config.json integer that must be present, positive and within 32 bits.
uint32_t hp_u32(const json& c, const char* key, const std::string& path) {
  check(c.contains(key) && c[key].is_number_integer() && c[key].get<int64_t>() > 0 &&
            c[key].get<int64_t>() <= int64_t(UINT32_MAX),
        "{}: '{}' must be a positive integer", path, key);
  return c[key].get<uint32_t>();
}

bool has_number(const json& c, const char* key) { return c.contains(key) && c[key].is_number(); }

// The hyperparameters convert_hf_to_gguf.py's Model.set_gguf_parameters writes, where config.json has them.
void add_common_hparams(GgufWriter& w, const std::string& a, const json& c, const std::string& path) {
  w.add_u32(a + ".block_count", hp_u32(c, "num_hidden_layers", path));
  if (has_number(c, "max_position_embeddings")) w.add_u32(a + ".context_length", hp_u32(c, "max_position_embeddings", path));
  w.add_u32(a + ".embedding_length", hp_u32(c, "hidden_size", path));
  w.add_u32(a + ".feed_forward_length", hp_u32(c, "intermediate_size", path));
  w.add_u32(a + ".attention.head_count", hp_u32(c, "num_attention_heads", path));
  if (has_number(c, "num_key_value_heads"))
    w.add_u32(a + ".attention.head_count_kv", hp_u32(c, "num_key_value_heads", path));
  if (const HfRope rope = hf_rope(c, path); rope.has_theta) w.add_f32(a + ".rope.freq_base", rope.theta);
  if (has_number(c, "rms_norm_eps")) w.add_f32(a + ".attention.layer_norm_rms_epsilon", c["rms_norm_eps"].get<float>());
  if (has_number(c, "head_dim") && !c.contains("kv_lora_rank")) {  // DeepSeek-V2: add_deepseek2_hparams
    w.add_u32(a + ".attention.key_length", hp_u32(c, "head_dim", path));
    w.add_u32(a + ".attention.value_length", hp_u32(c, "head_dim", path));
  }
}

// YaRN's keys under `p` ("arch."): type, factor, original context, betas where not 32 / 1, and
// Serval's serval.rope.yarn_truncate = false where config.json says so.
void add_yarn_keys(GgufWriter& w, const std::string& p, const HfRope& rope) {
  w.add_string(p + "rope.scaling.type", "yarn");
  w.add_f32(p + "rope.scaling.factor", rope.yarn_factor);
  w.add_u32(p + "rope.scaling.original_context_length", uint32_t(rope.orig_ctx));
  if (rope.beta_fast != 32.0f) w.add_f32(p + "rope.scaling.yarn_beta_fast", rope.beta_fast);
  if (rope.beta_slow != 1.0f) w.add_f32(p + "rope.scaling.yarn_beta_slow", rope.beta_slow);
  if (!rope.truncate) w.add_value("serval.rope.yarn_truncate", {GgufValueType::BOOL, false});
}

// RoPE scaling keys as llama.cpp's converter writes them: linear (type, factor); yarn (type, factor,
// original context, betas where not 32/1, attn_factor where transformers' factor is not llama.cpp's
// 0.1 ln s + 1, and Serval's own serval.rope.yarn_truncate = false where config.json says so);
// longrope (original context, attn_factor; the factors are tensors: add_rope_tensors). llama3 needs
// no key (its rope_freqs tensor). hf_rope refuses any other type, so nothing is dropped silently.
void add_rope_scaling(GgufWriter& w, const std::string& a, const json& c, const std::string& path) {
  const HfRope rope = hf_rope(c, path);
  if (rope.linear_factor != 1.0f) {
    w.add_string(a + ".rope.scaling.type", "linear");
    w.add_f32(a + ".rope.scaling.factor", rope.linear_factor);
  }
  if (rope.type == "yarn") {
    add_yarn_keys(w, a + ".", rope);
    const double llama_cpp = rope.yarn_factor > 1 ? 1.0 + 0.1 * std::log(double(rope.yarn_factor)) : 1.0;
    if (std::abs(rope.attn_factor / llama_cpp - 1.0) > 1e-7) w.add_f32(a + ".rope.scaling.attn_factor", float(rope.attn_factor / llama_cpp));
  } else if (rope.type == "longrope") {
    w.add_u32(a + ".rope.scaling.original_context_length", uint32_t(rope.orig_ctx));
    w.add_f32(a + ".rope.scaling.attn_factor", rope.attn_factor);
  }
}

// The RoPE factor tensors: rope_freqs (llama3 scaling, as LlamaModel writes it) or LongRoPE's
// rope_factors_long / rope_factors_short (Phi3MiniModel), always F32.
void add_rope_tensors(GgufWriter& w, const json& c, const std::string& path) {
  const HfRope rope = hf_rope(c, path);
  auto add = [&](const char* name, const std::vector<float>& v) {
    w.add_tensor(name, {uint64_t(v.size())}, uint32_t(DType::F32), reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float));
  };
  if (!rope.llama3_freqs.empty()) add("rope_freqs.weight", rope.llama3_freqs);
  if (rope.type == "longrope") {
    add("rope_factors_long.weight", rope.long_factor);
    add("rope_factors_short.weight", rope.short_factor);
  }
}

GgufValue int_array(GgufValueType type, std::vector<int64_t> v);

// GGUF's pooling_type of a BERT directory: rank for a classifier, else its sentence-transformers pooling.
uint32_t bert_pooling(const fs::path& dir, const json& c) {
  const auto& a = c.value("architectures", json::array());
  if (a.is_array() && !a.empty() && a[0] == "BertForSequenceClassification") return 4;  // rank
  const fs::path p = dir / "1_Pooling" / "config.json";
  if (!fs::exists(p)) return 1;  // mean
  const json j = read_json(p);
  if (j.value("pooling_mode_cls_token", false)) return 2;
  if (j.value("pooling_mode_lasttoken", false)) return 3;
  return 1;
}

// BertModel's keys, and Serval's own: the tokenizer's normalization and Matryoshka dimensions.
void add_bert_hparams(GgufWriter& w, const json& c, DType outtype, const fs::path& dir, const std::string& path) {
  w.add_u32("bert.context_length", hp_u32(c, "max_position_embeddings", path));
  w.add_u32("bert.embedding_length", hp_u32(c, "hidden_size", path));
  w.add_u32("bert.feed_forward_length", hp_u32(c, "intermediate_size", path));
  w.add_u32("bert.block_count", hp_u32(c, "num_hidden_layers", path));
  w.add_u32("bert.attention.head_count", hp_u32(c, "num_attention_heads", path));
  w.add_f32("bert.attention.layer_norm_epsilon", c.value("layer_norm_eps", 1e-12f));
  w.add_value("bert.attention.causal", {GgufValueType::BOOL, false});
  w.add_u32("bert.pooling_type", bert_pooling(dir, c));
  w.add_u32("general.file_type", file_type_of(outtype));
  if (c.contains("matryoshka_dimensions") && c["matryoshka_dimensions"].is_array())
    w.add_value("serval.matryoshka_dimensions",
                int_array(GgufValueType::INT32, c["matryoshka_dimensions"].get<std::vector<int64_t>>()));
}

// The experts' keys of Qwen2/Qwen3-MoE and OLMoE (Qwen2MoeModel / OlmoeModel), and whether the chosen
// experts' weights are renormalized (norm_topk_prob; llama.cpp's key, which its Qwen3-MoE ignores).
void add_moe_hparams(GgufWriter& w, const std::string& a, const json& c, const std::string& path) {
  const char* count = c.contains("num_experts") ? "num_experts" : "num_local_experts";
  if (!c.contains(count)) return;
  w.add_u32(a + ".expert_count", hp_u32(c, count, path));
  w.add_u32(a + ".expert_used_count", hp_u32(c, "num_experts_per_tok", path));
  if (has_number(c, "moe_intermediate_size"))
    w.add_u32(a + ".expert_feed_forward_length", hp_u32(c, "moe_intermediate_size", path));
  if (has_number(c, "shared_expert_intermediate_size") && c["shared_expert_intermediate_size"].get<int64_t>() > 0)
    w.add_u32(a + ".expert_shared_feed_forward_length", hp_u32(c, "shared_expert_intermediate_size", path));
  // Mixtral (written as llama) takes the softmax of the chosen logits: renormalized.
  w.add_value(a + ".expert_weights_norm", {GgufValueType::BOOL, c.value("norm_topk_prob", a == "llama" || a == "gpt-oss")});
}

// GGUF has no per-layer list of sliding-window layers: Gemma 2's alternate from layer 0 and Gemma 3's
// are five of every six. A config.json whose layer_types say otherwise is refused.
void check_gemma_layer_types(const json& c, int pattern, const std::string& path) {
  if (!c.contains("layer_types") || !c["layer_types"].is_array()) return;
  const auto& types = c["layer_types"];
  for (size_t il = 0; il < types.size(); ++il) {
    const bool swa = int(il % size_t(pattern)) < pattern - 1;
    check(types[il] == (swa ? "sliding_attention" : "full_attention"),
          "{}: layer {} is '{}', but GGUF's layout makes it {} (a sliding-window layer pattern of {})", path, il,
          types[il].dump(), swa ? "sliding_attention" : "full_attention", pattern);
  }
}

// Gemma2Model's keys beyond the common ones, and attention.scale where query_pre_attn_scalar is not
// the head size (llama.cpp infers it from the model size instead; Serval reads the key).
void add_gemma2_hparams(GgufWriter& w, const json& c, const std::string& path) {
  check_gemma_layer_types(c, 2, path);
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping"})
    if (has_number(c, key)) w.add_f32(std::string("gemma2.") + key, c[key].get<float>());
  if (has_number(c, "sliding_window")) w.add_u32("gemma2.attention.sliding_window", hp_u32(c, "sliding_window", path));
  const uint32_t d = hp_u32(c, "head_dim", path);
  if (has_number(c, "query_pre_attn_scalar") && c["query_pre_attn_scalar"].get<double>() != double(d)) {
    check(c["query_pre_attn_scalar"].get<double>() > 0, "{}: query_pre_attn_scalar must be positive", path);
    w.add_f32("gemma2.attention.scale", float(1.0 / std::sqrt(c["query_pre_attn_scalar"].get<double>())));
  }
  add_rope_scaling(w, "gemma2", c, path);
}

// GptOssModel's keys beyond the common ones: the experts' width (intermediate_size), the window, the
// YaRN set; Serval's own keys for SwiGLU constants other than OpenAI's 1.702 and 7 (llama.cpp fixes them).
void add_gpt_oss_hparams(GgufWriter& w, const json& c, const std::string& path) {
  w.add_u32("gpt-oss.expert_feed_forward_length", hp_u32(c, "intermediate_size", path));
  if (has_number(c, "sliding_window")) w.add_u32("gpt-oss.attention.sliding_window", hp_u32(c, "sliding_window", path));
  if (c.contains("layer_types") && c["layer_types"].is_array())
    for (size_t il = 0; il < c["layer_types"].size(); ++il)
      check(c["layer_types"][il] == (il % 2 == 0 ? "sliding_attention" : "full_attention"),
            "{}: layer {} is {}, but GGUF's gpt-oss alternates sliding and full layers from layer 0", path, il, c["layer_types"][il].dump());
  if (has_number(c, "swiglu_limit") && c["swiglu_limit"].get<double>() != 7.0) w.add_f32("serval.swiglu_limit", c["swiglu_limit"].get<float>());
  if (has_number(c, "swiglu_alpha") && std::abs(c["swiglu_alpha"].get<double>() - 1.702) > 1e-9)
    w.add_f32("serval.swiglu_alpha", c["swiglu_alpha"].get<float>());
  add_rope_scaling(w, "gpt-oss", c, path);
}

// DeepseekV2Model's keys (llama.cpp before its 2025 split of attn_kv_b): the ranks, the query/key and
// value head sizes as key_length / value_length, the rotary dimensions, the experts (dense leading
// layers, shared experts as a count of expert widths, the routed scale, groups where routing is
// group-limited) and YaRN's log multiplier 0.1 mscale_all_dim. What GGUF cannot say is refused:
// mscale other than mscale_all_dim (llama.cpp's deepseek2 assumes the cos/sin factor 1).
void add_deepseek2_hparams(GgufWriter& w, const json& c, const std::string& path) {
  const std::string a = "deepseek2.";
  if (c.contains("q_lora_rank") && !c["q_lora_rank"].is_null()) w.add_u32(a + "attention.q_lora_rank", hp_u32(c, "q_lora_rank", path));
  w.add_u32(a + "attention.kv_lora_rank", hp_u32(c, "kv_lora_rank", path));
  w.add_u32(a + "attention.key_length", hp_u32(c, "qk_nope_head_dim", path) + hp_u32(c, "qk_rope_head_dim", path));
  w.add_u32(a + "attention.value_length", hp_u32(c, "v_head_dim", path));
  w.add_u32(a + "rope.dimension_count", hp_u32(c, "qk_rope_head_dim", path));
  w.add_u32(a + "leading_dense_block_count", uint32_t(c.value("first_k_dense_replace", 0)));
  w.add_u32(a + "expert_count", hp_u32(c, "n_routed_experts", path));
  w.add_u32(a + "expert_used_count", hp_u32(c, "num_experts_per_tok", path));
  w.add_u32(a + "expert_feed_forward_length", hp_u32(c, "moe_intermediate_size", path));
  w.add_u32(a + "expert_shared_count", uint32_t(c.value("n_shared_experts", 0)));
  w.add_f32(a + "expert_weights_scale", c.value("routed_scaling_factor", 1.0f));
  w.add_value(a + "expert_weights_norm", {GgufValueType::BOOL, c.value("norm_topk_prob", false)});
  w.add_u32(a + "expert_gating_func", 1);  // softmax
  if (c.value("topk_method", "greedy") == "group_limited_greedy") {
    w.add_u32(a + "expert_group_count", hp_u32(c, "n_group", path));
    w.add_u32(a + "expert_group_used_count", hp_u32(c, "topk_group", path));
  }
  const HfRope rope = hf_rope(c, path);
  check(std::abs(rope.attn_factor - 1.0f) < 1e-6f, "{}: YaRN mscale differs from mscale_all_dim: GGUF's deepseek2 cannot express it", path);
  if (rope.type == "yarn") {
    add_yarn_keys(w, a, rope);
    const auto& set = c.contains("rope_parameters") ? c["rope_parameters"] : c["rope_scaling"];
    w.add_f32(a + "rope.scaling.yarn_log_multiplier", 0.1f * set.value("mscale_all_dim", 0.0f));
  } else {
    check(rope.type == "default", "{}: RoPE type '{}' is not supported for deepseek2 in GGUF", path, rope.type);
  }
}

// Architecture-specific keys after the common ones (LlamaModel / Qwen2Model / Gemma3Model).
void add_hparams(GgufWriter& w, const std::string& arch, const json& c, DType outtype, const std::string& path) {
  if (arch == "bert") return;  // add_bert_hparams
  if (arch != "gemma3") {
    add_common_hparams(w, arch, c, path);
    w.add_u32("general.file_type", file_type_of(outtype));
    add_moe_hparams(w, arch, c, path);
  }
  if (arch == "qwen2" || arch == "qwen3" || arch == "qwen3moe" || arch == "qwen2moe" || arch == "olmoe") {
    add_rope_scaling(w, arch, c, path);
  } else if (arch == "phi3") {
    // Phi3MiniModel: the rotary dimensions (partial_rotary_factor) and the window of every layer.
    const uint32_t n_head = hp_u32(c, "num_attention_heads", path), d = hp_u32(c, "hidden_size", path) / n_head;
    const double f = has_number(c, "partial_rotary_factor") ? c["partial_rotary_factor"].get<double>() : 1.0;
    check(f > 0 && f <= 1, "{}: partial_rotary_factor must be in (0, 1]", path);
    w.add_u32("phi3.rope.dimension_count", uint32_t(double(d) * f));
    if (has_number(c, "sliding_window")) w.add_u32("phi3.attention.sliding_window", hp_u32(c, "sliding_window", path));
    add_rope_scaling(w, arch, c, path);
  } else if (arch == "llama") {
    w.add_u32("llama.vocab_size", hp_u32(c, "vocab_size", path));
    const uint32_t n_head = hp_u32(c, "num_attention_heads", path);
    w.add_u32("llama.rope.dimension_count",
              has_number(c, "head_dim") ? hp_u32(c, "head_dim", path) : hp_u32(c, "hidden_size", path) / n_head);
    add_rope_scaling(w, arch, c, path);
  } else if (arch == "gemma3") {
    // Gemma3Model writes its own set, with the defaults of transformers' Gemma3TextConfig.
    check_gemma_layer_types(c, 6, path);
    w.add_u32("gemma3.context_length", c.value("max_position_embeddings", 131072u));
    w.add_u32("gemma3.embedding_length", hp_u32(c, "hidden_size", path));
    w.add_u32("gemma3.block_count", hp_u32(c, "num_hidden_layers", path));
    w.add_u32("gemma3.feed_forward_length", hp_u32(c, "intermediate_size", path));
    w.add_u32("gemma3.attention.head_count", hp_u32(c, "num_attention_heads", path));
    w.add_f32("gemma3.attention.layer_norm_rms_epsilon", c.value("rms_norm_eps", 1e-6f));
    w.add_u32("gemma3.attention.key_length", c.value("head_dim", 256u));
    w.add_u32("gemma3.attention.value_length", c.value("head_dim", 256u));
    w.add_u32("general.file_type", file_type_of(outtype));
    const HfRope rope = hf_rope(c, path);
    w.add_f32("gemma3.rope.freq_base", rope.has_theta ? rope.theta : 1000000.0f);
    w.add_u32("gemma3.attention.sliding_window", hp_u32(c, "sliding_window", path));
    w.add_u32("gemma3.attention.head_count_kv", c.value("num_key_value_heads", 4u));
    add_rope_scaling(w, arch, c, path);
  } else if (arch == "gemma2") {
    add_gemma2_hparams(w, c, path);
  } else if (arch == "gpt-oss") {
    add_gpt_oss_hparams(w, c, path);
  } else if (arch == "deepseek2") {
    add_deepseek2_hparams(w, c, path);
  }
}


// GGUF token types (llama_token_type).
enum TokenType : int64_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

GgufValue string_array(std::vector<std::string> v) {
  GgufArray a{GgufValueType::STRING, {}, {}, std::move(v)};
  return {GgufValueType::ARRAY, std::move(a)};
}

GgufValue int_array(GgufValueType type, std::vector<int64_t> v) {
  GgufArray a{type, std::move(v), {}, {}};
  return {GgufValueType::ARRAY, std::move(a)};
}

bool looks_special(const std::string& t) {
  const auto wrapped = [&](std::string_view open, std::string_view close) {
    return t.size() >= open.size() + close.size() && t.starts_with(open) && t.ends_with(close);
  };
  return t == "<pad>" || t == "<mask>" || t == "<2mass>" || t == "[@BOS@]" || wrapped("<|", "|>") ||
         wrapped("<\uff5c", "\uff5c>") || wrapped("<unused", ">");
}

// tokenizer.ggml.pre for a byte-level BPE tokenizer. llama.cpp names it by the SHA-256 of the ids that
// the Hugging Face tokenizer gives a fixed check text; tokenizers with the same pre-tokenizer split
// regexes give the same hash, so the regexes of tokenizer.json (Vocab::pre_regex) name it here.
std::string bpe_pre_name(const Vocab& v, const std::string& path) {
  const std::string name = pre_tokenizer_name_of(v.pre_regex);
  check(!name.empty(), "{}: GGUF has no tokenizer.ggml.pre name for this pre-tokenizer's regexes (known: Qwen2, Llama 3, "
        "GPT-2, StarCoder, DeepSeek Coder)", path);
  return name;
}

// Whether tokenizer.json is a SentencePiece-style BPE (byte fallback): llama.cpp's LlamaHfVocab.
bool is_llama_hf_vocab(const json& tok) {
  const auto& m = tok.at("model");
  return m.value("type", "") == "BPE" && m.value("byte_fallback", false) && tok.contains("decoder") &&
         tok["decoder"].is_object() && tok["decoder"].value("type", "") == "Sequence";
}

// The ids of the special-token strings in `config_tokenizer` (tokenizer_config.json), as gguf-py's
// SpecialVocab reads them.
std::set<int64_t> special_ids(const json& tc, const Vocab& v) {
  std::set<int64_t> ids;
  for (const auto& [key, entry] : tc.items()) {
    if (!key.ends_with("_token") || key.starts_with("add_")) continue;
    const std::string text = entry.is_string() ? entry.get<std::string>() : entry.is_object() ? entry.value("content", "") : "";
    for (size_t i = 0; i < v.tokens.size() && !text.empty(); ++i)
      if (v.tokens[i] == text) ids.insert(int64_t(i));
  }
  return ids;
}

// Token types: LlamaHfVocab (byte pieces, control for the special tokens) or get_vocab_base (added tokens
// control or user-defined, gaps unused).
std::vector<int64_t> token_types(const Vocab& v, const json& tok, const json& tc, bool llama_hf) {
  std::map<int64_t, bool> added;  // id -> special
  for (const auto& t : tok.value("added_tokens", json::array())) added[t.at("id").get<int64_t>()] = t.value("special", false);
  const auto specials = special_ids(tc, v);
  std::vector<int64_t> types(v.tokens.size(), kNormal);
  for (size_t i = 0; i < types.size(); ++i) {
    const auto a = added.find(int64_t(i));
    if (llama_hf) {
      if (v.attrs[i] == TokenAttr::Byte) types[i] = kByte;
      else if (specials.count(int64_t(i))) types[i] = kControl;
      else if (a != added.end()) types[i] = kUserDefined;
    } else if (v.attrs[i] == TokenAttr::Unused) {
      types[i] = kUnused;
    } else if (a != added.end()) {
      types[i] = a->second || looks_special(v.tokens[i]) ? kControl : kUserDefined;
    }
  }
  return types;
}

std::vector<std::string> ordered_merges(const Vocab& v) {
  std::vector<std::string> merges(v.merge_ranks.size());
  for (const auto& [m, rank] : v.merge_ranks) merges.at(rank) = m;
  return merges;
}

// Special token ids, add_bos/add_eos and the chat template, as SpecialVocab.add_to_gguf writes them:
// tokenizer_config.json's token strings (looked up among the added tokens) first, then config.json's ids.
void add_special_tokens(GgufWriter& w, const json& tok, const json& tc, const json& config, size_t n_vocab) {
  static const std::vector<std::pair<std::string, std::string>> kinds = {
      {"bos", "bos_token_id"}, {"eos", "eos_token_id"}, {"unk", "unknown_token_id"}, {"sep", "seperator_token_id"},
      {"pad", "padding_token_id"}, {"mask", "mask_token_id"}};  // gguf-py has no key for cls
  for (const auto& [kind, key] : kinds) {
    std::optional<int64_t> id;
    const json entry = tc.value(kind + "_token", json());
    const std::string text = entry.is_string() ? entry.get<std::string>() : entry.is_object() ? entry.value("content", "") : "";
    for (const auto& t : tok.value("added_tokens", json::array()))
      if (!id && !text.empty() && t.value("content", "") == text) id = t.at("id").get<int64_t>();
    if (!id && config.contains(kind + "_token_id") && config[kind + "_token_id"].is_number_integer())
      id = config[kind + "_token_id"].get<int64_t>();
    if (id && *id >= 0 && *id < int64_t(n_vocab)) w.add_u32("tokenizer.ggml." + key, uint32_t(*id));
  }
  for (const char* kind : {"bos", "eos"})
    if (tc.contains(fmt::format("add_{}_token", kind)) && tc[fmt::format("add_{}_token", kind)].is_boolean())
      w.add_value(fmt::format("tokenizer.ggml.add_{}_token", kind),
                  {GgufValueType::BOOL, tc[fmt::format("add_{}_token", kind)].get<bool>()});
  if (tc.contains("chat_template") && tc["chat_template"].is_string())
    w.add_string("tokenizer.chat_template", tc["chat_template"].get<std::string>());
}

// A WordPiece vocabulary as llama.cpp's BertModel writes it (phantom-space spelling, wordpiece.h),
// with [CLS] as bos and [SEP] as separator, and Serval's keys for a cased tokenizer.
void add_wordpiece_tokenizer(GgufWriter& w, const Vocab& v, size_t type_count) {
  w.add_string("tokenizer.ggml.model", "bert");
  w.add_string("tokenizer.ggml.pre", "default");
  w.add_value("tokenizer.ggml.tokens", string_array(v.tokens));
  std::vector<int64_t> types(v.tokens.size(), kNormal);
  for (size_t i = 0; i < types.size(); ++i)
    if (v.attrs[i] == TokenAttr::Control) types[i] = kControl;
    else if (v.attrs[i] == TokenAttr::UserDefined) types[i] = kUserDefined;
  w.add_value("tokenizer.ggml.token_type", int_array(GgufValueType::INT32, types));
  w.add_u32("tokenizer.ggml.token_type_count", uint32_t(type_count));
  const std::pair<const char*, int32_t> ids[] = {{"bos_token_id", v.bos}, {"seperator_token_id", v.eos},
                                                 {"unknown_token_id", v.unk}, {"padding_token_id", v.pad}};
  for (const auto& [key, id] : ids)
    if (id >= 0) w.add_u32(std::string("tokenizer.ggml.") + key, uint32_t(id));
  for (size_t i = 0; i < v.tokens.size(); ++i)
    if (v.tokens[i] == "[MASK]") w.add_u32("tokenizer.ggml.mask_token_id", uint32_t(i));
  w.add_value("tokenizer.ggml.add_bos_token", {GgufValueType::BOOL, true});
  w.add_value("tokenizer.ggml.add_sep_token", {GgufValueType::BOOL, true});
  w.add_value("serval.tokenizer.lowercase", {GgufValueType::BOOL, v.wordpiece.lowercase});
  w.add_value("serval.tokenizer.strip_accents", {GgufValueType::BOOL, v.wordpiece.strip_accents});
}

// The tokenizer.ggml.* keys from tokenizer.json and tokenizer_config.json.
void add_tokenizer(GgufWriter& w, const std::string& arch, const fs::path& dir, const json& config) {
  const fs::path tok_path = dir / "tokenizer.json";
  if (arch == "bert") {
    const Vocab v = vocab_from_tokenizer_json(tok_path.string());
    check(v.kind == TokenizerKind::WordPiece, "{}: a BERT model needs a WordPiece tokenizer", tok_path.string());
    return add_wordpiece_tokenizer(w, v, config.value("type_vocab_size", 2u));
  }
  const json tok = read_json(tok_path);
  const json tc = fs::exists(dir / "tokenizer_config.json") ? read_json(dir / "tokenizer_config.json") : json::object();
  Vocab v = vocab_from_tokenizer_json(tok_path.string());
  bool llama_hf = false;
  try {
    llama_hf = is_llama_hf_vocab(tok);
  } catch (const json::exception& e) {
    fail("{}: unexpected structure: {}", tok_path.string(), e.what());
  }
  if (!llama_hf && config.contains("vocab_size") && config["vocab_size"].is_number_unsigned() &&
      config["vocab_size"].get<uint64_t>() > v.tokens.size()) {
    const size_t n = v.tokens.size();
    v.tokens.resize(config["vocab_size"].get<uint64_t>());
    v.attrs.resize(v.tokens.size(), TokenAttr::Unused);
    for (size_t i = n; i < v.tokens.size(); ++i) v.tokens[i] = fmt::format("[PAD{}]", i);
  }
  for (size_t i = 0; i < v.tokens.size(); ++i)
    if (v.attrs[i] == TokenAttr::Unused && v.tokens[i].empty()) v.tokens[i] = fmt::format("[PAD{}]", i);
  w.add_string("tokenizer.ggml.model", llama_hf ? "llama" : "gpt2");
  w.add_string("tokenizer.ggml.pre", llama_hf ? "default" : bpe_pre_name(v, tok_path.string()));
  w.add_value("tokenizer.ggml.tokens", string_array(v.tokens));
  if (llama_hf) {
    GgufArray scores{GgufValueType::FLOAT32, {}, std::vector<double>(v.tokens.size(), -1000.0), {}};
    w.add_value("tokenizer.ggml.scores", {GgufValueType::ARRAY, std::move(scores)});
  }
  w.add_value("tokenizer.ggml.token_type", int_array(GgufValueType::INT32, token_types(v, tok, tc, llama_hf)));
  if (!llama_hf) w.add_value("tokenizer.ggml.merges", string_array(ordered_merges(v)));
  add_special_tokens(w, tok, tc, config, v.tokens.size());
  if (arch == "llama" && tc.contains("add_prefix_space") && tc["add_prefix_space"].is_boolean())  // LlamaModel only
    w.add_value("tokenizer.ggml.add_space_prefix", {GgufValueType::BOOL, tc["add_prefix_space"].get<bool>()});
}

// A tensor's elements as floats (F32, F16 or BF16 in the checkpoint).
std::vector<float> to_floats(const TensorRef& t) {
  std::vector<float> x(t.n_elements());
  dequantize_row(t.type, t.data, x.data(), x.size());
  return x;
}

struct ArchInfo {
  std::string arch;
  int64_t n_expert = 0;
  uint64_t n_head = 0, n_head_kv = 0;
  bool tied = false;
};

// The float values llama.cpp's modify_tensors gives the tensor: Q/K permuted for RoPE (llama), norms
// plus one (gemma3: Hugging Face stores Gemma's RMSNorm weights as w - 1).
std::vector<float> modified_values(const ArchInfo& a, const std::string& gguf_name, const TensorRef& t) {
  std::vector<float> x = to_floats(t);
  if (a.arch == "llama") {
    const bool q = gguf_name.find(".attn_q.") != std::string::npos, k = gguf_name.find(".attn_k.") != std::string::npos;
    if (q || k) x = permute_rope_rows(x.data(), t.ne.size() > 1 ? t.ne[1] : t.ne[0], t.ne.size() > 1 ? t.ne[0] : 1,
                                      q ? a.n_head : a.n_head_kv);
  }
  if ((a.arch == "gemma3" || a.arch == "gemma2") && gguf_name.ends_with("norm.weight"))
    for (float& v : x) v += 1.0f;
  return x;
}

// A GGUF tensor and the checkpoint tensors it is made of: one, or the experts of a layer stacked
// along a third dimension (expert e at index e), as llama.cpp's converter merges them.
struct Mapped {
  std::string name;
  std::vector<const TensorRef*> parts;
  std::vector<uint64_t> ne;
};

void add_tensor(GgufWriter& w, const ArchInfo& a, const Mapped& m, DType type) {
  if (m.parts.size() == 1 && m.parts[0]->type == DType::MXFP4) {  // gpt-oss's MXFP4 experts stay as they are
    w.add_tensor(m.name, m.ne, uint32_t(DType::MXFP4), m.parts[0]->data, m.parts[0]->nbytes);
    return;
  }
  std::vector<float> x;
  for (const TensorRef* t : m.parts) {
    const std::vector<float> part = modified_values(a, m.name, *t);
    x.insert(x.end(), part.begin(), part.end());
  }
  const uint64_t row = m.ne[0], n_rows = x.size() / row;
  std::vector<uint8_t> out(row_bytes(type, row) * n_rows);
  for (uint64_t r = 0; r < n_rows; ++r) quantize_row(type, x.data() + r * row, out.data() + r * row_bytes(type, row), row);
  w.add_tensor(m.name, m.ne, uint32_t(type), out.data(), out.size());
}

// "model.layers.N.mlp.experts.E.gate_proj.weight" -> {"blk.N.ffn_gate_exps.weight", E}; {"", -1} otherwise.
std::pair<std::string, int64_t> expert_tensor(const std::string& hf) {
  static const std::regex re(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d{1,6})\.(gate|up|down)_proj\.weight)");
  static const std::regex mixtral(R"(model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d{1,6})\.(w1|w2|w3)\.weight)");
  std::smatch m;
  if (std::regex_match(hf, m, re)) return {"blk." + m[1].str() + ".ffn_" + m[3].str() + "_exps.weight", std::stoll(m[2].str())};
  if (!std::regex_match(hf, m, mixtral)) return {"", -1};
  const std::string kind = m[3] == "w1" ? "gate" : m[3] == "w2" ? "down" : "up";
  return {"blk." + m[1].str() + ".ffn_" + kind + "_exps.weight", std::stoll(m[2].str())};
}

// The tensors of the checkpoint under their GGUF names, in the checkpoint's (sorted) order; a layer's
// experts become one stacked tensor where its first expert stood.
std::vector<Mapped> mapped_tensors(const ArchInfo& a, const Checkpoint& c, GptOssExperts& gpt_oss) {
  std::vector<Mapped> out;
  std::map<std::string, std::map<int64_t, const TensorRef*>> experts;
  for (const auto& [hf, t] : c.tensors) {
    if (hf.ends_with(".rotary_emb.inv_freq")) continue;
    if (a.arch == "gpt-oss" && GptOssExperts::is_source(hf)) {  // made in llama.cpp's layout below
      const std::string layer = hf.substr(0, hf.find(".mlp."));
      const std::string blk = "blk." + layer.substr(layer.rfind('.') + 1) + ".";
      if (hf.ends_with("_scales")) continue;  // read with its _blocks
      const bool down = hf.find("down_proj") != std::string::npos, bias = hf.ends_with("_bias");
      for (const char* kind : down ? std::vector<const char*>{"down"} : std::vector<const char*>{"gate", "up"}) {
        const std::string name = blk + "ffn_" + kind + "_exps." + (bias ? "bias" : "weight");
        const TensorRef* made = gpt_oss.find(name);
        check(made != nullptr, "internal: gpt-oss tensor {}", name);
        out.push_back({name, {made}, made->ne});
      }
      continue;
    }
    if (const auto [stacked, e] = expert_tensor(hf); e >= 0) {
      check(experts[stacked].emplace(e, t).second, "expert {} of '{}' appears twice", e, stacked);
      if (experts[stacked].size() == 1) out.push_back({stacked, {}, {}});
      continue;
    }
    std::string name = a.arch == "bert" ? bert_gguf_name(hf) : gguf_tensor_name(a.arch, hf);
    if (a.arch == "bert" && name.empty()) continue;  // position ids, a masked-LM head: not kept
    // Tied embeddings stored only as lm_head.weight: that is the embedding (llama.cpp's newer converters
    // name it so; the one beside this project writes output.weight and no token_embd.weight).
    if (hf == "lm_head.weight" && a.tied) {
      if (c.tensors.count("model.embed_tokens.weight")) continue;
      name = "token_embd.weight";
    }
    check(!name.empty(), "cannot map tensor '{}' of a {} checkpoint to a GGUF name", hf, a.arch);
    std::vector<uint64_t> ne = t->ne;
    if (name.ends_with("ffn_gate_inp_shexp.weight") && ne.size() == 2 && ne[1] == 1) ne.pop_back();  // [1, n] -> [n]
    out.push_back({name, {t}, ne});
  }
  for (Mapped& m : out) {
    if (!m.parts.empty()) continue;
    const auto& parts = experts[m.name];
    check(int64_t(parts.size()) == a.n_expert && parts.rbegin()->first == a.n_expert - 1,
          "'{}': {} experts in the checkpoint, config.json says {}", m.name, parts.size(), a.n_expert);
    for (const auto& [e, t] : parts) {
      check(t->ne == parts.begin()->second->ne && t->ne.size() == 2, "'{}': experts of different shapes", m.name);
      m.parts.push_back(t);
    }
    m.ne = {m.parts[0]->ne[0], m.parts[0]->ne[1], uint64_t(a.n_expert)};
  }
  return out;
}

// Shapes config.json implies for the main weights (GGUF order: ne[0] = columns).
void check_shapes(const json& c, const std::string& arch, const std::vector<Mapped>& tensors) {
  const uint64_t n_embd = c.at("hidden_size"), n_head = c.at("num_attention_heads");
  const uint64_t n_kv = has_number(c, "num_key_value_heads") ? c["num_key_value_heads"].get<uint64_t>() : n_head;
  const uint64_t d = has_number(c, "head_dim") ? c["head_dim"].get<uint64_t>() : n_embd / n_head;
  const uint64_t n_ff = c.at("intermediate_size"), n_vocab = c.at("vocab_size");
  std::map<std::string, std::vector<uint64_t>> want = {
      {"attn_q.weight", {n_embd, n_head * d}}, {"attn_k.weight", {n_embd, n_kv * d}},
      {"attn_v.weight", {n_embd, n_kv * d}},   {"attn_output.weight", {n_head * d, n_embd}},
      {"ffn_gate.weight", {n_embd, n_ff}},     {"ffn_up.weight", {n_embd, n_ff}},
      {"ffn_down.weight", {n_ff, n_embd}},     {"token_embd.weight", {n_embd, n_vocab}},
      {"output.weight", {n_embd, n_vocab}}, {"attn_qkv.weight", {n_embd, (n_head + 2 * n_kv) * d}}};
  if (arch == "phi3") want["ffn_up.weight"] = {n_embd, 2 * n_ff};  // gate and up rows in one matrix
  if (arch == "deepseek2") {  // latent attention: query/key heads of nope + rope values, value heads of v_head_dim
    const uint64_t qk = c.at("qk_nope_head_dim").get<uint64_t>() + c.at("qk_rope_head_dim").get<uint64_t>();
    want["attn_q.weight"] = {n_embd, n_head * qk};
    want["attn_output.weight"] = {n_head * c.at("v_head_dim").get<uint64_t>(), n_embd};
  }
  for (const auto& m : tensors) {
    const auto it = want.find(m.name.starts_with("blk.") ? m.name.substr(m.name.find('.', 4) + 1) : m.name);
    if (it == want.end()) continue;
    check(m.ne == it->second, "tensor '{}' has shape [{}] but config.json implies [{}]", m.parts[0]->name,
          fmt::join(m.ne, ", "), fmt::join(it->second, ", "));
  }
}

ArchInfo arch_info(const json& c, const std::string& path) {
  ArchInfo a;
  a.arch = arch_of(c, path);
  a.n_head = hp_u32(c, "num_attention_heads", path);
  a.n_head_kv = has_number(c, "num_key_value_heads") ? hp_u32(c, "num_key_value_heads", path) : a.n_head;
  a.tied = c.value("tie_word_embeddings", a.arch == "gemma3" || a.arch == "gemma2");
  for (const char* key : {"num_experts", "num_local_experts", "n_routed_experts"})
    if (c.contains(key) && c[key].is_number_integer() && !a.n_expert) a.n_expert = c[key].get<int64_t>();
  for (const char* key : {"hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"}) hp_u32(c, key, path);
  return a;
}

void add_general(GgufWriter& w, const std::string& arch, const fs::path& dir) {
  w.add_string("general.architecture", arch);
  w.add_string("general.type", "model");
  w.add_string("general.name", fs::absolute(dir).lexically_normal().filename().string());
}
}  // namespace

DType parse_convert_type(const std::string& name) {
  if (name == "f32") return DType::F32;
  if (name == "f16") return DType::F16;
  if (name == "bf16") return DType::BF16;
  if (name == "q8_0") return DType::Q8_0;
  fail("unknown output type '{}' (f32, f16, bf16, q8_0)", name);
}

std::string gguf_tensor_name(const std::string& arch, const std::string& hf) {
  static const std::map<std::string, std::string> top = {
      {"model.embed_tokens", "token_embd"}, {"model.norm", "output_norm"}, {"lm_head", "output"}};
  static const std::map<std::string, std::string> layer = {
      {"self_attn.q_proj", "attn_q"},       {"self_attn.k_proj", "attn_k"},     {"self_attn.v_proj", "attn_v"},
      {"self_attn.o_proj", "attn_output"},  {"mlp.gate_proj", "ffn_gate"},      {"mlp.up_proj", "ffn_up"},
      {"mlp.down_proj", "ffn_down"},        {"input_layernorm", "attn_norm"},   {"self_attn.q_norm", "attn_q_norm"},
      {"self_attn.k_norm", "attn_k_norm"},  {"pre_feedforward_layernorm", "ffn_norm"},
      {"post_feedforward_layernorm", "post_ffw_norm"}, {"mlp.gate", "ffn_gate_inp"}, {"block_sparse_moe.gate", "ffn_gate_inp"},
      {"self_attn.qkv_proj", "attn_qkv"}, {"mlp.gate_up_proj", "ffn_up"},
      {"mlp.shared_expert.gate_proj", "ffn_gate_shexp"}, {"mlp.shared_expert.up_proj", "ffn_up_shexp"},
      {"mlp.shared_expert.down_proj", "ffn_down_shexp"}, {"mlp.shared_expert_gate", "ffn_gate_inp_shexp"},
      // DeepSeek-V2 (DeepseekV2Model's names: the fused attn_kv_b of llama.cpp before its 2025 split)
      {"self_attn.q_a_proj", "attn_q_a"}, {"self_attn.q_a_layernorm", "attn_q_a_norm"}, {"self_attn.q_b_proj", "attn_q_b"},
      {"self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"}, {"self_attn.kv_a_layernorm", "attn_kv_a_norm"},
      {"self_attn.kv_b_proj", "attn_kv_b"}, {"mlp.shared_experts.gate_proj", "ffn_gate_shexp"},
      {"mlp.shared_experts.up_proj", "ffn_up_shexp"}, {"mlp.shared_experts.down_proj", "ffn_down_shexp"}};
  static const std::regex re(R"((model\.layers\.(\d+)\.)?(.+)\.(weight|bias))");
  static const std::regex sinks(R"(model\.layers\.(\d+)\.self_attn\.sinks)");
  std::smatch m;
  if (arch == "gpt-oss" && std::regex_match(hf, m, sinks)) return "blk." + m[1].str() + ".attn_sinks.weight";
  if (!std::regex_match(hf, m, re)) return "";
  const std::string base = m[3], suffix = "." + m[4].str();
  if (!m[1].matched) {
    const auto it = top.find(base);
    return it == top.end() ? "" : it->second + suffix;
  }
  std::string name;
  const bool gemma = arch == "gemma3" || arch == "gemma2";
  if (base == "post_attention_layernorm") name = gemma || arch == "gpt-oss" ? "post_attention_norm" : "ffn_norm";
  else if (base == "mlp.router" && arch == "gpt-oss") name = "ffn_gate_inp";
  else if (const auto it = layer.find(base); it != layer.end()) name = it->second;
  const bool qk_norm = arch == "gemma3" || arch == "qwen3" || arch == "qwen3moe" || arch == "olmoe";
  if (name.empty() || (!gemma && name == "post_ffw_norm") ||
      (!qk_norm && (name == "attn_q_norm" || name == "attn_k_norm")))
    return "";
  return "blk." + m[2].str() + "." + name + suffix;
}

DType converted_type(const std::string& name, size_t n_dims, uint64_t row_len, DType outtype) {
  const auto ends_with = [&](std::string_view s) { return name.size() >= s.size() && name.ends_with(s); };
  if (n_dims <= 1 || ends_with("_norm.weight") || !ends_with(".weight")) return DType::F32;
  // Position and token-type tables stay F32 (as llama.cpp's converter keeps them): rows added to every token.
  if (name == "position_embd.weight" || name == "token_types.weight") return DType::F32;
  if (name.ends_with("ffn_gate_inp.weight")) return DType::F32;  // MoE routers stay F32, as llama.cpp keeps them
  if (outtype == DType::Q8_0 && row_len % dtype_info(DType::Q8_0).block_elems != 0) return DType::F16;
  return outtype;
}

std::vector<float> permute_rope_rows(const float* w, uint64_t rows, uint64_t cols, uint64_t n_head) {
  check(n_head > 0 && rows % (2 * n_head) == 0, "RoPE permutation: {} rows do not split into {} heads of even size",
        rows, n_head);
  const uint64_t half = rows / n_head / 2;
  std::vector<float> out(rows * cols);
  for (uint64_t h = 0; h < n_head; ++h)
    for (uint64_t i = 0; i < half; ++i)
      for (uint64_t j = 0; j < 2; ++j) {
        const float* src = w + (h * 2 * half + j * half + i) * cols;
        std::copy(src, src + cols, out.begin() + (h * 2 * half + i * 2 + j) * cols);
      }
  return out;
}

void convert_hf_to_gguf(const std::string& hf_dir, const std::string& out_path, const ConvertOptions& o) {
  file_type_of(o.outtype);  // throws for a type the converter does not write
  const fs::path dir = fs::path(hf_dir).lexically_normal();
  check(fs::is_directory(dir), "{}: not a directory", hf_dir);
  const std::string config_path = (dir / "config.json").string();
  const json config = read_json(config_path);
  ArchInfo a;
  try {
    a = arch_info(config, config_path);
  } catch (const json::exception& e) {
    fail("{}: missing or mistyped field: {}", config_path, e.what());
  }
  // A decoder's config.json is checked as loading it would check it (what Serval cannot run is refused
  // here too, not written into a file that then fails to load).
  if (a.arch != "bert") config_from_hf(config_path);
  const Checkpoint ckpt = open_checkpoint(dir);
  GptOssExperts gpt_oss([&ckpt](const std::string& n) -> const TensorRef* {
    const auto it = ckpt.tensors.find(n);
    return it == ckpt.tensors.end() ? nullptr : it->second;
  });
  const auto tensors = mapped_tensors(a, ckpt, gpt_oss);
  check_shapes(config, a.arch, tensors);
  GgufWriter w;
  add_general(w, a.arch, dir);
  add_hparams(w, a.arch, config, o.outtype, config_path);
  if (a.arch == "bert") add_bert_hparams(w, config, o.outtype, dir, config_path);
  add_tokenizer(w, a.arch, dir, config);
  w.add_u32("general.quantization_version", kQuantizationVersion);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Mapped& m = tensors[i];
    const DType type = m.parts.size() == 1 && m.parts[0]->type == DType::MXFP4 ? DType::MXFP4
                                                                                : converted_type(m.name, m.ne.size(), m.ne[0], o.outtype);
    add_tensor(w, a, m, type);
    if (o.progress) o.progress(i + 1, tensors.size(), m.name, type);
  }
  add_rope_tensors(w, config, config_path);
  w.write(out_path);
}

namespace {
// One tensor of a GGUF adapter: a PEFT matrix, or one product's A (or B) of every routed expert,
// stacked in expert order as llama.cpp's convert_lora_to_gguf.py writes them.
struct LoraOut {
  std::string name;
  std::vector<const TensorRef*> parts;
};

// The adapter's tensors under their GGUF names, sorted; `rank` from the A matrices. Experts (PEFT's
// mlp.experts.E.gate_proj, Mixtral's block_sparse_moe.experts.E.w1) must cover every expert of the base.
std::vector<LoraOut> lora_tensors(const SafetensorsFile& file, const ArchInfo& a, const std::string& peft_dir,
                                  int64_t& rank) {
  static const std::regex re(
      R"((?:base_model\.model\.)?(model\.layers\.\d+\.\w+\.\w+(?:\.\w+)?)\.lora_(A|B)(?:\.default)?\.weight)");
  std::vector<LoraOut> out;
  std::map<std::string, std::map<int64_t, const TensorRef*>> stacks;  // GGUF name -> expert -> matrix
  for (const auto& t : file.tensors()) {
    std::smatch m;
    check(t.ne.size() == 2, "{}: tensor '{}' is not a matrix", peft_dir, t.name);
    const bool is_a = t.name.find(".lora_A.") != std::string::npos;
    if (is_a) rank = int64_t(t.ne[1]);
    if (const auto e = parse_peft_expert(t.name)) {
      check(e->kind >= 0, "{}: tensor '{}' targets an unsupported expert module", peft_dir, t.name);
      check(e->expert < a.n_expert, "{}: tensor '{}' is for expert {}, the base has {}", peft_dir, t.name, e->expert,
            a.n_expert);
      stacks[fmt::format("blk.{}.{}.weight.lora_{}", e->layer, expert_gguf_name(e->kind), e->is_a ? "a" : "b")][e->expert] = &t;
      continue;
    }
    check(std::regex_match(t.name, m, re), "{}: tensor '{}' is not a layer's LoRA matrix", peft_dir, t.name);
    const std::string name = gguf_tensor_name(a.arch, m[1].str() + ".weight");
    check(!name.empty(), "{}: tensor '{}' targets a module GGUF does not name", peft_dir, t.name);
    out.push_back({name + (m[2] == "A" ? ".lora_a" : ".lora_b"), {&t}});
  }
  for (const auto& [name, per] : stacks) {
    check(int64_t(per.size()) == a.n_expert, "{}: '{}' has updates for {} of the {} experts (GGUF stacks all of them)",
          peft_dir, name, per.size(), a.n_expert);
    LoraOut o{name, {}};
    for (const auto& [e, t] : per) {
      check(t->ne == per.begin()->second->ne, "{}: the experts' matrices of '{}' differ in shape", peft_dir, name);
      o.parts.push_back(t);
    }
    out.push_back(std::move(o));
  }
  check(rank > 0, "{}: no LoRA tensors", peft_dir);
  std::sort(out.begin(), out.end(), [](const LoraOut& x, const LoraOut& y) { return x.name < y.name; });
  return out;
}
}  // namespace

void convert_lora_to_gguf(const std::string& peft_dir, const std::string& base_dir, const std::string& out_path,
                          DType outtype) {
  check(outtype == DType::F32 || outtype == DType::F16 || outtype == DType::BF16,
        "a LoRA adapter is written as f32, f16 or bf16");
  const fs::path dir = fs::path(peft_dir).lexically_normal();
  const json ac = read_json(dir / "adapter_config.json");
  check(ac.value("peft_type", "LORA") == "LORA", "{}: not a LoRA adapter", peft_dir);
  std::string base = base_dir;
  if (base.empty() && ac.contains("base_model_name_or_path") && ac["base_model_name_or_path"].is_string())
    base = ac["base_model_name_or_path"].get<std::string>();
  check(!base.empty() && fs::is_regular_file(fs::path(base) / "config.json"),
        "{}: give the base model's Hugging Face directory with --base (its config.json says the architecture)", peft_dir);
  const json config = read_json(fs::path(base) / "config.json");
  const ArchInfo a = arch_info(config, (fs::path(base) / "config.json").string());
  check(a.arch != "bert", "LoRA adapters of encoders are not supported");
  const SafetensorsFile file((dir / "adapter_model.safetensors").string());
  GgufWriter w;
  w.add_string("general.architecture", a.arch);
  w.add_string("general.type", "adapter");
  w.add_string("general.name", dir.filename().string());
  w.add_string("adapter.type", "lora");
  int64_t rank = 0;
  const std::vector<LoraOut> tensors = lora_tensors(file, a, peft_dir, rank);
  float alpha = ac.value("lora_alpha", float(rank));
  if (ac.value("use_rslora", false)) alpha *= std::sqrt(float(rank));
  w.add_f32("adapter.lora.alpha", alpha);
  for (const auto& [name, parts] : tensors) {
    std::vector<float> x;
    for (const TensorRef* t : parts) {
      const std::vector<float> part = to_floats(*t);
      x.insert(x.end(), part.begin(), part.end());
    }
    const TensorRef& t = *parts[0];
    const bool q = name.find(".attn_q.") != std::string::npos, k = name.find(".attn_k.") != std::string::npos;
    if (a.arch == "llama" && name.ends_with(".lora_b") && (q || k))
      x = permute_rope_rows(x.data(), t.ne[1], t.ne[0], q ? a.n_head : a.n_head_kv);
    const uint64_t rows = t.ne[1] * parts.size();
    std::vector<uint8_t> out(row_bytes(outtype, t.ne[0]) * rows);
    for (uint64_t r = 0; r < rows; ++r)
      quantize_row(outtype, x.data() + r * t.ne[0], out.data() + r * row_bytes(outtype, t.ne[0]), t.ne[0]);
    std::vector<uint64_t> ne = t.ne;
    if (parts.size() > 1) ne.push_back(parts.size());  // [in or rank, rank or out, n_expert]
    w.add_tensor(name, ne, uint32_t(outtype), out.data(), out.size());
  }
  w.write(out_path);
}

}  // namespace serval
