// UTF-8 helpers: code point iteration, encoding, and an incremental decoder for streaming text.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace serval {

// Length in bytes of the valid UTF-8 sequence starting at s[pos], or 0 if it is invalid/truncated.
size_t utf8_sequence_length(std::string_view s, size_t pos);

// Splits `s` into UTF-8 characters; an invalid byte becomes a one-byte piece of its own.
std::vector<std::string_view> utf8_split_chars(std::string_view s);

// Encodes one code point as UTF-8.
std::string utf8_encode(uint32_t code_point);

// Decodes `s` to code points; invalid bytes become U+FFFD.
std::vector<uint32_t> utf8_decode(std::string_view s);

// Streams text out of a byte stream without ever emitting a broken UTF-8 sequence:
// push bytes, get back the longest complete prefix; an incomplete tail waits for more bytes,
// and bytes that can never form a valid sequence come out as U+FFFD.
class Utf8StreamDecoder {
 public:
  // Appends bytes and returns the text that is now complete.
  std::string push(std::string_view bytes);
  // Returns whatever is left (an incomplete tail becomes U+FFFD).
  std::string flush();

 private:
  std::string pending_;
};

}  // namespace serval
