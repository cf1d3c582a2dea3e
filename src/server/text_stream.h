// Turning a choice's tokens into text as it streams: UTF-8-safe incremental detokenization and stop
// strings matched across token boundaries (never emitted, not even in part).
#pragma once
#include <string>
#include <vector>

#include "base/utf8.h"
#include "tokenizer/tokenizer.h"

namespace serval {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Adds text; returns what can be shown now. Sets stopped() when a stop string appeared (the text
  // before it is returned, the stop string and anything after it are dropped).
  std::string push(const std::string& text);
  // What is held back (a possible start of a stop string) once the stream ends without a stop.
  std::string flush();
  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }  // the stop string that appeared (first listed on a tie)

 private:
  std::vector<std::string> stops_;
  std::string pending_, matched_;
  bool stopped_ = false;
};

class ChoiceText {
 public:
  // render_special: control tokens appear as their text (gpt-oss's harmony markers, which the reasoning
  // and tool parsers read); otherwise they add nothing, as usual.
  ChoiceText(const Tokenizer& tok, std::vector<std::string> stops, bool render_special = false)
      : tok_(tok), stop_(std::move(stops)), render_special_(render_special) {}
  // The text that token `id` makes visible (maybe empty while a character or a stop string is incomplete).
  std::string push(int32_t id);
  std::string finish();
  bool stopped() const { return stop_.stopped(); }
  const std::string& stop_string() const { return stop_.matched(); }

 private:
  const Tokenizer& tok_;
  Utf8StreamDecoder utf8_;
  StopMatcher stop_;
  bool render_special_ = false;
};

}  // namespace serval
