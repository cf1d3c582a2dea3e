// Pre-tokenizers of byte-level BPE vocabularies, named as GGUF's tokenizer.ggml.pre names them.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace serval {

enum class PreTokenizer { None, Gpt2, Llama3, Qwen2, Starcoder, DeepseekCoder };

// Maps a tokenizer.ggml.pre name to its pre-tokenizer; throws Error for an unknown name.
PreTokenizer pre_tokenizer_from_name(const std::string& name);

// Splits text into words with the pre-tokenizer's regular expressions, applied in sequence
// (each splits every piece into matches and the gaps between them).
std::vector<std::string> pre_tokenize(PreTokenizer pre, std::string_view text);

}  // namespace serval
