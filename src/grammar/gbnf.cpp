#include "grammar/gbnf.h"

#include <algorithm>
#include <cctype>
#include <functional>
#include <map>
#include <unordered_map>

namespace serval::grammar {
namespace {

constexpr size_t kMaxText = size_t(1) << 20;
constexpr int kMaxRepeat = 10000;
constexpr size_t kMaxRules = 100000;
constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr int kMaxNesting = 256;

bool is_surrogate(uint32_t cp) { return cp >= 0xD800 && cp <= 0xDFFF; }

using Range = std::pair<uint32_t, uint32_t>;

void encode_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6)), out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12)), out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18)), out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
  }
}

// Splits lo..hi into ranges whose encodings share a length and differ only in a suffix of bytes that
// each span a full continuation range, so each is one sequence of byte ranges.
void split_utf8(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  if (lo > hi) return;
  if (lo <= 0xDFFF && hi >= 0xD800) {  // surrogates have no UTF-8 encoding
    if (lo < 0xD800) split_utf8(lo, 0xD7FF, out);
    if (hi > 0xDFFF) split_utf8(0xE000, hi, out);
    return;
  }
  for (uint32_t max : {0x7Fu, 0x7FFu, 0xFFFFu})
    if (lo <= max && hi > max) return split_utf8(lo, max, out), split_utf8(max + 1, hi, out);
  for (int i = 1; i < 4; ++i) {
    const uint32_t m = (uint32_t(1) << (6 * i)) - 1;
    if ((lo & ~m) == (hi & ~m)) continue;
    if ((lo & m) != 0) return split_utf8(lo, lo | m, out), split_utf8((lo | m) + 1, hi, out);
    if ((hi & m) != m) return split_utf8(lo, (hi & ~m) - 1, out), split_utf8(hi & ~m, hi, out);
  }
  std::string a, b;
  encode_utf8(lo, a), encode_utf8(hi, b);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (size_t k = 0; k < a.size(); ++k) seq.emplace_back(uint8_t(a[k]), uint8_t(b[k]));
  out.push_back(std::move(seq));
}

std::vector<Range> normalize(std::vector<Range> r) {
  std::sort(r.begin(), r.end());
  std::vector<Range> out;
  for (const Range& x : r) {
    if (!out.empty() && x.first <= out.back().second + 1)
      out.back().second = std::max(out.back().second, x.second);
    else
      out.push_back(x);
  }
  return out;
}

std::vector<Range> complement(const std::vector<Range>& r) {
  std::vector<Range> out;
  uint32_t next = 0;
  for (const Range& x : r) {
    if (x.first > next) out.emplace_back(next, x.first - 1);
    next = x.second + 1;
  }
  if (next <= kMaxCodePoint) out.emplace_back(next, kMaxCodePoint);
  return out;
}

Element byte_element(const ByteSet& s) { return Element{Element::Bytes, -1, s}; }
Element rule_element(int32_t rule) { return Element{Element::Rule, rule, {}}; }

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Grammar parse(std::string_view root) {
    check(text_.size() <= kMaxText, "grammar: text of {} bytes is over the 1 MiB limit", text_.size());
    skip_space(true);
    while (!eof()) {
      parse_rule();
      skip_space(true);
    }
    check_defined();
    Grammar g;
    g.rules = std::move(rules_);
    const auto it = ids_.find(std::string(root));
    check(it != ids_.end() && defined_[size_t(it->second)], "grammar: no rule named '{}' (the start rule)", root);
    g.root = it->second;
    check_left_recursion(g);
    return g;
  }

 private:
  std::string_view text_;
  size_t pos_ = 0;
  std::vector<Rule> rules_;
  std::vector<bool> defined_;
  std::unordered_map<std::string, int32_t> ids_;
  std::map<std::vector<Range>, int32_t> class_rules_;  // character classes made into rules, reused
  std::unordered_map<int32_t, int> helper_count_;
  int depth_ = 0;  // parentheses open

  bool eof() const { return pos_ >= text_.size(); }
  char peek() const { return eof() ? '\0' : text_[pos_]; }

  [[noreturn]] void error(const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < text_.size(); ++i) text_[i] == '\n' ? (++line, col = 1) : ++col;
    fail("grammar: {} at line {}, column {}", what, line, col);
  }

  void skip_space(bool newlines) {
    while (!eof()) {
      const char c = peek();
      if (c == '#') {
        while (!eof() && peek() != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++pos_;
      } else {
        break;
      }
    }
  }

  static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }

  std::string parse_name() {
    const size_t start = pos_;
    while (!eof() && is_name_char(peek())) ++pos_;
    if (pos_ == start) error(fmt::format("expected a rule name, found '{}'", peek()));
    return std::string(text_.substr(start, pos_ - start));
  }

  int32_t id_of(const std::string& name) {
    const auto [it, added] = ids_.try_emplace(name, int32_t(rules_.size()));
    if (added) {
      check(rules_.size() < kMaxRules, "grammar: more than {} rules (each optional repeat of x{{m,n}} is one)", kMaxRules);
      rules_.push_back(Rule{name, {}});
      defined_.push_back(false);
    }
    return it->second;
  }

  int32_t new_helper(int32_t parent) {
    const std::string base = rules_[size_t(parent)].name;
    std::string name;
    do name = fmt::format("{}-{}", base, ++helper_count_[parent]);
    while (ids_.count(name));
    const int32_t id = id_of(name);
    defined_[size_t(id)] = true;
    return id;
  }

  void parse_rule() {
    const std::string name = parse_name();
    skip_space(false);
    if (text_.substr(pos_, 3) != "::=") error(fmt::format("expected '::=' after rule name '{}'", name));
    pos_ += 3;
    const int32_t id = id_of(name);
    if (defined_[size_t(id)]) error(fmt::format("rule '{}' is defined twice", name));
    defined_[size_t(id)] = true;
    skip_space(true);  // the alternatives may start on the next line (as in llama.cpp's grammars)
    auto alternatives = parse_alternatives(id, false);
    rules_[size_t(id)].alternatives = std::move(alternatives);
    if (!eof() && peek() != '\n') error(fmt::format("unexpected '{}'", peek()));
  }

  std::vector<Sequence> parse_alternatives(int32_t rule, bool nested) {
    std::vector<Sequence> alts;
    alts.push_back(parse_sequence(rule, nested));
    while (peek() == '|') {
      ++pos_;
      skip_space(true);
      alts.push_back(parse_sequence(rule, nested));
    }
    return alts;
  }

  Sequence parse_sequence(int32_t rule, bool nested) {
    Sequence seq;
    while (true) {
      skip_space(nested);
      const char c = peek();
      if (eof() || c == '|' || c == ')' || c == '\n') break;
      const size_t symbol_start = seq.size();
      parse_symbol(rule, seq);
      skip_space(nested);
      parse_repetition(rule, seq, symbol_start);
    }
    return seq;
  }

  void parse_symbol(int32_t rule, Sequence& seq) {
    const char c = peek();
    if (c == '"') return parse_literal(seq);
    if (c == '[') return add_class(rule, parse_class(), seq);
    if (c == '.') return ++pos_, add_class(rule, {{0, kMaxCodePoint}}, seq);
    if (c == '(') {
      if (++depth_ > kMaxNesting) error(fmt::format("parentheses nested deeper than {}", kMaxNesting));
      ++pos_;
      skip_space(true);
      const int32_t sub = new_helper(rule);
      auto alts = parse_alternatives(rule, true);
      rules_[size_t(sub)].alternatives = std::move(alts);
      if (peek() != ')') error("expected ')'");
      ++pos_, --depth_;
      seq.push_back(rule_element(sub));
      return;
    }
    if (c == '<') error("token references (<...>) are not supported");
    if (!is_name_char(c)) error(fmt::format("unexpected '{}'", c));
    seq.push_back(rule_element(id_of(parse_name())));
  }

  uint32_t parse_hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const char c = peek();
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) error("bad hexadecimal escape");
      v = v * 16 + uint32_t(d), ++pos_;
    }
    if (v > kMaxCodePoint) error("escape beyond U+10FFFF");
    return v;
  }

  // One character of a literal or class: an escape or a UTF-8 code point.
  uint32_t parse_char() {
    if (eof()) error("unterminated literal or class");
    const unsigned char c = uint8_t(peek());
    if (c == '\\') {
      ++pos_;
      const char e = peek();
      ++pos_;
      switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case 'x': return parse_hex(2);
        case 'u': return parse_hex(4);
        case 'U': return parse_hex(8);
        default:
          if (uint8_t(e) < 0x80 && std::ispunct(uint8_t(e))) return uint8_t(e);
          --pos_, error(fmt::format("unknown escape '\\{}'", e));
      }
    }
    const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || pos_ + size_t(len) > text_.size()) error("invalid UTF-8");
    uint32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (int k = 1; k < len; ++k) {
      const uint8_t b = uint8_t(text_[pos_ + size_t(k)]);
      if ((b & 0xC0) != 0x80) error("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3F);
    }
    static constexpr uint32_t kMinOfLength[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinOfLength[len] || cp > kMaxCodePoint || is_surrogate(cp)) error("invalid UTF-8");
    pos_ += size_t(len);
    return cp;
  }

  void parse_literal(Sequence& seq) {
    ++pos_;
    while (peek() != '"') {
      if (eof() || peek() == '\n') error("unterminated string literal");
      std::string bytes;
      const uint32_t cp = parse_char();
      if (is_surrogate(cp)) error("a surrogate (U+D800..U+DFFF) is not a character");
      encode_utf8(cp, bytes);
      for (char b : bytes) {
        ByteSet s;
        s.add(uint8_t(b));
        seq.push_back(byte_element(s));
      }
    }
    ++pos_;
  }

  std::vector<Range> parse_class() {
    ++pos_;
    const bool negated = peek() == '^';
    if (negated) ++pos_;
    std::vector<Range> ranges;
    while (peek() != ']') {
      if (eof() || peek() == '\n') error("unterminated character class");
      const uint32_t lo = parse_char();
      uint32_t hi = lo;
      if (peek() == '-' && pos_ + 1 < text_.size() && text_[pos_ + 1] != ']') {
        ++pos_;
        hi = parse_char();
        if (hi < lo) error("character range out of order");
      }
      ranges.emplace_back(lo, hi);
    }
    ++pos_;
    ranges = normalize(std::move(ranges));
    if (negated) ranges = complement(ranges);
    if (ranges.empty()) error("empty character class");
    return ranges;
  }

  // A class of ASCII characters is one byte set; others become a rule of byte-range sequences.
  void add_class(int32_t rule, const std::vector<Range>& ranges, Sequence& seq) {
    if (ranges.back().second < 0x80) {
      ByteSet s;
      for (const Range& r : ranges) s.add_range(uint8_t(r.first), uint8_t(r.second));
      seq.push_back(byte_element(s));
      return;
    }
    auto [it, added] = class_rules_.try_emplace(ranges, -1);
    if (added) {
      std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
      for (const Range& r : ranges)
        for (auto& q : utf8_sequences(r.first, r.second)) seqs.push_back(std::move(q));
      if (seqs.empty()) error("character class of surrogates only: it matches no character");
      it->second = new_helper(rule);
      std::vector<Sequence> alts;
      for (const auto& byte_seq : seqs) {
        Sequence s;
        for (auto [lo, hi] : byte_seq) {
          ByteSet b;
          b.add_range(lo, hi);
          s.push_back(byte_element(b));
        }
        alts.push_back(std::move(s));
      }
      rules_[size_t(it->second)].alternatives = std::move(alts);
    }
    seq.push_back(rule_element(it->second));
  }

  int parse_count() {
    const size_t start = pos_;
    long v = 0;
    while (!eof() && std::isdigit(uint8_t(peek()))) {
      v = v * 10 + (peek() - '0'), ++pos_;
      if (v > kMaxRepeat) error(fmt::format("repetition count over {}", kMaxRepeat));
    }
    if (pos_ == start) error("expected a number");
    return int(v);
  }

  void parse_repetition(int32_t rule, Sequence& seq, size_t symbol_start) {
    int lo, hi;  // hi < 0: unbounded
    const char c = peek();
    if (c == '*') lo = 0, hi = -1, ++pos_;
    else if (c == '+') lo = 1, hi = -1, ++pos_;
    else if (c == '?') lo = 0, hi = 1, ++pos_;
    else if (c == '{') {
      ++pos_;
      skip_space(false);
      lo = parse_count(), hi = lo;
      skip_space(false);
      if (peek() == ',') {
        ++pos_;
        skip_space(false);
        hi = std::isdigit(uint8_t(peek())) ? parse_count() : -1;
        skip_space(false);
      }
      if (peek() != '}') error("expected '}'");
      ++pos_;
      if (hi >= 0 && hi < lo) error("repetition {m,n} with n < m");
    } else {
      return;
    }
    if (symbol_start == seq.size()) error("repetition without a symbol");
    skip_space(false);
    repeat(rule, seq, symbol_start, lo, hi);
  }

  // Replaces seq[symbol_start..] (one symbol: an element or a literal's bytes) by its repetition.
  void repeat(int32_t rule, Sequence& seq, size_t symbol_start, int lo, int hi) {
    Sequence item(seq.begin() + std::ptrdiff_t(symbol_start), seq.end());
    seq.resize(symbol_start);
    Element x = item[0];
    if (item.size() > 1) {
      const int32_t sub = new_helper(rule);
      rules_[size_t(sub)].alternatives = {item};
      x = rule_element(sub);
    }
    for (int i = 0; i < lo; ++i) seq.push_back(x);
    if (hi < 0) {  // rest ::= x rest | ""
      const int32_t rest = new_helper(rule);
      rules_[size_t(rest)].alternatives = {{x, rule_element(rest)}, {}};
      seq.push_back(rule_element(rest));
      return;
    }
    int32_t tail = -1;  // opt_k ::= x opt_(k-1) | ""
    for (int k = 0; k < hi - lo; ++k) {
      const int32_t opt = new_helper(rule);
      Sequence more{x};
      if (tail >= 0) more.push_back(rule_element(tail));
      rules_[size_t(opt)].alternatives = {more, {}};
      tail = opt;
    }
    if (tail >= 0) seq.push_back(rule_element(tail));
  }

  void check_defined() const {
    for (size_t i = 0; i < rules_.size(); ++i)
      if (!defined_[i]) fail("grammar: rule '{}' is used but never defined", rules_[i].name);
  }

  static std::vector<bool> nullable_rules(const Grammar& g) {
    std::vector<bool> nullable(g.rules.size(), false);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < g.rules.size(); ++r) {
        if (nullable[r]) continue;
        for (const Sequence& s : g.rules[r].alternatives)
          if (std::all_of(s.begin(), s.end(), [&](const Element& e) { return e.kind == Element::Rule && nullable[size_t(e.rule)]; })) {
            nullable[r] = changed = true;
            break;
          }
      }
    }
    return nullable;
  }

  // A rule that reaches itself through the first elements of its alternatives (skipping nullable
  // rules) would expand forever.
  static void check_left_recursion(const Grammar& g) {
    const std::vector<bool> nullable = nullable_rules(g);
    std::vector<std::vector<int32_t>> left(g.rules.size());
    for (size_t r = 0; r < g.rules.size(); ++r)
      for (const Sequence& s : g.rules[r].alternatives)
        for (const Element& e : s) {
          if (e.kind != Element::Rule) break;
          left[r].push_back(e.rule);
          if (!nullable[size_t(e.rule)]) break;
        }
    std::vector<int8_t> mark(g.rules.size(), 0);  // 1: on the path, 2: done
    std::function<void(int32_t)> visit = [&](int32_t r) {
      mark[size_t(r)] = 1;
      for (int32_t t : left[size_t(r)]) {
        if (mark[size_t(t)] == 1)
          fail("grammar: rule '{}' is left-recursive: it can reach itself without reading a character (as a "
               "repetition of something that can be empty does: (\"a\"?)*)", g.rules[size_t(t)].name);
        if (mark[size_t(t)] == 0) visit(t);
      }
      mark[size_t(r)] = 2;
    };
    for (size_t r = 0; r < g.rules.size(); ++r)
      if (mark[r] == 0) visit(int32_t(r));
  }
};

}  // namespace

std::vector<std::vector<std::pair<uint8_t, uint8_t>>> utf8_sequences(uint32_t lo, uint32_t hi) {
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> out;
  split_utf8(lo, std::min(hi, kMaxCodePoint), out);
  return out;
}

Grammar parse_gbnf(std::string_view text, std::string_view root) { return Parser(text).parse(root); }

std::string gbnf_literal(std::string_view text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') out += '\\', out += char(c);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) out += fmt::format("\\x{:02X}", c);
    else out += char(c);
  }
  return out + "\"";
}

}  // namespace serval::grammar
