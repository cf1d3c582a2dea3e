#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pretokenize.h"

#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include <fmt/format.h>

#include "base/error.h"
#include "base/utf8.h"

namespace serval {
namespace {

const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* kLlama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kQwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// gpt-4o / gpt-oss (o200k): case-aware words with their contractions, digits in threes.
const char* kGpt4o =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// DeepSeek-V2 (deepseek-llm): its letter class is Unicode's cased letters (LC) as explicit ranges.
const char* kDeepseekLetters = R"(\s?[\x{41}-\x{5A}\x{61}-\x{7A}\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}-\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}-\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}-\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)";
const char* kDeepseekPunct = R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)";

// The same splits as Hugging Face tokenizer.json files spell them (a case-insensitive group for the
// contractions): what pre_tokenizer_name_of recognizes.
const char* kLlama3Hf =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kQwen2Hf =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> patterns(PreTokenizer pre) {
  switch (pre) {
    case PreTokenizer::None: return {};
    case PreTokenizer::Gpt2: return {kGpt2};
    case PreTokenizer::Llama3: return {kLlama3};
    case PreTokenizer::Qwen2: return {kQwen2};
    case PreTokenizer::Starcoder: return {R"(\p{N})", kGpt2};
    case PreTokenizer::DeepseekCoder:
      return {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", R"(\p{N})"};
    case PreTokenizer::DeepseekLlm:
      return {R"([\r\n])", kDeepseekLetters, kDeepseekPunct, R"(\s+$)",
              R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)", R"(\p{N}+)"};
    case PreTokenizer::Gpt4o: return {kGpt4o};
  }
  return {};
}

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
using Code = std::unique_ptr<pcre2_code, CodeDeleter>;

Code compile(const std::string& pattern, std::string* error) {
  int err = 0;
  PCRE2_SIZE err_off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    *error = fmt::format("at offset {}: {}", err_off, reinterpret_cast<char*>(msg));
  }
  return Code(code);
}

// Compiled patterns are cached for the process (compilation is not free; matching is thread-safe).
pcre2_code* compiled(const std::string& pattern) {
  static std::mutex mu;
  static std::map<std::string, Code> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(pattern);
  if (it != cache.end()) return it->second.get();
  std::string error;
  Code code = compile(pattern, &error);
  check(code != nullptr, "pre-tokenizer regex does not compile {}", error);
  pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE);
  return cache.emplace(pattern, std::move(code)).first->second.get();
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
      {"deepseek-coder", PreTokenizer::DeepseekCoder}, {"deepseek-llm", PreTokenizer::DeepseekLlm},
      {"gpt-4o", PreTokenizer::Gpt4o},
  };
  auto it = names.find(name);
  if (it == names.end()) fail("unsupported pre-tokenizer '{}' (tokenizer.ggml.pre)", name);
  return it->second;
}

std::vector<std::string> pre_tokenizer_regexes(PreTokenizer pre) { return patterns(pre); }

namespace {
// One spelling of a regex for comparison: \x{H} escapes and \r, \n written as the characters.
std::string canonical_spelling(const std::string& re) {
  std::string out;
  for (size_t i = 0; i < re.size(); ++i) {
    if (re[i] != '\\' || i + 1 == re.size()) {
      out += re[i];
      continue;
    }
    const char n = re[i + 1];
    const size_t close = re.find('}', i);
    uint32_t cp = 0;
    bool hex = n == 'x' && i + 2 < re.size() && re[i + 2] == '{' && close != std::string::npos && close > i + 3 &&
               close - i <= 9;
    for (size_t k = i + 3; hex && k < close; ++k) {
      const char d = re[k];
      hex = std::isxdigit(static_cast<unsigned char>(d)) != 0;
      cp = cp * 16 + uint32_t(std::isdigit(static_cast<unsigned char>(d)) ? d - '0' : (d | 0x20) - 'a' + 10);
    }
    if (hex && cp <= 0x10FFFF) {
      out += utf8_encode(cp);
      i = close;
    } else {
      out += n == 'r' ? std::string("\r") : n == 'n' ? std::string("\n") : std::string{'\\', n};
      ++i;
    }
  }
  return out;
}

std::vector<std::string> canonical_spellings(const std::vector<std::string>& regexes) {
  std::vector<std::string> out;
  for (const auto& r : regexes) out.push_back(canonical_spelling(r));
  return out;
}
}  // namespace

std::string pre_tokenizer_name_of(const std::vector<std::string>& given) {
  const auto regexes = canonical_spellings(given);
  static const std::vector<std::pair<std::vector<std::string>, std::string>> known = {
      {{kQwen2Hf}, "qwen2"}, {{kLlama3Hf}, "llama-bpe"}, {{kGpt2}, "gpt-2"},
      {{kQwen2}, "qwen2"},   {{kLlama3}, "llama-bpe"},   {patterns(PreTokenizer::Starcoder), "starcoder"},
      {patterns(PreTokenizer::DeepseekCoder), "deepseek-coder"}, {{kGpt4o}, "gpt-4o"},
      {patterns(PreTokenizer::DeepseekLlm), "deepseek-llm"}};
  for (const auto& [list, name] : known)
    if (canonical_spellings(list) == regexes) return name;
  return "";
}

std::string nfc_normalize(std::string_view text) {
  const bool ascii = std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
  if (ascii) return std::string(text);  // already NFC
  utf8proc_uint8_t* out = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), utf8proc_ssize_t(text.size()), &out,
                              utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) return std::string(text);
  std::string r(reinterpret_cast<char*>(out), size_t(n));
  std::free(out);
  return r;
}

void check_pre_tokenizer_regex(const std::string& regex) {
  std::string error;
  check(compile(regex, &error) != nullptr, "pre-tokenizer regex /{}/ does not compile {}", regex, error);
}

std::vector<std::string> pre_tokenize(PreTokenizer pre, std::string_view text) { return pre_tokenize(patterns(pre), text); }

std::vector<std::string> pre_tokenize(const std::vector<std::string>& regexes, std::string_view text) {
  std::vector<std::string> pieces{std::string(text)};
  for (const std::string& pattern : regexes) {
    pcre2_code* code = compiled(pattern);
    std::vector<std::string> next;
    for (const auto& p : pieces) split_one(code, p, next);
    pieces = std::move(next);
  }
  return pieces;
}

}  // namespace serval
