// Building a tokenizer from a GGUF file's metadata or from Hugging Face tokenizer files.
#pragma once
#include <string>

#include "io/gguf.h"
#include "tokenizer/tokenizer.h"

namespace serval {

// Vocabulary from tokenizer.ggml.* keys; throws Error for a missing or unsupported tokenizer.
Vocab vocab_from_gguf(const GgufFile& gguf);

// Vocabulary from a Hugging Face tokenizer.json (and tokenizer_config.json beside it, if present).
Vocab vocab_from_tokenizer_json(const std::string& tokenizer_json_path);

}  // namespace serval
