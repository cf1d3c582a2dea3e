// Tensor names of Hugging Face checkpoints in GGUF's spelling (as llama.cpp's converter names them),
// for the architectures whose loader and converter share one table.
#pragma once
#include <string>

namespace serval {

// A BERT checkpoint's tensor ("encoder.layer.0.attention.self.query.weight", with or without a
// "bert." prefix; "classifier.weight" of a sequence-classification head) as GGUF names it
// ("blk.0.attn_q.weight"); "" for tensors GGUF does not keep (position ids, the MLM head).
std::string bert_gguf_name(const std::string& hf_name);

}  // namespace serval
