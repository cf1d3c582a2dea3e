// Model hyperparameters, read from GGUF keys or a Hugging Face config.json, and validated.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/shard.h"

namespace serval {

class GgufFile;

enum class RopeStyle { Interleaved /* pairs (2i, 2i+1): GGUF llama */, Neox /* pairs (i, i+d/2) */ };
enum class FfnActivation { Silu, GeluTanh };

struct ModelConfig {
  std::string arch;  // llama, qwen2, gemma3
  int64_t n_vocab = 0;
  int64_t n_ctx_train = 0;
  int64_t n_embd = 0;
  int64_t n_layer = 0;
  int64_t n_head = 0;
  int64_t n_head_kv = 0;
  int64_t d_head = 0;
  int64_t n_ff = 0;
  float norm_eps = 1e-5f;
  RopeStyle rope_style = RopeStyle::Interleaved;
  int64_t n_rot = 0;  // leading dimensions of each head that RoPE rotates (partial rotary); 0: d_head
  float rope_base = 10000.0f;
  float rope_base_swa = 10000.0f;  // base of sliding-window layers (Gemma 3)
  float rope_linear_scale = 1.0f;  // positions are divided by this (linear RoPE scaling)
  // YaRN (yarn_factor > 0): pairs that turn fewer than beta_slow times over rope_orig_ctx positions are
  // interpolated (angle / factor), those turning more than beta_fast times kept, a linear ramp between
  // (the correction range floored and ceiled unless !yarn_truncate); every layer.
  float yarn_factor = 0.0f, yarn_beta_fast = 32.0f, yarn_beta_slow = 1.0f;
  bool yarn_truncate = true;
  int64_t rope_orig_ctx = 0;      // YaRN / LongRoPE: the context the model was pre-trained with
  float rope_attn_factor = 1.0f;  // cos and sin are multiplied by it (YaRN's mscale, LongRoPE's factor)
  // LongRoPE (Phi-3 128K, Phi-3.5, Phi-4-mini): per-pair divisors of the angle, the long set when the
  // context in use exceeds rope_orig_ctx (Model::set_context_length), else the short one. From
  // config.json; a GGUF file holds them as the tensors rope_factors_{long,short}.
  bool longrope = false;
  std::vector<float> rope_long_factors, rope_short_factors;
  std::vector<float> rope_llama3_freqs;  // config.json's llama3 scaling (GGUF: the rope_freqs tensor)
  int64_t sliding_window = 0;      // 0: none
  std::vector<uint8_t> layer_is_swa;
  float attn_scale = 1.0f;
  float embd_scale = 1.0f;
  FfnActivation ffn_act = FfnActivation::Silu;
  bool qk_norm = false;        // RMSNorm of Q and K before RoPE (Gemma 3, Qwen3: per head; OLMoE: whole)
  bool qk_norm_whole = false;  // the norm spans all heads (q_dim, kv_dim values) instead of one head
  bool post_norms = false;     // RMSNorm after attention and after the FFN (Gemma 3)
  bool attn_bias = false;      // Q, K and V biases are required (Qwen2, Qwen2-MoE)
  float attn_softcap = 0.0f;   // > 0: attention scores soft-capped, cap * tanh(s / cap) (Gemma 2)
  float final_softcap = 0.0f;  // > 0: the same on the output logits (Gemma 2)
  bool norm_plus_one = false;  // Hugging Face Gemma checkpoints store RMSNorm weights as w - 1
  // gpt-oss: an output-projection bias, a learned sink logit per head in every softmax (attn_sinks),
  // router and expert biases, and experts' SwiGLU in OpenAI's form:
  //   g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) * g * sigmoid(alpha * g).
  bool attn_out_bias = false, attn_sinks = false, moe_biases = false;
  bool swiglu_oai = false;
  float swiglu_alpha = 1.702f, swiglu_limit = 7.0f;

  // Mixture of experts: layers with layer_is_moe[il] route each token to n_expert_used of n_expert
  // experts (SwiGLU FFNs of width n_ff_exp) by a softmax over the router's logits; the chosen
  // probabilities are renormalized to sum to 1 when expert_weights_norm. n_ff_shexp > 0: a shared
  // expert every token also runs, scaled by sigmoid(gate . x) (Qwen2-MoE).
  int64_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff_shexp = 0;
  bool expert_weights_norm = false;
  std::vector<uint8_t> layer_is_moe;
  bool is_moe() const { return n_expert > 0; }
  // DeepSeek-V2's routing: the chosen probabilities times expert_weights_scale (routed_scaling_factor);
  // expert_groups > 0: group-limited greedy, the experts of the expert_groups_used groups with the best
  // single expert compete, the others are dropped. A shared expert without a gate vector (sh_router
  // empty in the weights) is added as it is.
  float expert_weights_scale = 1.0f;
  int64_t expert_groups = 0, expert_groups_used = 0;

  // Multi-head latent attention (DeepSeek-V2, `mla`). Per token and layer the cache holds one row of
  // kv_lora_rank latent values (after their RMSNorm) and qk_rope_dim rotated key values, shared by every
  // head: so n_head_kv is 1 and d_head = kv_lora_rank + qk_rope_dim, n_rot = qk_rope_dim (the rotated
  // values are the last ones of the row), and the V pool is the K pool (a head's value is the latent).
  // Queries are absorbed: each head's qk_nope_dim query values times its key up-projection give
  // kv_lora_rank values to dot with the latent; the attention output's latent part times the head's
  // value up-projection gives v_head_dim values (model.cpp, docs/models.md).
  bool mla = false;
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;

  ShardLayout shard;        // this process's share (Model::load's LoadOptions); the whole model by default
  // Logits for the vocabulary's first logit_rows tokens only (0: all of them): a draft model's reduced
  // output matrix (LoadOptions::logit_rows, docs/speculative.md).
  int64_t logit_rows = 0;

  int64_t q_dim() const { return n_head * d_head; }
  int64_t rot_dims() const { return n_rot > 0 ? n_rot : d_head; }
  int64_t kv_dim() const { return n_head_kv * d_head; }
  // KV bytes per token: 2 x n_layers x n_kv_heads x d_head x dtype_bytes; with MLA
  // n_layers x (kv_lora_rank + qk_rope_dim) x dtype_bytes (one row, no separate V).
  // dtype_bytes may be fractional: Q8_0 stores 32 values in 34 bytes.
  int64_t kv_rows() const { return mla ? 1 : 2; }
  int64_t kv_bytes_per_token(double dtype_bytes) const {
    return std::llround(double(kv_rows() * n_layer * n_head_kv * d_head) * dtype_bytes);
  }
  // Whether this rank computes layer `il`, and the width of its K (or V) rows (its KV heads).
  bool owns_layer(int64_t il) const { return !shard.split() || (il >= shard.layer_begin && il < shard.layer_end); }
  int64_t local_kv_dim() const { return shard.split() ? (shard.kv_head_end - shard.kv_head_begin) * d_head : kv_dim(); }
  // KV bytes per token in this rank's cache (its layers, its KV heads): kv_bytes_per_token unless split.
  int64_t local_kv_bytes_per_token(double dtype_bytes) const {
    const int64_t layers = shard.split() ? shard.layer_end - shard.layer_begin : n_layer;
    return std::llround(double(kv_rows() * layers * local_kv_dim()) * dtype_bytes);
  }
  // KV groups: layers whose caches are paged together. Gemma 3 has two (0: global layers,
  // 1: sliding-window layers, whose old blocks can be freed); other models have one.
  int n_kv_groups() const;
  int kv_group(int64_t layer) const;
  bool kv_group_is_swa(int group) const;
  // Throws Error when the hyperparameters are inconsistent.
  void validate(const std::string& source) const;
};

// RoPE of a Hugging Face config.json, spelled either way: transformers 4's `rope_theta` and
// `rope_scaling`, or transformers 5's `rope_parameters` (one set, or one per layer type:
// "full_attention", "sliding_attention"). Types: default and linear; any other, or a set without a
// base, is refused (Error) rather than run with a default. Without either spelling: base 10000.
// Types: default, linear, yarn, longrope (`su`) and llama3 (full-attention set only); others are refused.
struct HfRope {
  bool has_theta = false;
  float theta = 10000.0f;      // full-attention layers
  float theta_swa = 10000.0f;  // sliding-window layers (their own set in rope_parameters, else theta)
  float linear_factor = 1.0f;  // linear scaling (positions divided by it); 1: none
  std::string type = "default";  // of the full-attention set
  // yarn: factor, beta_fast/slow, truncate; yarn/longrope: the cos/sin factor and original context
  // (rope set, else the top-level original_max_position_embeddings, else max_position_embeddings).
  float yarn_factor = 0.0f, beta_fast = 32.0f, beta_slow = 1.0f;
  bool truncate = true;
  int64_t orig_ctx = 0;
  float attn_factor = 1.0f;  // as transformers computes it (yarn: 0.1 ln s + 1 or mscale ratio; longrope)
  std::vector<float> long_factor, short_factor;  // longrope
  // llama3: the per-pair divisors Llama 3.1 applies (as rope_freqs.weight in GGUF)
  std::vector<float> llama3_freqs;
};
HfRope hf_rope(const nlohmann::json& config, const std::string& path);

// Reads `{arch}.*` keys; throws Error for an unsupported architecture or missing keys.
ModelConfig config_from_gguf(const GgufFile& gguf);
// Reads a Hugging Face config.json (LlamaForCausalLM / Qwen2ForCausalLM).
ModelConfig config_from_hf(const std::string& config_json_path);

}  // namespace serval
