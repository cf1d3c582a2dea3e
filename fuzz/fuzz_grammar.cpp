// libFuzzer harness for the grammar front ends and the matcher (src/grammar/) and the tool-call
// parser (src/server/tool_calls.h): text from requests and from models, all hostile.
//
// Input: one mode byte (its value % 4), then the text for that mode. scripts/fuzz makes inputs of up
// to 4 KiB (-max_len); the harness takes up to 64 KiB so that regression inputs can be deeper.
//   0  GBNF, then optionally '\0' and bytes to feed. A grammar that parses is compiled and walked:
//      the fed bytes, a few fixed strings and a sentence generated from the token masks. At every
//      state reached (up to a budget) the mask over a fixed vocabulary must agree with `advance`
//      (the oracle: a token is allowed iff its bytes lead to a live state; end-of-generation iff
//      accepting; an empty token never), `can_continue` iff some byte is allowed, and a generated
//      sentence must be matched by a freshly compiled copy of the grammar.
//   1  A regular expression: regex_to_gbnf's output must parse. Generated sentences must be valid
//      UTF-8, and for patterns in a small subset whose meaning is unambiguous (literals, `.`, classes,
//      groups, alternatives, quantifiers) a set-based reference matcher (Python's re.fullmatch
//      semantics) must agree with the grammar on every short string over the pattern's characters.
//   2  JSON: json_object_gbnf() must match the value's compact dump iff it is an object. As a schema,
//      json_schema_to_gbnf's output must parse; a few canonical values are matched (all of them for
//      `{}` / `true`, each const / enum value for a schema that is only that), and generated
//      sentences must be JSON (of a declared `type` when the schema has only a type).
//   3  Model output: parse_tool_calls for each format with a fixed tools list (calls name known
//      functions, arguments are JSON objects); tool_call_start is npos or within the text, never
//      moves back as the text grows, and the content parsed from the whole text starts with the text
//      before it. If the text is a JSON array it is used as `tools` for tool_call_gbnf: the grammar
//      must parse, and a sentence generated from it must parse back as calls with no content.
// Every library call must return or throw serval::Error; any other exception, a crash, a sanitizer
// report, a hang (-timeout) or a huge allocation (-malloc_limit_mb) is a finding, and so is a
// violated property (an abort with "fuzz property violated").
#include <algorithm>
#include <bitset>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "fuzz_common.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"
#include "server/tool_calls.h"

namespace {

using ojson = nlohmann::ordered_json;
using serval::Error;
using serval::ToolFormat;
using serval::fuzz::violation;
namespace g = serval::grammar;

constexpr size_t kMaxInput = 65536;  // scripts/fuzz generates up to 4096 bytes; longer: regression inputs
// States whose mask is checked against the oracle, per grammar (a mask costs a step per vocabulary
// trie node the state can enter): more for GBNF, where the masks are the point.
constexpr size_t kOracleStatesGbnf = 48;
constexpr size_t kOracleStates = 12;
constexpr ToolFormat kFormats[] = {ToolFormat::Hermes, ToolFormat::Llama3Json, ToolFormat::Mistral};

std::string printable(std::string_view s, size_t limit = 160) {
  std::string out;
  for (unsigned char c : s.substr(0, limit)) {
    if (c >= 0x20 && c < 0x7F && c != '\\') out += char(c);
    else out += fmt::format("\\x{:02x}", c);
  }
  if (s.size() > limit) out += "...";
  return out;
}

// Deterministic per input (libFuzzer needs a run to depend on the input only).
struct Rng {
  uint64_t s;
  explicit Rng(std::string_view data) : s(1469598103934665603ull) {
    for (unsigned char c : data) s = (s ^ c) * 1099511628211ull;
    s |= 1;
  }
  uint32_t next() {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return uint32_t(s >> 11);
  }
  size_t below(size_t n) { return n ? next() % n : 0; }
};

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = uint8_t(s[i]);
    const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + size_t(len) > s.size()) return false;
    uint32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (int k = 1; k < len; ++k) {
      const unsigned char b = uint8_t(s[i + size_t(k)]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += size_t(len);
  }
  return true;
}

// ---- The vocabulary: every single byte (ids 0..255: the live bytes of a state), multi-byte pieces
// (whole and partial UTF-8 characters, JSON and tool-call punctuation, a duplicate), an empty
// (control) token and an end-of-generation token.
constexpr int32_t kEogToken = 257;

const g::TokenVocab& vocab() {
  static const g::TokenVocab v = [] {
    std::vector<std::string> t;
    for (int b = 0; b < 256; ++b) t.emplace_back(1, char(b));
    t.emplace_back("");          // 256: a control token (no bytes): never allowed
    t.emplace_back("</s>");      // 257: end of generation
    for (const char* s : {"ab", "abc", "true", "false", "null", "{\"", "\":", "\",", "\"}", "\": \"", "  ", "\n  ",
                          "12", "0.5", "-1", "e+", "[{", "}]", "<tool_call>", "</tool_call>", "{\"name\": \"",
                          "\"arguments\"", "[TOOL_CALLS]", "é", "€", "😀", "中文", "\xC3", "\xA9", "\xE2\x82",
                          "\x82\xAC", "\xF0\x9F", "\x9F\x98\x80", "\x80", "\xFF", "a\xC3", "\xED\xA0\x80", "ab"})
      t.emplace_back(s);
    return g::TokenVocab(std::move(t), {kEogToken});
  }();
  return v;
}

// Checks the mask of states of one compiled grammar against the oracle (each state once, up to a budget).
class MaskOracle {
 public:
  MaskOracle(g::CompiledGrammar& cg, size_t budget) : cg_(cg), budget_(budget) {}

  void check(g::StateId s) {
    if (s == g::kDead || checked_.size() >= budget_ || !checked_.insert(s).second) return;
    const g::TokenVocab& v = vocab();
    const auto mask = cg_.mask(s, v);
    if (mask->bits.size() != (v.size() + 63) / 64) violation("mask of the wrong size");
    const bool accepting = cg_.accepting(s);
    bool any_byte = false;
    for (int32_t id = 0; id < int32_t(v.size()); ++id) {
      bool want;
      if (v.is_eog(id)) want = accepting;
      else if (v.bytes(id).empty()) want = false;
      else want = cg_.advance(s, v.bytes(id)) != g::kDead;
      if (mask->has(id) != want)
        violation(want ? "mask refuses a token whose bytes advance" : "mask allows a token whose bytes are refused",
                  fmt::format("state {} token {} '{}'", s, id, printable(v.bytes(id))));
      if (id < 256 && want) any_byte = true;
    }
    if (cg_.can_continue(s) != any_byte) violation("can_continue disagrees with the live bytes", fmt::format("state {}", s));
  }

 private:
  g::CompiledGrammar& cg_;
  size_t budget_;
  std::unordered_set<g::StateId> checked_;
};

// Generates a sentence of the grammar (checking the oracle on the way): a few random tries among
// common bytes, then a live byte from the mask; past half of max_len, bytes that tend to close
// JSON-like structures first. Stops when the state accepts (sometimes earlier, in the first half).
// nullopt when no accepting state was reached. `avoid`: bytes taken only when nothing else is live.
std::optional<std::string> generate(g::CompiledGrammar& cg, MaskOracle& oracle, Rng& rng, size_t max_len,
                                    std::string_view avoid = {}) {
  static constexpr std::string_view kCommon =
      "abcdefxyz0123456789 \n\t\"'{}[]:,.-+_/\\<>|()=#!?*ABCZ\xC3\xE2\xF0\x80\xA9";
  static constexpr std::string_view kClosers = "}]\"0)>";
  std::string out;
  g::StateId s = cg.initial();
  const bool keep_going = rng.below(4) == 0;  // one run in four ignores early accepting states
  for (;;) {
    oracle.check(s);
    const bool accepting = cg.accepting(s);
    const bool closing = out.size() >= max_len / 2;
    if (accepting && (closing || (!keep_going && rng.below(6) == 0))) return out;
    if (out.size() >= max_len) return std::nullopt;
    g::StateId next = g::kDead;
    uint8_t b = 0;
    auto try_byte = [&](uint8_t c) {
      if (avoid.find(char(c)) != std::string_view::npos) return false;
      next = cg.advance(s, c), b = c;
      return next != g::kDead;
    };
    bool found = false;
    if (closing)
      for (char c : kClosers)
        if ((found = try_byte(uint8_t(c)))) break;
    for (int k = 0; k < 6 && !found; ++k) found = try_byte(uint8_t(kCommon[rng.below(kCommon.size())]));
    if (!found) {
      const auto mask = cg.mask(s, vocab());
      std::vector<uint8_t> live, avoided;
      for (int c = 0; c < 256; ++c)
        if (mask->has(c)) (avoid.find(char(c)) == std::string_view::npos ? live : avoided).push_back(uint8_t(c));
      if (live.empty()) live = std::move(avoided);
      if (live.empty()) {
        if (accepting) return out;
        violation("a live, non-accepting state allows no byte", fmt::format("after '{}'", printable(out)));
      }
      b = live[rng.below(live.size())];
      next = cg.advance(s, b);
      if (next == g::kDead) violation("a byte the mask allows leads to the dead state", printable(out + char(b)));
    }
    out += char(b);
    s = next;
  }
}

// Parses a converter's GBNF output, which must parse. The one refusal allowed is the parser's rule
// limit (bounded repetitions make a rule per optional repeat): a clear error for the client too.
g::Grammar must_parse(const std::string& gbnf, const char* who, std::string_view input) {
  try {
    return g::parse_gbnf(gbnf, "root");
  } catch (const Error& e) {
    if (std::string_view(e.what()).find("rules (each optional repeat") != std::string_view::npos) throw;
    std::fprintf(stderr, "input: %s\ngrammar:\n%s\n", printable(input, 400).c_str(), gbnf.substr(0, 4000).c_str());
    violation(who, e.what());
  }
}

bool grammar_matches(g::CompiledGrammar& cg, std::string_view text) {
  return cg.accepting(cg.advance(cg.initial(), text));
}

// ---- Mode 0: GBNF
void fuzz_gbnf(std::string_view input) {
  const size_t sep = input.find('\0');
  const std::string_view text = input.substr(0, sep);
  const std::string_view feed = sep == std::string_view::npos ? std::string_view() : input.substr(sep + 1);
  g::Grammar grammar;
  try {
    grammar = g::parse_gbnf(text, "root");
  } catch (const Error&) {
    return;
  }
  try {
    g::CompiledGrammar cg(grammar);
    MaskOracle oracle(cg, kOracleStatesGbnf);
    g::StateId s = cg.initial();
    for (char c : feed) {
      oracle.check(s);
      s = cg.advance(s, uint8_t(c));
      if (s == g::kDead) break;
    }
    oracle.check(s);
    (void)cg.accepting(s);
    for (std::string_view str : {"", "a", "ab", "0", "1+2*(3-4)", "{\"a\": [1, 2.5e3, \"x\"], \"b\": true}", "[1,[2]]",
                                 "é中😀", "\xC3", "- item\n- item\n", "<tool_call>"}) {
      const g::StateId t = cg.advance(cg.initial(), str);
      oracle.check(t);
      (void)cg.accepting(t);
    }
    Rng rng(input);
    if (auto sentence = generate(cg, oracle, rng, 96)) {
      if (!g::matches(grammar, *sentence))
        violation("a generated sentence is refused by a fresh compile of the grammar", printable(*sentence));
    }
  } catch (const Error&) {
    // The matcher's limits (stacks, states, expansions): the grammar is refused.
  }
}

// ---- Mode 1: regular expressions, with a reference matcher for a small subset
struct RNode {
  enum Kind { Set, Cat, Alt, Rep } kind;
  std::bitset<128> chars;  // Set: the ASCII characters it matches
  bool non_ascii = false;  // Set: also every non-ASCII character
  int min = 0, max = 0;    // Rep; max < 0: unbounded
  std::vector<RNode> kids;
};

// Parses the subset: literals [A-Za-z0-9 _,:;=<>@!%&~`'"#/-], `.`, classes of those (ranges, `^`,
// a `-` first or last) where `. * + ? ( ) | $ { }` are literal too, groups (`(?:` too), `|`, and
// `* + ? {m} {m,} {m,n} {,n}` with up to 2 digits, optionally lazy. `^` first and `$` last are
// dropped. Anything else (escapes, `{` that is not a repetition, a quantifier after a quantifier or
// with nothing before it, ...) gives nullopt: no reference.
class RefParser {
 public:
  explicit RefParser(std::string_view p) : p_(p) {}
  std::optional<RNode> parse() {
    if (!p_.empty() && p_.front() == '^') p_.remove_prefix(1);
    if (!p_.empty() && p_.back() == '$') p_.remove_suffix(1);
    auto n = alt(0);
    if (!n || i_ != p_.size()) return std::nullopt;
    return n;
  }

 private:
  std::string_view p_;
  size_t i_ = 0;

  static bool literal(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           std::string_view(" _,:;=<>@!%&~`'\"#/-").find(c) != std::string_view::npos;
  }
  char peek() const { return i_ < p_.size() ? p_[i_] : '\0'; }

  std::optional<RNode> alt(int depth) {
    if (depth > 8) return std::nullopt;
    RNode n{RNode::Alt};
    for (;;) {
      auto c = cat(depth);
      if (!c) return std::nullopt;
      n.kids.push_back(std::move(*c));
      if (peek() != '|') break;
      ++i_;
    }
    return n;
  }

  std::optional<RNode> cat(int depth) {
    RNode n{RNode::Cat};
    while (i_ < p_.size() && peek() != '|' && peek() != ')') {
      auto a = atom(depth);
      if (!a) return std::nullopt;
      if (!quantifier(*a)) return std::nullopt;
      n.kids.push_back(std::move(*a));
    }
    return n;
  }

  std::optional<RNode> atom(int depth) {
    const char c = peek();
    if (c == '(') {
      ++i_;
      if (peek() == '?') {
        if (p_.substr(i_, 2) != "?:") return std::nullopt;
        i_ += 2;
      }
      auto n = alt(depth + 1);
      if (!n || peek() != ')') return std::nullopt;
      ++i_;
      return n;
    }
    if (c == '[') return char_class();
    RNode n{RNode::Set};
    if (c == '.') {
      n.chars.set(), n.chars.reset('\n'), n.non_ascii = true;
    } else if (literal(c)) {
      n.chars.set(size_t(uint8_t(c)));
    } else {
      return std::nullopt;
    }
    ++i_;
    return n;
  }

  std::optional<RNode> char_class() {
    ++i_;
    RNode n{RNode::Set};
    const bool negated = peek() == '^';
    if (negated) ++i_;
    if (peek() == ']') return std::nullopt;
    auto member = [](char c) { return literal(c) || std::string_view(".*+?()|${}").find(c) != std::string_view::npos; };
    const size_t start = i_;
    while (peek() != ']') {
      const char lo = peek();
      if (!member(lo)) return std::nullopt;
      ++i_;
      if (lo == '-' && i_ - 1 != start && peek() != ']') return std::nullopt;  // a '-' inside: ambiguous
      if (peek() == '-' && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        const char hi = p_[i_ + 1];
        if (!member(hi) || hi == '-' || hi < lo) return std::nullopt;
        i_ += 2;
        if (peek() == '-' && i_ + 1 < p_.size() && p_[i_ + 1] != ']') return std::nullopt;
        for (int k = uint8_t(lo); k <= uint8_t(hi); ++k) n.chars.set(size_t(k));
      } else {
        n.chars.set(size_t(uint8_t(lo)));
      }
    }
    ++i_;
    if (negated) n.chars.flip(), n.non_ascii = true;
    return n;
  }

  std::optional<int> number() {
    int v = 0, digits = 0;
    while (peek() >= '0' && peek() <= '9') {
      if (++digits > 2) return std::nullopt;
      v = v * 10 + (peek() - '0'), ++i_;
    }
    if (digits == 0) return std::nullopt;
    return v;
  }

  static bool is_quant(char c) { return c == '*' || c == '+' || c == '?' || c == '{'; }

  // Applies a quantifier after the atom, if any; false when outside the subset.
  bool quantifier(RNode& a) {
    int min, max;
    const char c = peek();
    if (c == '*') min = 0, max = -1, ++i_;
    else if (c == '+') min = 1, max = -1, ++i_;
    else if (c == '?') min = 0, max = 1, ++i_;
    else if (c == '{') {
      ++i_;
      std::optional<int> lo = peek() == ',' ? std::optional<int>(0) : number();
      if (!lo) return false;
      min = *lo, max = *lo;
      if (peek() == ',') {
        ++i_;
        if (peek() == '}') {
          max = -1;
        } else {
          auto hi = number();
          if (!hi || *hi < min) return false;
          max = *hi;
        }
      }
      if (peek() != '}') return false;
      ++i_;
    } else {
      return true;
    }
    if (peek() == '?') ++i_;            // lazy: the same strings
    if (is_quant(peek())) return false;  // possessive or a repeated quantifier
    RNode r{RNode::Rep};
    r.min = min, r.max = max;
    r.kids.push_back(std::move(a));
    a = std::move(r);
    return true;
  }
};

// The end positions reachable from `starts` in s (sets of positions as bits); budget: work left.
using Positions = std::bitset<80>;
Positions ref_match(const RNode& n, std::string_view s, Positions starts, long& budget) {
  if (--budget < 0 || starts.none()) return {};
  switch (n.kind) {
    case RNode::Set: {
      Positions out;
      for (size_t p = 0; p < s.size(); ++p) {
        if (!starts.test(p)) continue;
        const unsigned char c = uint8_t(s[p]);
        if (c < 128 ? n.chars.test(c) : n.non_ascii) out.set(p + 1);
      }
      return out;
    }
    case RNode::Cat:
      for (const RNode& k : n.kids) starts = ref_match(k, s, starts, budget);
      return starts;
    case RNode::Alt: {
      Positions out;
      for (const RNode& k : n.kids) out |= ref_match(k, s, starts, budget);
      return out;
    }
    case RNode::Rep: {
      Positions cur = starts;
      for (int k = 0; k < n.min && cur.any(); ++k) cur = ref_match(n.kids[0], s, cur, budget);
      Positions out = cur;
      for (int k = n.min; (n.max < 0 || k < n.max) && cur.any() && budget > 0; ++k) {
        const Positions next = ref_match(n.kids[0], s, cur, budget);
        if (next == cur) break;  // a fixed point: more repetitions add nothing
        cur = next, out |= next;
      }
      return out;
    }
  }
  return {};
}

// Whether s fully matches; nullopt when the budget ran out.
std::optional<bool> ref_fullmatch(const RNode& n, std::string_view s) {
  if (s.size() + 1 > Positions().size()) return std::nullopt;
  long budget = 20000;
  Positions start;
  start.set(0);
  const bool r = ref_match(n, s, start, budget).test(s.size());
  if (budget < 0) return std::nullopt;
  return r;
}

void fuzz_regex(std::string_view pattern) {
  std::string gbnf;
  try {
    gbnf = g::regex_to_gbnf(pattern, "root");
  } catch (const Error&) {
    return;
  }
  const g::Grammar grammar = must_parse(gbnf, "regex_to_gbnf output does not parse", pattern);
  std::optional<RNode> ref;
  if (pattern.size() <= 48) ref = RefParser(pattern).parse();
  try {
    g::CompiledGrammar cg(grammar);
    MaskOracle oracle(cg, kOracleStates);
    if (ref) {
      // Every string of up to 4 characters over (up to 3 of) the pattern's own characters and one other.
      std::string alphabet;
      for (char c : pattern)
        if (c >= 0x20 && c < 0x7F && alphabet.size() < 3 && alphabet.find(c) == std::string::npos) alphabet += c;
      alphabet += alphabet.find('a') == std::string::npos ? 'a' : '~';
      std::vector<std::pair<std::string, g::StateId>> level{{"", cg.initial()}};
      for (int len = 0; len <= 4; ++len) {
        std::vector<std::pair<std::string, g::StateId>> next;
        for (const auto& [str, st] : level) {
          const auto want = ref_fullmatch(*ref, str);
          if (want && *want != cg.accepting(st))
            violation("regex grammar and the reference matcher disagree",
                      fmt::format("/{}/ on '{}': reference {}", printable(pattern), printable(str), *want));
          if (len < 4)
            for (char c : alphabet) next.emplace_back(str + c, cg.advance(st, uint8_t(c)));
        }
        level = std::move(next);
      }
    } else {
      for (std::string_view str : {"", "a", "abc", "0", "2024-01-31", "a@b.co"}) (void)grammar_matches(cg, str);
      (void)grammar_matches(cg, pattern);
    }
    Rng rng(pattern);
    if (auto sentence = generate(cg, oracle, rng, ref ? 24 : 64)) {
      if (!valid_utf8(*sentence)) violation("a regex grammar generated invalid UTF-8", printable(*sentence));
      // The reference reads bytes: a multi-byte character would be several characters to it.
      const bool ascii = std::all_of(sentence->begin(), sentence->end(), [](char c) { return uint8_t(c) < 0x80; });
      if (ref && ascii) {
        const auto want = ref_fullmatch(*ref, *sentence);
        if (want && !*want)
          violation("the reference matcher refuses a sentence generated from the regex grammar",
                    fmt::format("/{}/ generated '{}'", printable(pattern), printable(*sentence)));
      }
    }
  } catch (const Error&) {
  }
}

// ---- Mode 2: JSON values and JSON Schemas
const g::Grammar& object_grammar() {
  static const g::Grammar gr = must_parse(g::json_object_gbnf(), "json_object_gbnf output does not parse", "");
  return gr;
}

const std::vector<std::string>& canonical_values() {
  static const std::vector<std::string> v = {"{}", "[]", "\"\"", "0", "-1", "1.5", "1e+300", "null", "true",
                                             "false", "\"a\"", "[1,\"x\",null]", "{\"a\":1}",
                                             "{\"name\":\"x\",\"age\":3}", "\"2024-01-31\"", "\"é\\n\""};
  return v;
}

bool only_keys(const ojson& s, std::initializer_list<std::string_view> keys) {
  if (!s.is_object()) return false;
  for (const auto& [k, v] : s.items()) {
    if (k == "title" || k == "description" || k == "$comment") continue;
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) return false;
  }
  return true;
}

// The JSON types (by name) a value is an instance of.
bool of_type(const ojson& v, const std::string& t) {
  if (t == "null") return v.is_null();
  if (t == "boolean") return v.is_boolean();
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  if (t == "string") return v.is_string();
  if (t == "number") return v.is_number();
  if (t == "integer") return v.is_number_integer() || (v.is_number_float() && std::trunc(v.get<double>()) == v.get<double>());
  return true;
}

void check_json_sentence(const std::string& sentence, const ojson& schema) {
  ojson value;
  try {
    value = ojson::parse(sentence);
  } catch (const ojson::out_of_range&) {
    return;  // a number beyond a double (the grammar allows 3 exponent digits): nlohmann's limit
  } catch (const ojson::exception& e) {
    violation("a schema grammar generated text that is not JSON",
              fmt::format("{}\n  schema {}\n  {}", printable(sentence), printable(schema.dump(), 400), e.what()));
  }
  if (only_keys(schema, {"type", "nullable"}) && schema.contains("type")) {
    const ojson& t = schema["type"];
    bool ok = schema.contains("nullable") && schema["nullable"] == true && value.is_null();
    for (const ojson& name : t.is_array() ? t : ojson::array({t}))
      if (name.is_string() && of_type(value, name.get<std::string>())) ok = true;
    if (!ok)
      violation("a schema grammar generated a value of the wrong type",
                fmt::format("{} for schema {}", printable(sentence), printable(schema.dump(), 400)));
  }
}

void fuzz_json(std::string_view text) {
  const ojson v = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) return;
  const std::string dump = v.dump();
  {
    g::CompiledGrammar cg(object_grammar());
    if (grammar_matches(cg, dump) != v.is_object())
      violation(v.is_object() ? "json_object grammar refuses an object" : "json_object grammar accepts a non-object",
                printable(dump, 400));
  }
  std::string gbnf;
  try {
    gbnf = g::json_schema_to_gbnf(v);
  } catch (const Error&) {
    return;
  }
  const g::Grammar grammar = must_parse(gbnf, "json_schema_to_gbnf output does not parse", text);
  try {
    g::CompiledGrammar cg(grammar);
    MaskOracle oracle(cg, kOracleStates);
    const bool accept_all = v == true || (v.is_object() && v.empty());
    for (const std::string& c : canonical_values()) {
      const g::StateId s = cg.advance(cg.initial(), c);
      oracle.check(s);
      if (accept_all && !cg.accepting(s)) violation("an empty schema refuses a JSON value", c);
      if (v == false && cg.accepting(s)) violation("schema false accepts a value", c);
    }
    (void)grammar_matches(cg, dump);
    if (only_keys(v, {"const"}) && v.contains("const") && !grammar_matches(cg, v["const"].dump()))
      violation("a const schema refuses its value", printable(v["const"].dump(), 400));
    if (only_keys(v, {"enum"}) && v.contains("enum") && v["enum"].is_array())
      for (const ojson& e : v["enum"])
        if (!grammar_matches(cg, e.dump())) violation("an enum schema refuses one of its values", printable(e.dump(), 400));
    Rng rng(text);
    if (auto sentence = generate(cg, oracle, rng, 160, "eE")) check_json_sentence(*sentence, v);
  } catch (const Error&) {
  }
}

// ---- Mode 3: tool calls
// The functions of tests/data/tool_calls/tools.json (the recorded outputs call them), and one without
// parameters.
const ojson& fixed_tools() {
  static const ojson t = ojson::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_current_temperature",
      "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}},
    {"type": "function", "function": {"name": "get_temperature_date",
      "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "date": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "trending_songs",
      "parameters": {"type": "object", "properties": {"n": {"type": "string"}, "genre": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_current_weather",
      "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "format": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "ping"}}
  ])");
  return t;
}

std::unordered_set<std::string> tool_names(const ojson& tools) {
  std::unordered_set<std::string> names;
  for (const ojson& t : tools) {
    if (!t.is_object()) continue;
    const ojson& f = t.contains("function") && t["function"].is_object() ? t["function"] : t;
    if (f.contains("name") && f["name"].is_string()) names.insert(f["name"].get<std::string>());
  }
  return names;
}

void check_calls(const serval::ParsedToolOutput& out, const std::unordered_set<std::string>& names, std::string_view text) {
  for (const serval::ToolCall& c : out.calls) {
    if (!names.count(c.name)) violation("a parsed call names an unknown function", printable(text));
    const ojson args = ojson::parse(c.arguments, nullptr, false);
    if (!args.is_object()) violation("a parsed call's arguments are not a JSON object", printable(c.arguments));
    if (c.id.size() != 29 || !c.id.starts_with("call_")) violation("a malformed call id", c.id);
  }
}

std::string_view trim(std::string_view s) {
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

// How much of `text` may be streamed as content.
size_t streamable(std::string_view text, ToolFormat f) {
  const size_t start = serval::tool_call_start(text, f);
  if (start != std::string_view::npos && start > text.size())
    violation("tool_call_start past the end of the text", fmt::format("{} > {}", start, text.size()));
  return start == std::string_view::npos ? text.size() : start;
}

void fuzz_tool_calls(std::string_view text) {
  static const std::unordered_set<std::string> names = tool_names(fixed_tools());
  for (ToolFormat f : kFormats) {
    serval::ParsedToolOutput out;
    try {
      out = serval::parse_tool_calls(text, f, fixed_tools());
    } catch (const Error&) {
      continue;
    }
    check_calls(out, names, text);
    const size_t whole = streamable(text, f);
    // Streaming: as the text grows, what was streamed stays content.
    std::vector<size_t> cuts;
    if (text.size() <= 48) {
      for (size_t k = 0; k < text.size(); ++k) cuts.push_back(k);
    } else {
      for (size_t k = 0; k < 16; ++k) cuts.push_back(text.size() * k / 16);
      for (std::string_view m : {"<tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "\n", "{", "["})
        for (size_t at = text.find(m); at != std::string_view::npos && cuts.size() < 64; at = text.find(m, at + 1))
          for (size_t d : {size_t(0), size_t(1), size_t(3)})
            if (at + d < text.size()) cuts.push_back(at + d);
    }
    for (size_t cut : cuts) {
      const size_t before = streamable(text.substr(0, cut), f);
      if (whole < before)
        violation("tool_call_start moved back as the text grew",
                  fmt::format("format {}: {} bytes of '{}' streamed, then {} of the whole",
                              serval::to_string(f), before, printable(text.substr(0, cut)), whole));
    }
    const std::string_view streamed = trim(text.substr(0, whole));
    if (!out.content.starts_with(streamed))
      violation("the content parsed from the whole text does not start with what was streamed",
                fmt::format("format {}: streamed '{}', content '{}', {} calls", serval::to_string(f),
                            printable(streamed), printable(out.content), out.calls.size()));
  }

  // The input as a tools list: the grammar that forces a call, and what it generates parsed back.
  const ojson tools = ojson::parse(text, nullptr, false);
  if (tools.is_discarded() || !tools.is_array()) return;
  const auto user_names = tool_names(tools);
  std::string first_name;
  for (const ojson& t : tools) {
    const ojson& f = t.is_object() && t.contains("function") && t["function"].is_object() ? t["function"] : t;
    if (f.is_object() && f.contains("name") && f["name"].is_string()) {
      first_name = f["name"].get<std::string>();
      break;
    }
  }
  // Every grammar must parse; one of them, picked by the input, is compiled and generates a call.
  Rng rng(text);
  const size_t pick = rng.below(9);
  for (ToolFormat f : kFormats) {
    for (int variant = 0; variant < 3; ++variant) {
      const bool parallel = variant == 1;
      const std::string_view only = variant == 2 ? std::string_view(first_name) : std::string_view();
      if (variant == 2 && first_name.empty()) continue;
      std::string gbnf;
      try {
        gbnf = serval::tool_call_gbnf(tools, f, only, parallel);
      } catch (const Error&) {
        continue;
      }
      const g::Grammar grammar = must_parse(gbnf, "tool_call_gbnf output does not parse", text);
      if (size_t(f) * 3 + size_t(variant) != pick) continue;
      try {
        g::CompiledGrammar cg(grammar);
        MaskOracle oracle(cg, kOracleStates);
        const auto sentence = generate(cg, oracle, rng, 256, "eE");
        if (!sentence) continue;
        if (!valid_utf8(*sentence)) violation("a tool-call grammar generated invalid UTF-8", printable(*sentence));
        const auto out = serval::parse_tool_calls(*sentence, f, tools);
        check_calls(out, user_names, *sentence);
        if (out.calls.empty() || (!parallel && out.calls.size() != 1) || !out.content.empty() ||
            (!only.empty() && out.calls[0].name != only))
          violation("text generated by a tool-call grammar does not parse back as its calls",
                    fmt::format("format {}, parallel {}, function '{}': '{}' gave {} calls, content '{}'",
                                serval::to_string(f), parallel, printable(only), printable(*sentence, 400),
                                out.calls.size(), printable(out.content)));
      } catch (const Error&) {
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > kMaxInput) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 4) {
      case 0: fuzz_gbnf(input); break;
      case 1: fuzz_regex(input); break;
      case 2: fuzz_json(input); break;
      case 3: fuzz_tool_calls(input); break;
    }
  } catch (const Error&) {  // a refusal must_parse lets through (the rule limit)
  }
  return 0;
}
