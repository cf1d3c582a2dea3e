// LoRA adapters: low-rank updates y += scale * B (A x) to a model's matrix products, kept beside the
// shared weights (never merged), so that each token of a batch can use its own adapter (or none).
// Loaded from GGUF adapters as llama.cpp's convert_lora_to_gguf.py writes them (general.type adapter,
// adapter.lora.alpha, "blk.N.attn_q.weight.lora_a" / ".lora_b") or PEFT directories
// (adapter_config.json + adapter_model.safetensors).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "model/config.h"

namespace serval {

// The matrix products an adapter may change, in a layer: attention, the dense FFN, a mixture-of-experts
// layer's shared expert (the routed experts' are LoraAdapter::experts).
enum class LoraTarget { Q, K, V, O, Gate, Up, Down, ShGate, ShUp, ShDown, Count };
// GGUF's: attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down, ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp
const char* lora_target_name(LoraTarget t);

struct LoraPair {
  WeightMatrix a;   // [rank, in] (F32, owned by the adapter)
  WeightMatrix b;   // [out, rank]
  const float* bt = nullptr;  // B transposed, [rank][out]: the update's second product runs along rows
  bool empty() const { return a.empty(); }
};

struct LoraAdapter {
  std::string name, path;
  int64_t rank = 0;
  float alpha = 0;
  float scale = 1;  // the user's scale (--lora-scaled); the update is scale * alpha / rank * B A x
  std::vector<std::array<LoraPair, size_t(LoraTarget::Count)>> layers;
  // The routed experts' updates: [layer][expert][0 gate, 1 up, 2 down]; empty where a layer has none.
  std::vector<std::vector<std::array<LoraPair, 3>>> experts;
  const LoraPair* expert_pair(int64_t il, int64_t e, int kind) const {
    if (size_t(il) >= experts.size() || experts[size_t(il)].empty()) return nullptr;
    const LoraPair& p = experts[size_t(il)][size_t(e)][size_t(kind)];
    return p.empty() ? nullptr : &p;
  }
  std::vector<std::vector<float>> storage;  // the F32 data the pairs point into
  float factor(float user_scale) const { return user_scale * alpha / float(rank); }
};

// A PEFT tensor of a routed expert's update (Qwen-MoE's / OLMoE's
// model.layers.L.mlp.experts.E.gate_proj.lora_A.weight, Mixtral's block_sparse_moe.experts.E.w1...):
// its layer, expert, product (0 gate, 1 up, 2 down; -1 for a module that is none of them), and
// whether it is A. nullopt for a name of any other form.
struct PeftExpertTensor {
  int64_t layer = 0, expert = 0;
  int kind = -1;
  bool is_a = false;
};
std::optional<PeftExpertTensor> parse_peft_expert(const std::string& name);
// GGUF's stacked name of a product kind: ffn_gate_exps, ffn_up_exps, ffn_down_exps.
const char* expert_gguf_name(int kind);

// Loads an adapter for a model of `config` (its architecture and shapes are checked; a split model
// is refused). A llama model in GGUF keeps Q and K rows permuted for interleaved RoPE: a PEFT adapter's
// B rows for q_proj / k_proj are permuted the same way. Throws Error naming the file and the problem.
std::shared_ptr<const LoraAdapter> load_lora(const std::string& path, const ModelConfig& config, std::string name,
                                             float scale);

}  // namespace serval
