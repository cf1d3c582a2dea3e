#include "server/text_stream.h"

#include <algorithm>

namespace serval {

std::string StopMatcher::push(const std::string& text) {
  if (stopped_) return "";
  pending_ += text;
  size_t first = std::string::npos;
  for (const auto& s : stops_)
    if (const size_t at = s.empty() ? std::string::npos : pending_.find(s); at < first) {
      first = at;
      matched_ = s;
    }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first);
    pending_.clear();
    return out;
  }
  // Hold back the longest tail that could still grow into a stop string.
  size_t hold = 0;
  for (const auto& s : stops_)
    for (size_t n = std::min(s.size() - 1, pending_.size()); n > hold; --n)
      if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  std::string out = stopped_ ? "" : pending_;
  pending_.clear();
  return out;
}

std::string ChoiceText::push(int32_t id) { return stop_.push(utf8_.push(tok_.token_to_piece(id, render_special_))); }

std::string ChoiceText::finish() {
  std::string tail = stop_.push(utf8_.flush());
  return tail + stop_.flush();
}

}  // namespace serval
