#include "engine/capacity.h"

#include <cmath>
#include <map>
#include <utility>

#include "base/error.h"

namespace serval {

PlanResult plan_capacity(const PlanInput& in) {
  check(in.n_layers > 0 && in.n_kv_heads > 0 && in.d_head > 0, "layers, KV heads and head dimension must be positive");
  check(in.kv_rows == 1 || in.kv_rows == 2, "KV rows per layer must be 1 or 2");
  check(in.context > 0 && in.kv_dtype_bytes > 0, "context and KV dtype size must be positive");
  check(in.weight_bytes || (in.n_params > 0 && in.weight_bits > 0), "give the parameter count and weight bits, or a model");
  PlanResult r;
  r.weight_bytes = in.weight_bytes ? *in.weight_bytes : uint64_t(std::llround(in.n_params * in.weight_bits / 8.0));
  r.kv_bytes_per_token = uint64_t(std::llround(double(in.kv_rows) * double(in.n_layers) * double(in.n_kv_heads) * double(in.d_head) * in.kv_dtype_bytes));
  r.kv_bytes_per_sequence = r.kv_bytes_per_token * uint64_t(in.context);
  r.weights_fit = in.memory_bytes > 0 && r.weight_bytes <= in.memory_bytes;
  if (r.weights_fit) r.max_sequences = int64_t((in.memory_bytes - r.weight_bytes) / r.kv_bytes_per_sequence);
  r.kv_bytes_for_users = r.kv_bytes_per_sequence * uint64_t(std::max<int64_t>(in.users, 0));
  r.users_fit = in.users > 0 && r.weights_fit && r.weight_bytes + r.kv_bytes_for_users <= in.memory_bytes;
  return r;
}

bool plan_preset(const std::string& name, PlanInput& in) {
  struct Shape { double params; int64_t layers, kv_heads, d_head, context, kv_rows = 2; };
  static const std::map<std::string, Shape> presets = {
      {"llama3-8b", {8.03e9, 32, 8, 128, 8192}},       {"llama3-70b", {70.6e9, 80, 8, 128, 8192}},
      {"llama3-405b", {405.9e9, 126, 8, 128, 8192}},   {"llama2-7b", {6.74e9, 32, 32, 128, 4096}},
      {"qwen2.5-0.5b", {0.494e9, 24, 2, 64, 32768}},   {"qwen2.5-1.5b", {1.54e9, 28, 2, 128, 32768}},
      {"qwen2.5-7b", {7.62e9, 28, 4, 128, 32768}},     {"gemma3-270m", {0.268e9, 18, 1, 256, 32768}},
      {"mistral-7b", {7.24e9, 32, 8, 128, 32768}},     {"qwen3-0.6b", {0.596e9, 28, 8, 128, 40960}},
      {"qwen3-8b", {8.19e9, 36, 8, 128, 40960}},       {"qwen3-30b-a3b", {30.5e9, 48, 4, 128, 40960}},
      {"olmoe-1b-7b", {6.92e9, 16, 16, 128, 4096}},    {"qwen1.5-moe-a2.7b", {14.3e9, 24, 16, 128, 8192}},
      // MLA: one row of kv_lora_rank 512 + 64 rotated key values per layer.
      {"deepseek-v2-lite", {15.7e9, 27, 1, 576, 163840, 1}}, {"deepseek-v2", {235.7e9, 60, 1, 576, 163840, 1}},
  };
  auto it = presets.find(name);
  if (it == presets.end()) return false;
  in.name = name;
  in.n_params = it->second.params;
  in.n_layers = it->second.layers;
  in.n_kv_heads = it->second.kv_heads;
  in.d_head = it->second.d_head;
  in.kv_rows = it->second.kv_rows;
  return true;
}

namespace {

constexpr std::pair<const char*, DType> kKvTypes[] = {
    {"f32", DType::F32}, {"f16", DType::F16}, {"bf16", DType::BF16}, {"q8_0", DType::Q8_0},
    {"fp8_e4m3", DType::F8_E4M3}, {"fp8", DType::F8_E4M3},
};

}  // namespace

DType parse_kv_cache_type(const std::string& name) {
  for (const auto& [n, t] : kKvTypes)
    if (name == n) return t;
  fail("unsupported KV cache type '{}' (f32, f16, bf16, q8_0, fp8_e4m3)", name);
}

std::string kv_cache_type_name(DType type) {
  for (const auto& [n, t] : kKvTypes)
    if (t == type) return n;
  fail("internal: {} is not a KV cache type", dtype_info(type).name);
}

double kv_dtype_bytes(const std::string& name) {
  if (name == "fp32") return 4;
  if (name == "fp16") return 2;
  if (name == "int8") return 1;
  return bytes_per_elem(parse_kv_cache_type(name));
}

}  // namespace serval
