// gpt-oss's Hugging Face expert tensors in llama.cpp's layout, made in memory (F32): used by the
// safetensors loader and by `serval convert`.
#pragma once
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "io/tensor_ref.h"

namespace serval {

// gpt-oss's Hugging Face experts are stacked per layer and multiply from the right (x @ W): gate_up_proj
// [E, n_embd, 2 n_ff] with gate and up columns interleaved (even, odd), down_proj [E, n_ff, n_embd],
// biases [E, 2 n_ff] and [E, n_embd]. GptOssExperts makes llama.cpp's layout of them (F32, in memory):
// ffn_{gate,up}_exps [E][n_ff][n_embd], ffn_down_exps [E][n_embd][n_ff], biases [E][n].
class GptOssExperts {
 public:
  using Find = std::function<const TensorRef*(const std::string&)>;  // a Hugging Face tensor by name
  explicit GptOssExperts(Find find) : find_(std::move(find)) {}
  // blk.N.ffn_{gate,up,down}_exps.{weight,bias}, made from the layer's stacked tensors; null for any
  // other name, or when the checkpoint lacks the source. The result lives as long as this object.
  const TensorRef* find(const std::string& gguf_name);
  // The Hugging Face tensors find() reads (a converter maps them no other way): the stacked matrices,
  // their biases, and OpenAI's MXFP4 checkpoints' `_blocks` and `_scales` (which find() turns into
  // GGUF MXFP4 matrices, bit for bit the same values, not widened).
  static bool is_source(const std::string& hf_name);

 private:
  Find find_;
  std::deque<std::vector<uint8_t>> data_;
  std::deque<TensorRef> made_;
  std::map<std::string, const TensorRef*> by_name_;
};

}  // namespace serval
