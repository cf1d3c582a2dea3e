#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pretokenize.h"

#include <pcre2.h>

#include <map>
#include <memory>
#include <mutex>

#include "base/error.h"

namespace serval {
namespace {

const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* kLlama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kQwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<const char*> patterns(PreTokenizer pre) {
  switch (pre) {
    case PreTokenizer::None: return {};
    case PreTokenizer::Gpt2: return {kGpt2};
    case PreTokenizer::Llama3: return {kLlama3};
    case PreTokenizer::Qwen2: return {kQwen2};
    case PreTokenizer::Starcoder: return {R"(\p{N})", kGpt2};
    case PreTokenizer::DeepseekCoder:
      return {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", R"(\p{N})"};
  }
  return {};
}

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
using Code = std::unique_ptr<pcre2_code, CodeDeleter>;

// Compiled patterns are cached for the process (compilation is not free; matching is thread-safe).
pcre2_code* compiled(const char* pattern) {
  static std::mutex mu;
  static std::map<const char*, Code> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(pattern);
  if (it != cache.end()) return it->second.get();
  int err = 0;
  PCRE2_SIZE err_off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail("internal: pre-tokenizer regex does not compile at {}: {}", err_off, reinterpret_cast<char*>(msg));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return cache.emplace(pattern, Code(code)).first->second.get();
}

// Splits `text` into matches of `code` and the non-empty gaps between them, in order.
void split_one(pcre2_code* code, std::string_view text, std::vector<std::string>& out) {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  size_t pos = 0, gap_start = 0;
  while (pos < text.size()) {
    int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos, 0, md, nullptr);
    if (rc < 0) break;
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    if (ov[1] == ov[0]) {  // empty match: step one byte
      pos = ov[0] + 1;
      continue;
    }
    if (ov[0] > gap_start) out.emplace_back(text.substr(gap_start, ov[0] - gap_start));
    out.emplace_back(text.substr(ov[0], ov[1] - ov[0]));
    pos = gap_start = ov[1];
  }
  if (gap_start < text.size()) out.emplace_back(text.substr(gap_start));
  pcre2_match_data_free(md);
}

}  // namespace

PreTokenizer pre_tokenizer_from_name(const std::string& name) {
  static const std::map<std::string, PreTokenizer> names = {
      {"default", PreTokenizer::Gpt2},        {"gpt-2", PreTokenizer::Gpt2},
      {"gpt2", PreTokenizer::Gpt2},           {"phi-2", PreTokenizer::Gpt2},
      {"jina-es", PreTokenizer::Gpt2},        {"jina-de", PreTokenizer::Gpt2},
      {"roberta-bpe", PreTokenizer::Gpt2},    {"olmo", PreTokenizer::Gpt2},
      {"llama-bpe", PreTokenizer::Llama3},    {"llama3", PreTokenizer::Llama3},
      {"smaug-bpe", PreTokenizer::Llama3},    {"falcon3", PreTokenizer::Llama3},
      {"pixtral", PreTokenizer::Llama3},      {"qwen2", PreTokenizer::Qwen2},
      {"deepseek-r1-qwen", PreTokenizer::Qwen2}, {"starcoder", PreTokenizer::Starcoder},
      {"refact", PreTokenizer::Starcoder},    {"command-r", PreTokenizer::Starcoder},
      {"smollm", PreTokenizer::Starcoder},    {"codeshell", PreTokenizer::Starcoder},
      {"deepseek-coder", PreTokenizer::DeepseekCoder},
  };
  auto it = names.find(name);
  if (it == names.end()) fail("unsupported pre-tokenizer '{}' (tokenizer.ggml.pre)", name);
  return it->second;
}

std::vector<std::string> pre_tokenize(PreTokenizer pre, std::string_view text) {
  std::vector<std::string> pieces{std::string(text)};
  for (const char* pattern : patterns(pre)) {
    pcre2_code* code = compiled(pattern);
    std::vector<std::string> next;
    for (const auto& p : pieces) split_one(code, p, next);
    pieces = std::move(next);
  }
  return pieces;
}

}  // namespace serval
