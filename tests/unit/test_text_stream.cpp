// ChoiceText: a choice's tokens as text. Control tokens add nothing unless the request's parsers read
// them (gpt-oss's harmony markers are control tokens): then they appear as their text, and a harmony
// output decoded so splits and parses as its text does.
#include <gtest/gtest.h>

#include "io/gguf.h"
#include "server/reasoning.h"
#include "server/text_stream.h"
#include "server/tool_calls.h"
#include "test_support.h"
#include "tokenizer/load.h"

namespace serval {
namespace {

TEST(ChoiceText, ControlTokensRenderOnlyWhenAsked) {
  const std::string path = test::cached_model("qwen2.5-coder-0.5b-instruct");
  ASSERT_FALSE(path.empty()) << "run scripts/setup";
  const Tokenizer tok(vocab_from_gguf(GgufFile(path)));
  const auto ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>", false, /*parse_special=*/true);
  ASSERT_EQ(ids.size(), 5u);  // <|im_start|>, assistant, \n, Hi, <|im_end|>
  auto text_of = [&](bool special) {
    ChoiceText t(tok, {}, special);
    std::string out;
    for (int32_t id : ids) out += t.push(id);
    return out + t.finish();
  };
  EXPECT_EQ(text_of(false), "assistant\nHi");
  EXPECT_EQ(text_of(true), "<|im_start|>assistant\nHi<|im_end|>");
}

// The pipeline of a gpt-oss chat reply with tools (reasoning parser gpt_oss, harmony tool format): the
// rendered text, split in pieces, leaves the thinking in reasoning and a parsable call in the answer.
TEST(ChoiceText, HarmonyReplySplitsAndParses) {
  const std::string out = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                          "to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>";
  ReasoningSplitter split(ReasoningFormat::GptOss, false);
  ReasoningParts parts;
  for (size_t i = 0; i < out.size(); i += 7) parts += split.push(out.substr(i, 7));
  parts += split.finish();
  EXPECT_EQ(parts.reasoning, "Need the weather.");
  const auto tools = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])");
  const ParsedToolOutput p = parse_tool_calls(parts.content, ToolFormat::Harmony, tools);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(p.content, "");
}

}  // namespace
}  // namespace serval
