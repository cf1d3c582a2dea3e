// Capacity planning: weight bytes, KV bytes per token and per sequence, and how many sequences fit
// in a device's memory. KV_bytes = 2 x n_layers x n_kv_heads x d_head x seq_len x dtype_bytes; with
// multi-head latent attention (DeepSeek-V2) one row per layer: n_layers x (kv_lora_rank + rope dims) x ...
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "io/ggml_types.h"

namespace serval {

struct PlanInput {
  std::string name;
  double n_params = 0;      // weights
  double weight_bits = 16;  // bits per weight
  std::optional<uint64_t> weight_bytes;  // measured from a file; overrides n_params x bits
  int64_t n_layers = 0, n_kv_heads = 0, d_head = 0;
  int64_t kv_rows = 2;        // K and V; 1 with MLA (one latent row per token and layer, d_head its width)
  int64_t context = 8192;     // tokens per sequence
  double kv_dtype_bytes = 2;  // f16/bf16 2, fp8/int8 1, f32 4
  uint64_t memory_bytes = 0;  // device memory
  int64_t users = 0;          // optional: concurrent sequences to size for
};

struct PlanResult {
  uint64_t weight_bytes = 0;
  uint64_t kv_bytes_per_token = 0;
  uint64_t kv_bytes_per_sequence = 0;
  int64_t max_sequences = 0;    // full-context sequences that fit beside the weights
  bool weights_fit = false;
  uint64_t kv_bytes_for_users = 0;  // users x per-sequence
  bool users_fit = false;
};

// Throws Error for non-positive sizes.
PlanResult plan_capacity(const PlanInput& in);

// Known shapes: "llama3-8b", "llama3-70b", "qwen2.5-0.5b", ... ; false if unknown.
bool plan_preset(const std::string& name, PlanInput& in);

// KV cache types by their command-line names (--cache-type, --kv-cache-dtype, plan --kv-dtype): f32,
// f16, bf16, q8_0, fp8_e4m3 (alias fp8). Throws Error naming the accepted values.
DType parse_kv_cache_type(const std::string& name);
std::string kv_cache_type_name(DType type);

// Bytes per element of a KV dtype name: parse_kv_cache_type's names (q8_0: 34 / 32), and for
// pricing only fp32, fp16 and int8; throws Error.
double kv_dtype_bytes(const std::string& name);

}  // namespace serval
