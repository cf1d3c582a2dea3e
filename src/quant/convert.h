// `serval convert`: a Hugging Face checkpoint (config.json, safetensors, sharded or not, tokenizer.json,
// tokenizer_config.json) to a GGUF file with the tensor names, tensor types and metadata that
// llama.cpp's convert_hf_to_gguf.py writes (docs/quantization.md). Llama, Qwen2 and Gemma 3 text.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/ggml_types.h"

namespace serval {

struct ConvertOptions {
  DType outtype = DType::F16;  // F32, F16, BF16 or Q8_0: the type of the 2-D weights
  // Called after each tensor is converted: its index (from 1), the count, its GGUF name and type.
  std::function<void(size_t, size_t, const std::string&, DType)> progress;
};

// Converts `hf_dir` into `out_path` (written atomically: on any Error no file is left); throws Error
// for an unknown architecture, a missing file, a tensor it cannot map or read, or a shape mismatch.
void convert_hf_to_gguf(const std::string& hf_dir, const std::string& out_path, const ConvertOptions& options);

// A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to a GGUF adapter as
// llama.cpp's convert_lora_to_gguf.py writes it: general.type "adapter", adapter.type "lora",
// adapter.lora.alpha, "blk.N.<name>.weight.lora_a" [rank, in] and ".lora_b" [out, rank], B rows of
// Q and K permuted for a llama base. `base_dir` is the base model's Hugging Face directory (its
// config.json; empty: the adapter's base_model_name_or_path when that is a local directory).
// `outtype` F32, F16 or BF16.
void convert_lora_to_gguf(const std::string& peft_dir, const std::string& base_dir, const std::string& out_path,
                          DType outtype);

// "f32" / "f16" / "bf16" / "q8_0" to a type; throws Error otherwise.
DType parse_convert_type(const std::string& name);

// The GGUF name of Hugging Face tensor `hf_name` for `arch` (llama, qwen2, gemma3); "" when it has none.
std::string gguf_tensor_name(const std::string& arch, const std::string& hf_name);

// The type a tensor gets, as llama.cpp's converter picks it: F32 for 1-D tensors, norms and
// non-".weight" tensors, otherwise `outtype`; Q8_0 falls back to F16 when rows are not whole blocks.
DType converted_type(const std::string& gguf_name, size_t n_dims, uint64_t row_len, DType outtype);

// llama.cpp's `permute` of the Q or K projection for RoPE: the rows of each of `n_head` heads go from
// rotate-half order (i, i + d/2) to interleaved pairs (2i, 2i + 1). `rows` x `cols` floats, row-major.
std::vector<float> permute_rope_rows(const float* w, uint64_t rows, uint64_t cols, uint64_t n_head);

}  // namespace serval
