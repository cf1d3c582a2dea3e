// Reasoning output split from the answer (src/server/reasoning.h). Expected splits are written out by
// hand from the formats' rules (vLLM's deepseek_r1 and qwen3 parsers); then every way of cutting each
// output into two or three streamed pieces must give the same split, with no thinking after the answer
// has started.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/reasoning.h"

namespace serval {
namespace {

constexpr auto R1 = ReasoningFormat::DeepSeekR1, Q3 = ReasoningFormat::Qwen3, None = ReasoningFormat::None,
               Oss = ReasoningFormat::GptOss;

struct Case {
  const char* what;
  ReasoningFormat format;
  bool prompt_open;
  std::string output, reasoning, content;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"qwen3 thinks, then answers", Q3, false, "<think>\nPlan: add.\n</think>\n\nThe sum is 3.", "Plan: add.",
       "The sum is 3."},
      {"qwen3 without thinking", Q3, false, "The sum is 3.", "", "The sum is 3."},
      {"qwen3 answer that only starts like the tag", Q3, false, "<thinking is fun", "", "<thinking is fun"},
      {"qwen3: tags inside code in the answer are text", Q3, false,
       "Use tags:\n```html\n<think>x</think>\n```", "", "Use tags:\n```html\n<think>x</think>\n```"},
      {"qwen3: a template pre-filled <think>", Q3, true, "Plan.\n</think>\n\nDone.", "Plan.", "Done."},
      {"qwen3: thinking that never closes stays thinking", Q3, false, "<think>\nStill going", "Still going", ""},
      {"qwen3: empty thinking (enable_thinking off writes it into the prompt)", Q3, false,
       "<think>\n\n</think>\n\nHi.", "", "Hi."},
      {"deepseek_r1: the template opened <think>", R1, false, "Plan.</think>Answer.", "Plan.", "Answer."},
      {"deepseek_r1: the model writes <think> itself", R1, false, "<think>\nPlan.\n</think>\n\nAnswer.", "Plan.",
       "Answer."},
      {"deepseek_r1: no closing tag, all thinking", R1, false, "Plan, and more plan", "Plan, and more plan", ""},
      {"deepseek_r1: a second <think> is text", R1, false, "<think><think>x</think>y", "<think>x", "y"},
      {"thinking holds what only looks like the closing tag", R1, false, "a </thinker> b </think>c",
       "a </thinker> b", "c"},
      {"code inside the thinking keeps its blanks", Q3, false, "<think>\n  if x:\n    y\n</think>ok",
       "if x:\n    y", "ok"},
      {"UTF-8 on both sides", Q3, false, "<think>Überlegung ✓</think> Antwort 答", "Überlegung ✓", "Antwort 答"},
      {"no parser: everything is content", None, false, "<think>Plan</think>Answer", "", "<think>Plan</think>Answer"},
      // OpenAI's harmony format (gpt-oss): the two output examples of OpenAI's harmony guide
      // (cookbook.openai.com/articles/openai-harmony, a reply and a function call); analysis is the thinking.
      {"gpt_oss: analysis then final", Oss, false,
       "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.<|end|>"
       "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
       "User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.", "2 + 2 = 4."},
      // A message to a recipient is a tool call: it stays in the answer whole, for the harmony tool parser.
      {"gpt_oss: analysis then a call on the commentary channel", Oss, false,
       "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>"
       "commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}<|call|>",
       "Need to use function get_weather.",
       "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}<|call|>"},
      {"gpt_oss: analysis cut off by the token limit", Oss, false, "<|channel|>analysis<|message|>Thinking on",
       "Thinking on", ""},
      {"gpt_oss: text that only looks like a marker stays", Oss, false,
       "<|channel|>final<|message|>a < b and <|x|> stays<|return|>", "", "a < b and <|x|> stays"},
      {"gpt_oss: output that is not harmony is the answer", Oss, false, "Plain answer.", "", "Plain answer."},
  };
  return all;
}

// Splits `output` streamed as the pieces between `cuts`; checks the thinking never follows the answer.
ReasoningParts split(const Case& c, const std::vector<size_t>& cuts) {
  ReasoningSplitter s(c.format, c.prompt_open);
  ReasoningParts all;
  size_t from = 0;
  auto add = [&](const ReasoningParts& p) {
    EXPECT_TRUE(p.reasoning.empty() || all.content.empty()) << c.what << ": thinking after the answer began";
    all += p;
  };
  for (size_t cut : cuts) {
    add(s.push(std::string_view(c.output).substr(from, cut - from)));
    from = cut;
  }
  add(s.push(std::string_view(c.output).substr(from)));
  add(s.finish());
  return all;
}

TEST(Reasoning, WholeOutputsSplitAsTheFormatsSay) {
  for (const Case& c : cases()) {
    const ReasoningParts p = split(c, {});
    EXPECT_EQ(p.reasoning, c.reasoning) << c.what;
    EXPECT_EQ(p.content, c.content) << c.what;
  }
}

TEST(Reasoning, EveryTwoAndThreePieceStreamSplitsTheSame) {
  for (const Case& c : cases()) {
    const size_t n = c.output.size();
    for (size_t i = 0; i <= n; ++i) {
      const ReasoningParts two = split(c, {i});
      ASSERT_EQ(two.reasoning, c.reasoning) << c.what << " cut at " << i;
      ASSERT_EQ(two.content, c.content) << c.what << " cut at " << i;
      for (size_t j = i; j <= n; ++j) {
        const ReasoningParts three = split(c, {i, j});
        ASSERT_EQ(three.reasoning, c.reasoning) << c.what << " cut at " << i << ", " << j;
        ASSERT_EQ(three.content, c.content) << c.what << " cut at " << i << ", " << j;
      }
    }
  }
}

TEST(Reasoning, ByteAtATimeShowsTheAnswerAsItComes) {
  // One byte at a time: nothing of the answer is held back once it has started.
  ReasoningSplitter s(Q3, false);
  const std::string out = "<think>p</think>abc";
  std::string shown;
  for (size_t k = 0; k < out.size(); ++k) {
    shown += s.push(out.substr(k, 1)).content;
    if (k >= out.find('a')) EXPECT_EQ(shown, out.substr(out.find('a'), k + 1 - out.find('a')));
  }
  EXPECT_TRUE(s.finish().content.empty());
}

TEST(Reasoning, PromptOpensThinkingOnlyWhenItEndsInsideTheTag) {
  EXPECT_TRUE(prompt_opens_thinking("<|im_start|>assistant\n<think>\n"));
  EXPECT_TRUE(prompt_opens_thinking("<｜Assistant｜><think>"));
  EXPECT_FALSE(prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n"));  // thinking off
  EXPECT_FALSE(prompt_opens_thinking("user: what does <think> mean?\nassistant:"));
  EXPECT_FALSE(prompt_opens_thinking("<|im_start|>assistant\n"));
}

TEST(Reasoning, NamesAreVllmsAndLlamaCpps) {
  EXPECT_EQ(reasoning_format_from_name("deepseek_r1"), R1);
  EXPECT_EQ(reasoning_format_from_name("qwen3"), Q3);
  EXPECT_EQ(reasoning_format_from_name("deepseek"), Q3);
  EXPECT_EQ(reasoning_format_from_name("auto"), Q3);
  EXPECT_EQ(reasoning_format_from_name("none"), None);
  EXPECT_EQ(reasoning_format_from_name("gpt_oss"), Oss);
  EXPECT_FALSE(reasoning_format_from_name("deepseek-legacy").has_value());
  EXPECT_FALSE(reasoning_format_from_name("").has_value());
}

}  // namespace
}  // namespace serval
