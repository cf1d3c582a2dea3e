// Mixture-of-experts FFN: each token's experts chosen by the router, the step's tokens grouped by
// expert, each expert's matrix products run once over its tokens (the same tiled kernels as the dense
// FFN), and each token's expert outputs summed in a fixed order.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace serval {

// The experts of each token and their weights: [token * k + j] for the token's j-th choice, in
// descending router probability (ties: the lower expert index first).
struct MoeRouting {
  int64_t k = 0;
  std::vector<int32_t> expert;
  std::vector<float> weight;
};

// Softmax over the n_expert router logits of each token ([n_tok][n_expert]), the k most probable
// experts (group-limited when config.expert_groups), their probabilities renormalized to sum to 1
// when config.expert_weights_norm, then times config.expert_weights_scale.
MoeRouting route_tokens(const ModelConfig& config, const float* logits, int64_t n_tok);

// out[n_tok][n_embd] = the MoE FFN of the normed rows h[n_tok][n_embd] (routed experts plus the
// shared expert, if any). A token's result depends only on its own row: which other tokens chose the
// same experts changes the grouping, never the arithmetic. `expert_tokens` (n_expert counters, or
// null) counts the tokens each expert ran.
// Sees the inputs of the layer's products (imatrix): kind is "ffn_gate_inp", "ffn_{gate,up,down}_shexp"
// (expert -1) or "ffn_{gate,up,down}_exps" (expert e of n_expert). While set, experts run one after
// another, so it is never called concurrently.
using MoeObserver = std::function<void(const char* kind, int64_t expert, const float* x, int64_t n_rows, int64_t cols)>;
// LoRA updates of the experts' products (Model::ffn_block makes it from the step's adapters): adds to
// y [m][out] the update of expert e's product `kind` (0 gate, 1 up, 2 down; e = -1: the shared
// expert) of the rows x [m][in], row i being the step's token tokens[i] (null: token i), each by its own
// adapter.
// Called from the experts' tasks, side by side.
using MoeLora = std::function<void(int64_t e, int kind, const int64_t* tokens, int64_t m, const float* x, int64_t in,
                                   float* y)>;
void moe_ffn(const ModelConfig& config, const LayerWeights& layer, const float* h, int64_t n_tok, float* out,
             std::atomic<uint64_t>* expert_tokens = nullptr, const MoeObserver* observe = nullptr,
             const MoeLora* lora = nullptr);

}  // namespace serval
