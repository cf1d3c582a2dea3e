// UTF-8 helpers and the streaming decoder: never emits a broken sequence.
#include <gtest/gtest.h>

#include "base/utf8.h"

namespace serval {
namespace {

TEST(Utf8, SequenceLengthsAndInvalidBytes) {
  EXPECT_EQ(utf8_sequence_length("a", 0), 1u);
  EXPECT_EQ(utf8_sequence_length("\xC3\xA9", 0), 2u);
  EXPECT_EQ(utf8_sequence_length("\xE4\xBD\xA0", 0), 3u);
  EXPECT_EQ(utf8_sequence_length("\xF0\x9F\x98\x80", 0), 4u);
  EXPECT_EQ(utf8_sequence_length("\xC3", 0), 0u);          // truncated
  EXPECT_EQ(utf8_sequence_length("\xC0\xAF", 0), 0u);      // overlong
  EXPECT_EQ(utf8_sequence_length("\xED\xA0\x80", 0), 0u);  // surrogate
  EXPECT_EQ(utf8_sequence_length("\x80", 0), 0u);
  EXPECT_EQ(utf8_decode("a\xFF" "b"), (std::vector<uint32_t>{'a', 0xFFFD, 'b'}));
  EXPECT_EQ(utf8_encode(0x1F600), "\xF0\x9F\x98\x80");
}

TEST(Utf8, StreamDecoderHoldsIncompleteSequences) {
  Utf8StreamDecoder d;
  EXPECT_EQ(d.push("a\xF0\x9F"), "a");
  EXPECT_EQ(d.push("\x98"), "");
  EXPECT_EQ(d.push("\x80!"), "\xF0\x9F\x98\x80!");
  EXPECT_EQ(d.flush(), "");
}

TEST(Utf8, StreamDecoderReplacesInvalidBytes) {
  Utf8StreamDecoder d;
  EXPECT_EQ(d.push("\xFFx"), "\xEF\xBF\xBDx");
  EXPECT_EQ(d.push("\xE4\xBD"), "");
  EXPECT_EQ(d.push("y"), "\xEF\xBF\xBDy");  // a sequence cut short by an ASCII byte
  EXPECT_EQ(d.push("\xC3"), "");
  EXPECT_EQ(d.flush(), "\xEF\xBF\xBD");
}

TEST(Utf8, ByteByByteStreamingEqualsWholeText) {
  const std::string text = "h\xC3\xA9llo \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80 end";
  Utf8StreamDecoder d;
  std::string out;
  for (char c : text) {
    const std::string chunk = d.push(std::string(1, c));
    for (size_t i = 0; i < chunk.size(); i += utf8_sequence_length(chunk, i)) ASSERT_GT(utf8_sequence_length(chunk, i), 0u);
    out += chunk;
  }
  EXPECT_EQ(out + d.flush(), text);
}

}  // namespace
}  // namespace serval
