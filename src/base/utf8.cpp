#include "base/utf8.h"

namespace serval {

size_t utf8_sequence_length(std::string_view s, size_t pos) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t c = b(pos);
  size_t len;
  uint32_t min_cp;
  uint32_t cp;
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) { len = 2; min_cp = 0x80; cp = c & 0x1F; }
  else if ((c & 0xF0) == 0xE0) { len = 3; min_cp = 0x800; cp = c & 0x0F; }
  else if ((c & 0xF8) == 0xF0) { len = 4; min_cp = 0x10000; cp = c & 0x07; }
  else return 0;
  if (pos + len > s.size()) return 0;
  for (size_t i = 1; i < len; ++i) {
    if ((b(pos + i) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(pos + i) & 0x3F);
  }
  if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

std::vector<std::string_view> utf8_split_chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t pos = 0; pos < s.size();) {
    size_t len = utf8_sequence_length(s, pos);
    if (len == 0) len = 1;
    out.push_back(s.substr(pos, len));
    pos += len;
  }
  return out;
}

std::string utf8_encode(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t pos = 0; pos < s.size();) {
    size_t len = utf8_sequence_length(s, pos);
    if (len == 0) {
      out.push_back(0xFFFD);
      ++pos;
      continue;
    }
    uint32_t cp = static_cast<uint8_t>(s[pos]);
    if (len > 1) {
      cp &= (0x7F >> len);
      for (size_t i = 1; i < len; ++i) cp = (cp << 6) | (static_cast<uint8_t>(s[pos + i]) & 0x3F);
    }
    out.push_back(cp);
    pos += len;
  }
  return out;
}

// True when s[pos..] is a proper prefix of some valid UTF-8 sequence (more bytes may complete it).
static bool is_incomplete_prefix(std::string_view s, size_t pos) {
  const uint8_t c = static_cast<uint8_t>(s[pos]);
  size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
  if (need == 0 || pos + need <= s.size()) return false;
  for (size_t i = pos + 1; i < s.size(); ++i)
    if ((static_cast<uint8_t>(s[i]) & 0xC0) != 0x80) return false;
  return true;
}

// Bytes to replace with one U+FFFD at an invalid sequence: the lead byte and the continuation
// bytes that follow it within the length it announces (the "maximal subpart").
static size_t invalid_run_length(std::string_view s, size_t pos) {
  const uint8_t c = static_cast<uint8_t>(s[pos]);
  const size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
  size_t n = 1;
  while (n < need && pos + n < s.size() && (static_cast<uint8_t>(s[pos + n]) & 0xC0) == 0x80) ++n;
  return n;
}

std::string Utf8StreamDecoder::push(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  size_t pos = 0;
  while (pos < pending_.size()) {
    size_t len = utf8_sequence_length(pending_, pos);
    if (len > 0) {
      out.append(pending_, pos, len);
      pos += len;
    } else if (is_incomplete_prefix(pending_, pos)) {
      break;
    } else {
      out += "\xEF\xBF\xBD";
      pos += invalid_run_length(pending_, pos);
    }
  }
  pending_.erase(0, pos);
  return out;
}

std::string Utf8StreamDecoder::flush() {
  std::string out = pending_.empty() ? "" : "\xEF\xBF\xBD";
  pending_.clear();
  return out;
}

}  // namespace serval
