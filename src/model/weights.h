// Model weights: matrices point into the mapped file (no copy); norm vectors and biases as floats.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "io/tensor_ref.h"
#include "kernels/ops.h"
#include "model/config.h"

namespace serval {

// Finds a tensor by its GGUF name ("blk.0.attn_q.weight"), or returns nullptr.
using TensorLookup = std::function<const TensorRef*(const std::string& gguf_name)>;

struct LayerWeights {
  std::vector<float> attn_norm;       // [n_embd]
  WeightMatrix wq, wk, wv, wo;        // [q_dim, n_embd], [kv_dim, n_embd] x2, [n_embd, q_dim]
  std::vector<float> bq, bk, bv;      // optional biases (Qwen2)
  std::vector<float> bo;              // [n_embd] output-projection bias (gpt-oss)
  std::vector<float> sinks;           // [n_head] attention sink logits (gpt-oss)
  std::vector<float> q_norm, k_norm;  // [d_head] (Gemma 3)
  std::vector<float> post_attn_norm;  // [n_embd] (Gemma 3)
  std::vector<float> ffn_norm;        // [n_embd]
  WeightMatrix w_gate, w_up, w_down;  // [n_ff, n_embd] x2, [n_embd, n_ff]
  std::vector<float> post_ffn_norm;   // [n_embd] (Gemma 3)
  // Mixture-of-experts layers (ModelConfig::layer_is_moe) instead of w_gate, w_up, w_down:
  WeightMatrix router;                                   // [n_expert, n_embd]
  std::vector<WeightMatrix> exp_gate, exp_up, exp_down;  // per expert: [n_ff_exp, n_embd] x2, [n_embd, n_ff_exp]
  WeightMatrix sh_gate, sh_up, sh_down;                  // shared expert (n_ff_shexp > 0)
  std::vector<float> sh_router;                          // [n_embd]: the shared expert's sigmoid gate
  std::vector<float> router_b;                           // [n_expert] router bias (gpt-oss)
  std::vector<float> exp_gate_b, exp_up_b, exp_down_b;   // [n_expert][n_ff_exp] x2, [n_expert][n_embd] (gpt-oss)
  // Multi-head latent attention (ModelConfig::mla) instead of wq/wk/wv: the query from wq
  // [n_head * (nope + rope), n_embd], or with q_lora_rank through wq_a [q_lora, n_embd], q_a_norm and
  // wq_b [n_head * (nope + rope), q_lora]; the latent and the rotated key from wkv_a
  // [kv_lora + rope, n_embd], the latent normed by kv_a_norm [kv_lora]; per head h the key
  // up-projection transposed, wk_b[h] [kv_lora, nope] (it turns the head's query into latent space),
  // and the value up-projection wv_b[h] [v_head, kv_lora]; wo is [n_embd, n_head * v_head].
  WeightMatrix wq_a, wq_b, wkv_a;
  std::vector<float> q_a_norm, kv_a_norm;
  std::vector<WeightMatrix> wk_b, wv_b;
  std::vector<uint8_t> mla_owned;  // wk_b's bytes when transposed at load from llama.cpp's fused attn_kv_b
};

struct ModelWeights {
  WeightMatrix tok_embd;            // [n_vocab, n_embd]
  std::vector<float> output_norm;   // [n_embd]
  WeightMatrix output;              // [n_vocab, n_embd] (the embedding when tied)
  std::vector<float> rope_freqs;    // [rot / 2] Llama 3 frequency factors, optional
  std::vector<float> rope_long, rope_short;  // [rot / 2] LongRoPE factors (GGUF tensors, else config.json's)
  std::vector<LayerWeights> layers;
  // Bytes of weight data referenced (matrices and vectors), for `serval info`.
  uint64_t weight_bytes = 0;
};

// Binds every tensor the config needs, checking shapes; throws Error naming the tensor.
// After repacking, a matrix's pages are given back (release_file_pages); `reloadable` says whether a
// page given back reads its bytes again (a file mapping) or zeros (anonymous memory: then the tied
// output, whose embedding rows are read again, keeps its pages).
ModelWeights bind_weights(const ModelConfig& config, const TensorLookup& lookup, const std::string& source,
                          bool reloadable = true);

}  // namespace serval
