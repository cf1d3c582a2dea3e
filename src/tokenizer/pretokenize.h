// Pre-tokenizers of byte-level BPE vocabularies, named as GGUF's tokenizer.ggml.pre names them.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace serval {

enum class PreTokenizer { None, Gpt2, Llama3, Qwen2, Starcoder, DeepseekCoder, DeepseekLlm, Gpt4o };

// Maps a tokenizer.ggml.pre name to its pre-tokenizer; throws Error for an unknown name.
PreTokenizer pre_tokenizer_from_name(const std::string& name);

// The split regular expressions of a named pre-tokenizer, in the order they apply.
std::vector<std::string> pre_tokenizer_regexes(PreTokenizer pre);

// The tokenizer.ggml.pre name whose pre-tokenizer splits with exactly `regexes` (a tokenizer.json's
// own, in Hugging Face's spelling), or "" when GGUF has no name for them.
std::string pre_tokenizer_name_of(const std::vector<std::string>& regexes);

// Throws Error when `regex` does not compile (PCRE2, UTF and Unicode properties).
void check_pre_tokenizer_regex(const std::string& regex);

// `text` in Unicode normalization form C; invalid UTF-8 is returned unchanged.
std::string nfc_normalize(std::string_view text);

// Splits text into words with the pre-tokenizer's regular expressions, applied in sequence
// (each splits every piece into matches and the gaps between them, Hugging Face's "Isolated").
std::vector<std::string> pre_tokenize(PreTokenizer pre, std::string_view text);
std::vector<std::string> pre_tokenize(const std::vector<std::string>& regexes, std::string_view text);

}  // namespace serval
