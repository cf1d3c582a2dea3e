// Reasoning output: a reasoning model's thinking (`<think> ... </think>`) split from its answer, as
// vLLM's --reasoning-parser and llama-server's --reasoning-format do, so that chat replies carry it in
// `message.reasoning_content` (`delta.reasoning_content` when streaming) and the answer in `content`.
// No I/O: the splitter takes the decoded text as it streams, a piece at a time, and gives back the same
// split whatever the pieces (a tag cut between two pieces is held back until it is whole).
#pragma once
#include <optional>
#include <string>
#include <string_view>

namespace serval {

enum class ReasoningFormat {
  None,        // no parser: the thinking stays in `content` (the default; llama.cpp's "none")
  DeepSeekR1,  // vLLM's deepseek_r1: the output starts inside the thinking (R1's template opens
               // <think> in the prompt; a <think> the model writes anyway is dropped) until </think>
  Qwen3,       // vLLM's qwen3 (llama.cpp's deepseek/auto): thinking only when the output starts with
               // <think>, or the prompt ends inside an open <think> (a template that pre-fills it)
  GptOss,      // vLLM's gpt_oss: OpenAI's harmony format, messages `<|channel|>NAME<|message|>TEXT<|end|>`;
               // the analysis channel is the thinking, the others (final, commentary) the answer; a
               // message to a recipient (` to=functions.NAME`, a tool call) stays in the answer as written
};

// "deepseek_r1", "qwen3", "gpt_oss" (vLLM), "deepseek", "auto" (llama.cpp: Qwen3's rule), "none";
// nullopt for a name Serval does not know.
std::optional<ReasoningFormat> reasoning_format_from_name(std::string_view name);
const char* reasoning_format_names();  // for help and error messages

// True when `prompt` (a rendered chat prompt) ends inside a <think> that it opened and did not close:
// the model's output then starts in its thinking.
bool prompt_opens_thinking(std::string_view prompt);

struct ReasoningParts {
  std::string reasoning, content;
  ReasoningParts& operator+=(const ReasoningParts& o) {
    reasoning += o.reasoning;
    content += o.content;
    return *this;
  }
};

class ReasoningSplitter {
 public:
  // `prompt_open`: the prompt ended inside <think> (prompt_opens_thinking).
  ReasoningSplitter(ReasoningFormat format, bool prompt_open);
  // Adds decoded text; returns what can be shown now.
  ReasoningParts push(std::string_view text);
  // The end of the output: what was held back. Thinking that never closed stays thinking.
  ReasoningParts finish();

 private:
  enum class State {
    Undecided,  // Qwen3's rule, before the output shows whether it starts with <think>
    Start,      // inside the thinking, before its first visible character (leading blanks dropped)
    Thinking,   // inside the thinking
    After,      // just past </think>: blanks before the answer are dropped
    Answer,     // the answer: passed through as it comes
    Header,     // harmony: a message's header (`<|start|>assistant<|channel|>analysis`), up to <|message|>
    Body,       // harmony: a message's text, up to <|end|>, <|return|> or <|call|>
  };
  bool body_is_thinking_ = false;  // harmony: the message being read is on the analysis channel
  bool body_is_call_ = false;      // harmony: it is addressed to a recipient (to=functions.NAME): a tool call,
                                   // which goes to the answer whole (header, body, <|call|>) for the tool parser
  State state_;
  bool opened_ = false;  // the output's own <think> was read (a second one is text)
  std::string held_;  // text not yet shown: a possible tag, or blanks that may come before </think>
  void step(ReasoningParts& out);
  bool step_harmony(ReasoningParts& out);  // Header and Body; false: wait for more text
};

}  // namespace serval
