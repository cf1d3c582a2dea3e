#include "tokenizer/wordpiece.h"

#include <utf8proc.h>

#include "base/utf8.h"

namespace serval {
namespace {

// Unicode's White_Space property (Rust's char::is_whitespace, which the reference uses).
bool is_whitespace(uint32_t c) {
  return c == ' ' || (c >= 0x9 && c <= 0xD) || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// "Other" characters (Cc, Cf, Co, Cs, Cn) except tab and newlines, as BertNormalizer's is_control.
bool is_control(uint32_t c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  switch (utf8proc_category(utf8proc_int32_t(c))) {
    case UTF8PROC_CATEGORY_CC: case UTF8PROC_CATEGORY_CF: case UTF8PROC_CATEGORY_CO: case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CN:
      return true;
    default:
      return false;
  }
}

bool is_punctuation(uint32_t c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126)) return true;
  switch (utf8proc_category(utf8proc_int32_t(c))) {
    case UTF8PROC_CATEGORY_PC: case UTF8PROC_CATEGORY_PD: case UTF8PROC_CATEGORY_PS: case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI: case UTF8PROC_CATEGORY_PF: case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

// Nonspacing marks (Mn) only: spacing marks such as Devanagari's vowel signs stay.
bool is_nonspacing_mark(uint32_t c) { return utf8proc_category(utf8proc_int32_t(c)) == UTF8PROC_CATEGORY_MN; }

// The CJK Unified Ideographs blocks BERT treats as words of their own.
bool is_chinese_char(uint32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// The canonical decomposition of one code point (itself when it has none).
void append_nfd(uint32_t c, std::vector<uint32_t>& out) {
  utf8proc_int32_t buf[32];
  int last = 0;
  const utf8proc_ssize_t n = utf8proc_decompose_char(utf8proc_int32_t(c), buf, 32, UTF8PROC_DECOMPOSE, &last);
  if (n <= 0 || n > 32) {
    out.push_back(c);
    return;
  }
  for (utf8proc_ssize_t i = 0; i < n; ++i) out.push_back(uint32_t(buf[i]));
}

// Lowercase as Rust's char::to_lowercase (the one multi-character mapping is U+0130).
void append_lower(uint32_t c, std::vector<uint32_t>& out) {
  if (c == 0x130) {
    out.push_back('i');
    out.push_back(0x307);
    return;
  }
  out.push_back(uint32_t(utf8proc_tolower(utf8proc_int32_t(c))));
}

std::vector<uint32_t> normalize(std::string_view text, const WordPieceOptions& o) {
  std::vector<uint32_t> cps;
  for (uint32_t c : utf8_decode(text)) {
    if (o.clean_text) {
      if (c == 0 || c == 0xFFFD || is_control(c)) continue;
      if (is_whitespace(c)) c = ' ';
    }
    if (o.chinese_chars && is_chinese_char(c)) {
      cps.insert(cps.end(), {' ', c, ' '});
      continue;
    }
    cps.push_back(c);
  }
  if (o.strip_accents) {
    std::vector<uint32_t> out;
    for (uint32_t c : cps) append_nfd(c, out);
    std::erase_if(out, is_nonspacing_mark);
    cps = std::move(out);
  }
  if (o.lowercase) {
    std::vector<uint32_t> out;
    for (uint32_t c : cps) append_lower(c, out);
    cps = std::move(out);
  }
  return cps;
}

}  // namespace

std::vector<std::string> wordpiece_words(std::string_view text, const WordPieceOptions& options) {
  std::vector<std::string> words;
  std::string word;
  auto flush = [&] {
    if (!word.empty()) words.push_back(std::move(word));
    word.clear();
  };
  for (uint32_t c : normalize(text, options)) {
    if (is_whitespace(c)) {
      flush();
    } else if (is_punctuation(c)) {
      flush();
      words.push_back(utf8_encode(c));
    } else {
      word += utf8_encode(c);
    }
  }
  flush();
  return words;
}

std::string wordpiece_to_phantom(const std::string& t) {
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') return t;
  if (t.rfind("##", 0) == 0) return t.substr(2);
  return "\xE2\x96\x81" + t;
}

}  // namespace serval
