// Regular expressions to GBNF: a recursive-descent parser to a small syntax tree (character sets,
// sequences, alternatives, repetitions, anchors), then one GBNF rule written from the tree.
//
// Two details of the translation:
// - A repetition without an upper bound becomes a recursive rule in GBNF, and a rule that can reach
//   itself without reading a byte is refused by the GBNF parser (left recursion). So `X*` where X
//   can match the empty string is written as `X'*`, X' being X without the empty string (the same
//   language).
// - detail::regex_to_json_string_gbnf writes the same language as the content of a JSON string:
//   `"`, `\` and control characters appear as their JSON escapes (nlohmann's canonical spelling).
#include "grammar/regex.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "base/error.h"
#include "base/utf8.h"
#include "grammar/gbnf.h"
#include "grammar/json_text.h"

namespace serval::grammar {

namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr int kMaxCount = 10000;   // the GBNF parser's limit on repetition counts
constexpr int kUnbounded = -1;
constexpr int kMaxDepth = 200;     // group nesting
constexpr size_t kInfinite = std::numeric_limits<size_t>::max();

// Sorted, disjoint, non-adjacent code-point ranges; never containing surrogates.
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

Ranges normalize(Ranges r) {
  Ranges split;
  for (auto [lo, hi] : r) {  // drop the surrogates D800..DFFF
    if (lo < 0xD800) split.push_back({lo, std::min(hi, 0xD7FFu)});
    if (hi > 0xDFFF) split.push_back({std::max(lo, 0xE000u), hi});
  }
  std::sort(split.begin(), split.end());
  Ranges out;
  for (auto [lo, hi] : split) {
    if (!out.empty() && (lo <= out.back().second + 1 || (out.back().second == 0xD7FF && lo == 0xE000))) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.push_back({lo, hi});
    }
  }
  return out;
}

Ranges complement(const Ranges& r) {
  Ranges out;
  uint32_t next = 0;
  for (auto [lo, hi] : r) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return normalize(out);
}

Ranges digit_set() { return {{'0', '9'}}; }
Ranges word_set() { return normalize({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}); }
Ranges space_set() {  // ECMAScript's \s: WhiteSpace and LineTerminator
  return normalize({{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A}, {0x2028, 0x2029},
                    {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}});
}

struct Node {
  enum Kind { Empty, Chars, Concat, Alt, Repeat, Start, End } kind = Empty;
  Ranges chars;             // Chars
  std::vector<Node> kids;   // Concat, Alt; Repeat: one
  int min = 0, max = 0;     // Repeat; max == kUnbounded: no upper bound
  size_t pos = 0;           // where it starts in the pattern (code points), for errors
};

Node make(Node::Kind kind, size_t pos, std::vector<Node> kids = {}) {
  Node n;
  n.kind = kind;
  n.pos = pos;
  n.kids = std::move(kids);
  return n;
}

Node chars(Ranges r, size_t pos) {
  Node n = make(Node::Chars, pos);
  n.chars = std::move(r);
  return n;
}

Node repeat(Node kid, int min, int max) {
  Node n = make(Node::Repeat, kid.pos, {std::move(kid)});
  n.min = min;
  n.max = max;
  return n;
}

std::vector<uint32_t> decode_pattern(std::string_view p) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < p.size();) {
    const size_t len = utf8_sequence_length(p, i);
    check(len > 0, "regex: invalid UTF-8 at byte {} of the pattern", i);
    out.push_back(utf8_decode(p.substr(i, len))[0]);
    i += len;
  }
  return out;
}

bool is_hex(uint32_t c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
bool is_digit(uint32_t c) { return c >= '0' && c <= '9'; }
bool is_ascii_alnum(uint32_t c) { return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

class Parser {
 public:
  explicit Parser(std::string_view pattern) : text_(pattern), s_(decode_pattern(pattern)) {}

  Node parse() {
    Node n = alternation();
    if (pos_ < s_.size()) error("unbalanced ')'");
    return n;
  }

  [[noreturn]] void error(std::string_view what) const { error_at(what, pos_); }
  [[noreturn]] void error_at(std::string_view what, size_t pos) const {
    fail("regex: {} at position {} of /{}/", what, pos, text_);
  }

 private:
  std::string_view text_;
  std::vector<uint32_t> s_;
  size_t pos_ = 0;
  int depth_ = 0;

  bool eof() const { return pos_ >= s_.size(); }
  uint32_t peek(size_t ahead = 0) const { return pos_ + ahead < s_.size() ? s_[pos_ + ahead] : 0; }
  bool at(uint32_t c, size_t ahead = 0) const { return pos_ + ahead < s_.size() && s_[pos_ + ahead] == c; }

  Node alternation() {
    const size_t start = pos_;
    std::vector<Node> alts{sequence()};
    while (at('|')) {
      ++pos_;
      alts.push_back(sequence());
    }
    return alts.size() == 1 ? std::move(alts[0]) : make(Node::Alt, start, std::move(alts));
  }

  Node sequence() {
    Node seq = make(Node::Concat, pos_);
    while (!eof() && !at('|') && !at(')')) {
      Node a = atom();
      quantifier(a);
      seq.kids.push_back(std::move(a));
    }
    if (seq.kids.empty()) return make(Node::Empty, seq.pos);
    return seq.kids.size() == 1 ? std::move(seq.kids[0]) : seq;
  }

  Node atom();
  Node group();
  Node char_class();
  Ranges escape(bool in_class, bool* is_set);
  uint32_t hex_escape(int digits);
  std::optional<std::pair<int, int>> counts();
  void quantifier(Node& a);
};

Node Parser::atom() {
  const size_t start = pos_;
  const uint32_t c = s_[pos_++];
  switch (c) {
    case '(': return group();
    case '[': return char_class();
    case '.': return chars(complement({{'\n', '\n'}}), start);
    case '^': return make(Node::Start, start);
    case '$': return make(Node::End, start);
    case '*': case '+': case '?': error_at("nothing to repeat", start);
    case '{':
      --pos_;
      if (counts()) error_at("nothing to repeat", start);
      error_at("a '{' that does not start a repetition must be escaped as \\{", start);
    case '\\': {
      bool is_set = false;
      return chars(escape(false, &is_set), start);
    }
    default: return chars({{c, c}}, start);
  }
}

Node Parser::group() {
  const size_t start = pos_ - 1;
  if (at('?')) {
    const uint32_t k = peek(1);
    if (k == ':') {
      pos_ += 2;
    } else if ((k == 'P' && at('<', 2)) || (k == '<' && !at('=', 2) && !at('!', 2))) {
      pos_ += k == 'P' ? 3 : 2;
      const size_t name_start = pos_;
      while (!eof() && (is_ascii_alnum(peek()) || at('_'))) ++pos_;
      if (pos_ == name_start || is_digit(s_[name_start]) || !at('>')) error("bad group name");
      ++pos_;
    } else if (k == '=' || k == '!') {
      error("lookahead assertions are not supported");
    } else if (k == '<') {
      error("lookbehind assertions are not supported");
    } else if (k == 'P' && at('=', 2)) {
      error("backreferences are not supported");
    } else {
      error("this group syntax (inline flags, comments, conditionals) is not supported");
    }
  }
  if (++depth_ > kMaxDepth) error("groups nested too deeply");
  Node inner = alternation();
  --depth_;
  if (!at(')')) error_at("missing ')' for the group opened", start);
  ++pos_;
  return inner;
}

uint32_t Parser::hex_escape(int digits) {
  uint32_t v = 0;
  for (int i = 0; i < digits; ++i) {
    if (!is_hex(peek())) error("bad hexadecimal escape");
    const uint32_t h = s_[pos_++];
    v = v * 16 + (is_digit(h) ? h - '0' : (h | 0x20) - 'a' + 10);
  }
  if (v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF)) error("escape is not a Unicode scalar value");
  return v;
}

// After a backslash. Sets *is_set for \d \w \s and their negations.
Ranges Parser::escape(bool in_class, bool* is_set) {
  if (eof()) error("pattern ends with a '\\'");
  const size_t start = pos_ - 1;
  const uint32_t c = s_[pos_++];
  *is_set = true;
  switch (c) {
    case 'd': return digit_set();
    case 'D': return complement(digit_set());
    case 'w': return word_set();
    case 'W': return complement(word_set());
    case 's': return space_set();
    case 'S': return complement(space_set());
    default: break;
  }
  *is_set = false;
  auto one = [](uint32_t v) { return Ranges{{v, v}}; };
  switch (c) {
    case 'n': return one('\n');
    case 't': return one('\t');
    case 'r': return one('\r');
    case 'f': return one('\f');
    case 'v': return one('\v');
    case 'x': return one(hex_escape(2));
    case 'U': return one(hex_escape(8));
    case 'u':
      if (!at('{')) return one(hex_escape(4));
      {
        ++pos_;
        const size_t digits_start = pos_;
        while (is_hex(peek()) && pos_ - digits_start < 6) ++pos_;
        const size_t n = pos_ - digits_start;
        pos_ = digits_start;
        if (n == 0) error("bad \\u{...} escape");
        const uint32_t v = hex_escape(int(n));
        if (!at('}')) error("bad \\u{...} escape");
        ++pos_;
        return one(v);
      }
    case '0':
      if (is_digit(peek())) error("octal escapes are not supported");
      return one(0);
    case 'b':
      if (in_class) return one('\b');
      error_at("word boundaries (\\b) are not supported", start);
    case 'B': error_at("word boundaries (\\B) are not supported", start);
    case 'k': error_at("backreferences are not supported", start);
    case 'p': case 'P': error_at("Unicode property escapes are not supported", start);
    default: break;
  }
  if (is_digit(c)) error_at("backreferences are not supported", start);
  if (is_ascii_alnum(c)) error_at(fmt::format("unsupported escape '\\{}'", char(c)), start);
  return one(c);  // escaped punctuation, space or any other character stands for itself
}

Node Parser::char_class() {
  const size_t start = pos_ - 1;
  const bool negate = at('^');
  if (negate) ++pos_;
  if (at(']')) error("a ']' right after '[' or '[^' is read differently by Python and ECMAScript; write \\]");
  Ranges set;
  auto item = [&](bool* is_set) -> Ranges {
    const uint32_t c = s_[pos_++];
    if (c == '\\') return escape(true, is_set);
    if (c == '[' && (at(':') || at('=') || at('.'))) error("POSIX classes like [:alpha:] are not supported");
    *is_set = false;
    return {{c, c}};
  };
  while (!at(']')) {
    if (eof()) error_at("missing ']' for the class opened", start);
    bool lo_set = false;
    const Ranges lo = item(&lo_set);
    if (at('-') && pos_ + 1 < s_.size() && !at(']', 1)) {
      ++pos_;
      bool hi_set = false;
      const Ranges hi = item(&hi_set);
      if (lo_set || hi_set) error("bad character range: a class escape cannot be a range's end");
      if (lo[0].first > hi[0].first) error("bad character range: start after end");
      set.push_back({lo[0].first, hi[0].first});
    } else {
      set.insert(set.end(), lo.begin(), lo.end());
    }
  }
  ++pos_;
  set = normalize(set);
  if (negate) set = complement(set);
  if (set.empty()) error_at("character class matches nothing", start);
  return chars(std::move(set), start);
}

// Reads {m}, {m,}, {m,n} or {,n} at pos_ (moving past it), or leaves pos_ and returns nothing.
std::optional<std::pair<int, int>> Parser::counts() {
  if (!at('{')) return std::nullopt;
  size_t p = pos_ + 1;
  auto number = [&](int* out) {
    const size_t begin = p;
    long v = 0;
    while (p < s_.size() && is_digit(s_[p])) {
      v = std::min<long>(v * 10 + long(s_[p] - '0'), kMaxCount + 1L);
      ++p;
    }
    *out = int(v);
    return p > begin;
  };
  int lo = 0, hi = 0;
  const bool has_lo = number(&lo);
  if (p < s_.size() && s_[p] == '}' && has_lo) {
    hi = lo;
  } else if (p < s_.size() && s_[p] == ',') {
    ++p;
    if (!number(&hi)) {
      if (!has_lo) return std::nullopt;
      hi = kUnbounded;
    }
    if (p >= s_.size() || s_[p] != '}') return std::nullopt;
  } else {
    return std::nullopt;
  }
  pos_ = p + 1;
  if (lo > kMaxCount || hi > kMaxCount) error("repetition count above 10000");
  if (hi != kUnbounded && lo > hi) error("bad repetition range: minimum above maximum");
  return std::pair{lo, hi};
}

void Parser::quantifier(Node& a) {
  bool quantified = false;
  while (!eof()) {
    const size_t start = pos_;
    std::pair<int, int> mm;
    if (at('*')) mm = {0, kUnbounded}, ++pos_;
    else if (at('+')) mm = {1, kUnbounded}, ++pos_;
    else if (at('?')) mm = {0, 1}, ++pos_;
    else if (auto c = counts()) mm = *c;
    else if (at('{')) error("a '{' that does not start a repetition must be escaped as \\{");
    else return;
    if (quantified) error_at("multiple repeat (a quantifier after a quantifier)", start);
    if (a.kind == Node::Start || a.kind == Node::End) error_at("quantifier on an anchor", start);
    quantified = true;
    if (at('?')) ++pos_;  // lazy: the same language
    else if (at('+')) error("possessive quantifiers are not supported");
    a = repeat(std::move(a), mm.first, mm.second);
  }
}

// ---- Analysis ----

bool nullable(const Node& n) {
  switch (n.kind) {
    case Node::Chars: return false;
    case Node::Concat: return std::all_of(n.kids.begin(), n.kids.end(), nullable);
    case Node::Alt: return std::any_of(n.kids.begin(), n.kids.end(), nullable);
    case Node::Repeat: return n.min == 0 || nullable(n.kids[0]);
    default: return true;
  }
}

// Matches only the empty string (anchors, empty groups).
bool only_empty(const Node& n) {
  switch (n.kind) {
    case Node::Chars: return false;
    case Node::Concat: case Node::Alt: return std::all_of(n.kids.begin(), n.kids.end(), only_empty);
    case Node::Repeat: return n.max == 0 || only_empty(n.kids[0]);
    default: return true;
  }
}

// `^` may only be where nothing can have been read, `$` where nothing more can be.
void check_anchors(const Parser& p, const Node& n, bool at_start, bool at_end) {
  switch (n.kind) {
    case Node::Start:
      if (!at_start) p.error_at("'^' in the middle of the pattern is not supported", n.pos);
      return;
    case Node::End:
      if (!at_end) p.error_at("'$' in the middle of the pattern is not supported", n.pos);
      return;
    case Node::Alt:
      for (const Node& k : n.kids) check_anchors(p, k, at_start, at_end);
      return;
    case Node::Repeat: {
      const bool once = n.max == 1;
      check_anchors(p, n.kids[0], at_start && once, at_end && once);
      return;
    }
    case Node::Concat: {
      const size_t count = n.kids.size();
      size_t first_real = 0, last_real = count;  // first kid not only_empty; one past the last
      while (first_real < count && only_empty(n.kids[first_real])) ++first_real;
      while (last_real > 0 && only_empty(n.kids[last_real - 1])) --last_real;
      for (size_t i = 0; i < count; ++i) {
        check_anchors(p, n.kids[i], at_start && i <= first_real, at_end && i + 1 >= last_real);
      }
      return;
    }
    default: return;
  }
}

// The language of n without the empty string (nothing if that is empty).
std::optional<Node> non_empty(const Node& n) {
  if (!nullable(n)) return n;
  switch (n.kind) {
    case Node::Alt: case Node::Concat: {
      Node alt = make(Node::Alt, n.pos);
      for (size_t i = 0; i < n.kids.size(); ++i) {
        if (n.kind == Node::Alt) {
          if (auto k = non_empty(n.kids[i])) alt.kids.push_back(std::move(*k));
          continue;
        }
        // A non-empty match of a sequence of nullable parts: kids before i empty, kid i not.
        if (auto k = non_empty(n.kids[i])) {
          Node seq = make(Node::Concat, n.pos, {std::move(*k)});
          seq.kids.insert(seq.kids.end(), n.kids.begin() + long(i) + 1, n.kids.end());
          alt.kids.push_back(std::move(seq));
        }
      }
      if (alt.kids.empty()) return std::nullopt;
      return alt.kids.size() == 1 ? std::move(alt.kids[0]) : alt;
    }
    case Node::Repeat: {
      if (n.max == 0) return std::nullopt;
      if (!nullable(n.kids[0])) return repeat(n.kids[0], 1, n.max);
      auto k = non_empty(n.kids[0]);
      if (!k) return std::nullopt;
      if (n.max == kUnbounded) return repeat(std::move(*k), 1, kUnbounded);
      if (n.max == 1) return k;
      return make(Node::Concat, n.pos, {std::move(*k), repeat(n.kids[0], 0, n.max - 1)});
    }
    default: return std::nullopt;
  }
}

size_t add_len(size_t a, size_t b) { return a == kInfinite || b == kInfinite ? kInfinite : a + b; }
size_t mul_len(size_t a, int count) {
  if (count == kUnbounded) return a == 0 ? 0 : kInfinite;
  return a == kInfinite ? (count == 0 ? 0 : kInfinite) : a * size_t(count);
}

// The shortest and longest matches, in code points (kInfinite: unbounded).
std::pair<size_t, size_t> length_bounds(const Node& n) {
  switch (n.kind) {
    case Node::Chars: return {1, 1};
    case Node::Concat: case Node::Alt: {
      const bool alt = n.kind == Node::Alt;
      std::pair<size_t, size_t> b = alt ? std::pair{kInfinite, size_t(0)} : std::pair{size_t(0), size_t(0)};
      for (const Node& k : n.kids) {
        auto [lo, hi] = length_bounds(k);
        b = alt ? std::pair{std::min(b.first, lo), std::max(b.second, hi)}
                : std::pair{add_len(b.first, lo), add_len(b.second, hi)};
      }
      return b;
    }
    case Node::Repeat: {
      auto [lo, hi] = length_bounds(n.kids[0]);
      return {mul_len(lo, n.min), mul_len(hi, n.max)};
    }
    default: return {0, 0};
  }
}

// ---- Writing GBNF ----

std::string class_char(uint32_t c) {
  if (c == '\\' || c == ']' || c == '[' || c == '-' || c == '^') return fmt::format("\\{}", char(c));
  if (c < 0x20 || c == 0x7F) return fmt::format("\\x{:02X}", c);
  if (c < 0x80) return std::string(1, char(c));
  if (c <= 0xFFFF) return fmt::format("\\u{:04X}", c);
  return fmt::format("\\U{:08X}", c);
}

std::string class_text(const Ranges& r) {
  const Ranges comp = complement(r);
  if (comp.empty()) return ".";
  const bool negate = comp.size() < r.size() || (!r.empty() && r.back().second == kMaxCodePoint);
  std::string out = negate ? "[^" : "[";
  for (auto [lo, hi] : negate ? comp : r) {
    out += class_char(lo);
    if (hi == lo) continue;
    if (hi != lo + 1) out += '-';
    out += class_char(hi);
  }
  return out + "]";
}


class Writer {
 public:
  explicit Writer(bool json) : json_(json) {}

  // Precedence of an expression: 0 alternatives, 1 a sequence, 2 an atom (may take a quantifier).
  struct Expr {
    std::string text;
    int level = 2;
  };

  Expr write(const Node& n) {
    switch (n.kind) {
      case Node::Chars: return write_chars(n.chars);
      case Node::Concat: return write_concat(n);
      case Node::Alt: return write_alt(n);
      case Node::Repeat: return write_repeat(n);
      default: return {"\"\"", 2};
    }
  }

 private:
  bool json_;

  static std::string wrap(const Expr& e, int min_level) {
    return e.level >= min_level ? e.text : "(" + e.text + ")";
  }

  std::string char_text(uint32_t c) const {
    return json_ && detail::needs_json_escape(c) ? detail::json_escape(c) : utf8_encode(c);
  }

  Expr write_chars(const Ranges& r) {
    if (r.size() == 1 && r[0].first == r[0].second) {
      const std::string text = char_text(r[0].first);
      return {gbnf_literal(text), utf8_decode(text).size() == 1 ? 2 : 1};
    }
    if (!json_) return {class_text(r), 2};
    Ranges plain, special;
    for (auto [lo, hi] : r) {
      for (uint32_t c = lo; c <= std::min(hi, 0x5Cu); ++c) (detail::needs_json_escape(c) ? special : plain).push_back({c, c});
      if (hi > 0x5C) plain.push_back({std::max(lo, 0x5Du), hi});
    }
    plain = normalize(plain);
    std::vector<std::string> alts;
    if (!plain.empty()) alts.push_back(class_text(plain));
    for (auto [c, unused] : special) alts.push_back(gbnf_literal(detail::json_escape(c)));
    if (alts.size() == 1) return {alts[0], 2};
    std::string out = "(";
    for (size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + alts[i];
    return {out + ")", 2};
  }

  Expr write_concat(const Node& n) {
    std::vector<Expr> parts;
    std::string literal;  // a run of single characters
    for (const Node& k : n.kids) {
      if (k.kind == Node::Chars && k.chars.size() == 1 && k.chars[0].first == k.chars[0].second) {
        literal += char_text(k.chars[0].first);
        continue;
      }
      if (!literal.empty()) parts.push_back({gbnf_literal(literal), 2}), literal.clear();
      if (only_empty(k)) continue;
      const Expr e = write(k);
      parts.push_back({wrap(e, 1), e.level == 0 ? 2 : e.level});  // an alternation in parentheses is an atom
    }
    if (!literal.empty()) parts.push_back({gbnf_literal(literal), 2});
    if (parts.empty()) return {"\"\"", 2};
    if (parts.size() == 1) return parts[0];  // its own level: a quantified part takes no second quantifier
    std::string out;
    for (size_t i = 0; i < parts.size(); ++i) out += (i ? " " : "") + parts[i].text;
    return {out, 1};
  }

  Expr write_alt(const Node& n) {
    std::string out;
    bool has_empty = false;
    for (const Node& k : n.kids) {
      if (only_empty(k)) {
        has_empty = true;
        continue;
      }
      out += (out.empty() ? "" : " | ") + write(k).text;
    }
    if (out.empty()) return {"\"\"", 2};
    if (has_empty) return {"(" + out + ")?", 1};
    return {out, 0};
  }

  Expr write_repeat(const Node& n) {
    int min = n.min, max = n.max;
    const Node* body = &n.kids[0];
    std::optional<Node> stripped;
    if (max == 0 || only_empty(*body)) return {"\"\"", 2};
    if (nullable(*body)) {
      min = 0;
      if (max == kUnbounded) {  // X* with X nullable is X'* (X' = X without the empty string)
        stripped = non_empty(*body);
        body = &*stripped;
      }
    }
    const Expr inner = write(*body);
    if (min == 1 && max == 1) return inner;
    std::string suffix;
    if (min == 0 && max == 1) suffix = "?";
    else if (min == 0 && max == kUnbounded) suffix = "*";
    else if (min == 1 && max == kUnbounded) suffix = "+";
    else if (max == kUnbounded) suffix = fmt::format("{{{},}}", min);
    else if (min == max) suffix = fmt::format("{{{}}}", min);
    else suffix = fmt::format("{{{},{}}}", min, max);
    return {wrap(inner, 2) + suffix, 1};  // level 1: quantifying it again needs parentheses
  }
};

std::string convert(std::string_view pattern, std::string_view name, bool json, size_t* min_len, size_t* max_len) {
  Parser parser(pattern);
  const Node root = parser.parse();
  check_anchors(parser, root, true, true);
  if (min_len || max_len) {
    auto [lo, hi] = length_bounds(root);
    if (min_len) *min_len = lo;
    if (max_len) *max_len = hi;
  }
  Writer writer(json);
  std::string out = fmt::format("{} ::= {}\n", name, writer.write(root).text);
  if (out.size() > (1u << 20)) fail("regex: the pattern is too complex (its grammar is over 1 MiB): /{}/", pattern);
  return out;
}

}  // namespace

std::string regex_to_gbnf(std::string_view pattern, std::string_view name) {
  return convert(pattern, name, false, nullptr, nullptr);
}

namespace detail {
std::string json_escape(uint32_t c) {
  switch (c) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\b': return "\\b";
    case '\f': return "\\f";
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    default: return fmt::format("\\u{:04x}", c);
  }
}

std::string regex_to_json_string_gbnf(std::string_view pattern, std::string_view name, size_t* min_length,
                                      size_t* max_length) {
  return convert(pattern, name, true, min_length, max_length);
}
}  // namespace detail

}  // namespace serval::grammar
