#include "server/reasoning.h"

#include <algorithm>

namespace serval {

namespace {

constexpr std::string_view kOpen = "<think>", kClose = "</think>";
// OpenAI's harmony format (gpt-oss): every marker starts with "<|".
constexpr std::string_view kMessage = "<|message|>", kChannel = "<|channel|>", kMarkerStart = "<|";
constexpr std::string_view kMessageEnds[] = {"<|end|>", "<|return|>", "<|call|>"};

bool blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string_view trim_front(std::string_view s) {
  while (!s.empty() && blank(s.front())) s.remove_prefix(1);
  return s;
}

std::string_view trim_back(std::string_view s) {
  while (!s.empty() && blank(s.back())) s.remove_suffix(1);
  return s;
}

// The length of the longest end of `s` that `tag` starts with (a tag that may be cut between pieces).
size_t partial_tag_at_end(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  return 0;
}

}  // namespace

std::optional<ReasoningFormat> reasoning_format_from_name(std::string_view name) {
  struct Entry {
    std::string_view name;
    ReasoningFormat format;
  };
  static constexpr Entry kNames[] = {{"none", ReasoningFormat::None},       {"deepseek_r1", ReasoningFormat::DeepSeekR1},
                                     {"qwen3", ReasoningFormat::Qwen3},     {"deepseek", ReasoningFormat::Qwen3},
                                     {"auto", ReasoningFormat::Qwen3},      {"gpt_oss", ReasoningFormat::GptOss}};
  for (const Entry& e : kNames)
    if (e.name == name) return e.format;
  return std::nullopt;
}

const char* reasoning_format_names() {
  return "deepseek_r1, qwen3, gpt_oss (vLLM's names), deepseek, auto, none (llama.cpp's)";
}

bool prompt_opens_thinking(std::string_view prompt) {
  const size_t open = prompt.rfind(kOpen);
  return open != std::string_view::npos && trim_front(prompt.substr(open + kOpen.size())).empty();
}

ReasoningSplitter::ReasoningSplitter(ReasoningFormat format, bool prompt_open)
    : state_(format == ReasoningFormat::None     ? State::Answer
             : format == ReasoningFormat::GptOss ? State::Header
             : format == ReasoningFormat::DeepSeekR1 || prompt_open ? State::Start
                                                                  : State::Undecided) {}

ReasoningParts ReasoningSplitter::push(std::string_view text) {
  ReasoningParts out;
  held_ += text;
  step(out);
  return out;
}

// Harmony: a header names the message's channel; its text goes to the thinking (analysis) or the answer.
// Output that does not start with a marker is not harmony: all of it is the answer.
bool ReasoningSplitter::step_harmony(ReasoningParts& out) {
  if (state_ == State::Header) {
    const std::string_view t = trim_front(held_);
    if (t.substr(0, std::min(t.size(), kMarkerStart.size())) != kMarkerStart.substr(0, std::min(t.size(), kMarkerStart.size()))) {
      state_ = State::Answer;
      return true;
    }
    const size_t message = held_.find(kMessage);
    if (message == std::string::npos) return false;  // the header is not whole yet
    const std::string_view header = std::string_view(held_).substr(0, message);
    const size_t channel = header.find(kChannel);
    body_is_call_ = header.find(" to=") != std::string_view::npos || trim_front(header).starts_with("to=");
    body_is_thinking_ = !body_is_call_ && channel != std::string_view::npos &&
                        header.substr(channel + kChannel.size(), 8) == "analysis";
    if (body_is_call_) out.content += held_.substr(0, message + kMessage.size());
    held_.erase(0, message + kMessage.size());
    state_ = State::Body;
    return true;
  }
  std::string& to = body_is_thinking_ ? out.reasoning : out.content;
  size_t end = std::string::npos, end_size = 0;
  for (std::string_view marker : kMessageEnds)
    if (const size_t at = held_.find(marker); at < end) {
      end = at;
      end_size = marker.size();
    }
  if (end != std::string::npos) {
    to += held_.substr(0, body_is_call_ ? end + end_size : end);  // a call keeps its <|call|>
    held_.erase(0, end + end_size);
    state_ = State::Header;
    return true;
  }
  size_t keep = 0;  // a marker that may be cut between pieces
  for (std::string_view marker : kMessageEnds) keep = std::max(keep, partial_tag_at_end(held_, marker));
  to += held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return false;
}

// Moves what is decided from held_ to `out`, state by state, until the rest must wait for more text.
void ReasoningSplitter::step(ReasoningParts& out) {
  for (;;) {
    switch (state_) {
      case State::Header:
      case State::Body:
        if (!step_harmony(out)) return;
        break;
      case State::Undecided: {  // does the output open with <think>?
        const std::string_view t = trim_front(held_);
        if (t.substr(0, kOpen.size()) == kOpen) {
          held_ = std::string(t.substr(kOpen.size()));
          opened_ = true;
          state_ = State::Start;
        } else if (kOpen.substr(0, t.size()) == t) {
          return;  // blanks, or the start of <think>
        } else {
          state_ = State::Answer;
        }
        break;
      }
      case State::Start: {  // blanks, and a <think> the model writes although the prompt opened one
        std::string_view t = trim_front(held_);
        if (!opened_ && t.substr(0, kOpen.size()) == kOpen) {
          t = trim_front(t.substr(kOpen.size()));
          opened_ = true;
        }
        if (t.empty() || (!opened_ && kOpen.substr(0, t.size()) == t)) {
          held_ = std::string(t);
          return;
        }
        held_ = std::string(t);
        state_ = State::Thinking;
        break;
      }
      case State::Thinking: {
        if (const size_t close = held_.find(kClose); close != std::string::npos) {
          out.reasoning += trim_back(std::string_view(held_).substr(0, close));
          held_.erase(0, close + kClose.size());
          state_ = State::After;
          break;
        }
        // Hold back a possible start of </think> and the blanks before it (dropped if the tag comes).
        const std::string_view head = std::string_view(held_).substr(0, held_.size() - partial_tag_at_end(held_, kClose));
        const size_t shown = trim_back(head).size();
        out.reasoning += held_.substr(0, shown);
        held_.erase(0, shown);
        return;
      }
      case State::After: {
        held_ = std::string(trim_front(held_));
        if (held_.empty()) return;
        state_ = State::Answer;
        break;
      }
      case State::Answer:
        out.content += held_;
        held_.clear();
        return;
    }
  }
}

ReasoningParts ReasoningSplitter::finish() {
  ReasoningParts out;
  if (state_ == State::Undecided || state_ == State::Answer) out.content = std::move(held_);
  else if (state_ == State::Body) (body_is_thinking_ ? out.reasoning : out.content) = std::move(held_);
  else if (state_ != State::After && state_ != State::Header) out.reasoning = std::move(held_);  // thinking that never closed
  held_.clear();
  return out;
}

}  // namespace serval
