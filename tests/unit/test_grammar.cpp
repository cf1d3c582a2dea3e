// GBNF parsing, byte-level matching and token masks. Oracles: hand-worked grammar languages, a
// brute-force walk over every code point for the UTF-8 splitting, and token-by-token matching for
// the masks (independent of the trie walk that computes them).
#include <gtest/gtest.h>

#include <random>

#include "grammar/gbnf.h"
#include "grammar/matcher.h"
#include "test_support.h"

#include <nlohmann/json.hpp>

using namespace serval;
using namespace serval::grammar;

namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) s += char(cp);
  else if (cp < 0x800) s += char(0xC0 | (cp >> 6)), s += char(0x80 | (cp & 0x3F));
  else if (cp < 0x10000) s += char(0xE0 | (cp >> 12)), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
  else s += char(0xF0 | (cp >> 18)), s += char(0x80 | ((cp >> 12) & 0x3F)), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
  return s;
}

bool seq_matches(const std::vector<std::pair<uint8_t, uint8_t>>& seq, const std::string& s) {
  if (seq.size() != s.size()) return false;
  for (size_t i = 0; i < s.size(); ++i)
    if (uint8_t(s[i]) < seq[i].first || uint8_t(s[i]) > seq[i].second) return false;
  return true;
}

bool accepts(std::string_view gbnf, std::string_view text) { return matches(parse_gbnf(gbnf), text); }

}  // namespace

TEST(GrammarUtf8, SequencesCoverExactlyTheRange) {
  const std::pair<uint32_t, uint32_t> ranges[] = {{0, 0x10FFFF}, {0x41, 0x5A}, {0x7F, 0x80}, {0x7FF, 0x800},
                                                  {0x1234, 0x10432}, {0xD000, 0xE100}, {0xFFFF, 0x10000}, {0xE9, 0xE9}};
  for (auto [lo, hi] : ranges) {
    const auto seqs = utf8_sequences(lo, hi);
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp += (cp < 0x11000 ? 1 : 37)) {
      if (cp >= 0xD800 && cp <= 0xDFFF) continue;
      const std::string s = utf8(cp);
      int n = 0;
      for (const auto& q : seqs) n += seq_matches(q, s);
      ASSERT_EQ(n, (cp >= lo && cp <= hi) ? 1 : 0) << std::hex << "cp " << cp << " range " << lo << ".." << hi;
    }
  }
}

TEST(GrammarParse, LanguagesOfSmallGrammars) {
  struct Case {
    const char* grammar;
    std::vector<const char*> yes, no;
  };
  const Case cases[] = {
      {R"(root ::= "ab" | "c")", {"ab", "c"}, {"", "a", "abc", "b"}},
      {R"(root ::= "ab"* "!")", {"!", "ab!", "ababab!"}, {"a!", "aba!", "ab"}},
      {R"(root ::= [a-c]+ [0-9]?)", {"a", "abc7", "cc"}, {"", "7", "ad", "a77"}},
      {R"(root ::= "x"{2,4})", {"xx", "xxx", "xxxx"}, {"x", "xxxxx"}},
      {R"(root ::= "x"{3})", {"xxx"}, {"xx", "xxxx"}},
      {R"(root ::= ("a" | "b"){2,} "c")", {"abc", "bbbbc"}, {"ac", "c"}},
      {"root ::= list\nlist ::= \"[\" (item (\",\" item)*)? \"]\"\nitem ::= [0-9]+ | list", {"[]", "[1,[2,[]],33]"}, {"[", "[1,]", "[,]"}},
      {R"(root ::= [^"\\]* # a comment
)", {"", "abc", "é ü 中"}, {"\"", "a\\b"}},
      {R"(root ::= . .)", {"ab", "é中", "\n\t"}, {"a", "abc"}},
      {R"(root ::= "é" [α-ω] "\u4e2d" "\x41")", {"éβ中A"}, {"eβ中A", "éa中A"}},
      {"root ::= a b\na ::= \"x\"?\nb ::= (\n  \"y\" |\n  \"z\"\n)", {"xy", "z"}, {"x", "xyz"}},
  };
  for (const Case& c : cases) {
    const Grammar g = parse_gbnf(c.grammar);
    for (const char* s : c.yes) EXPECT_TRUE(matches(g, s)) << c.grammar << " should accept '" << s << "'";
    for (const char* s : c.no) EXPECT_FALSE(matches(g, s)) << c.grammar << " should refuse '" << s << "'";
  }
}

TEST(GrammarParse, ErrorsNameTheProblem) {
  const std::pair<std::string, const char*> cases[] = {
      {"root ::= foo", "'foo' is used but never defined"},
      {"start ::= \"a\"", "no rule named 'root'"},
      {"root ::= \"a\"\nroot ::= \"b\"", "defined twice"},
      {"root ::= root \"a\" | \"b\"", "left-recursive"},
      {"root ::= x root\nx ::= \"a\"?", "left-recursive"},
      {"root ::= \"abc", "unterminated"},
      {"root ::= [a-", "unterminated character class"},
      {"root ::= [z-a]", "out of order"},
      {"root ::= \"a\"{5,2}", "n < m"},
      {"root ::= \"a\"{20000}", "over 10000"},
      {"root ::= (\"a\"", "expected ')'"},
      {"root = \"a\"", "expected '::='"},
      {"root ::= \"\\q\"", "unknown escape"},
      {"root ::= <think>", "not supported"},
      {"root ::= \"a\" )", "unexpected ')'"},
      {"root ::= " + std::string(300, '(') + "\"a\"" + std::string(300, ')'), "nested deeper than 256"},
      {"root ::= \"\\uD800\"", "surrogate"},
      {"root ::= [\\uD800-\\uDFFF]", "surrogates only"},
      {"root ::= \"\xC0\x80\"", "invalid UTF-8"},      // overlong
      {"root ::= \"\xF7\xBF\xBF\xBF\"", "invalid UTF-8"},  // beyond U+10FFFF
      {"root ::= (\"a\"?)*", "can reach itself without reading"},
  };
  for (auto [text, message] : cases) {
    try {
      parse_gbnf(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(parse_gbnf(std::string(size_t(1) << 21, ' ') + "root ::= \"a\""), Error);
}

TEST(GrammarParse, LiteralRoundTrip) {
  const std::string texts[] = {"plain", "quote \" and \\ back", "new\nline\ttab\r", std::string("nul\x01\x7f", 5), "中文 é"};
  for (const std::string& t : texts) {
    EXPECT_TRUE(accepts("root ::= " + gbnf_literal(t), t)) << t;
    EXPECT_FALSE(accepts("root ::= " + gbnf_literal(t), t + "x")) << t;
  }
}

TEST(GrammarMatch, NestedOptionalRepetitionsExpandOnceEach) {
  // Each (position, caller) pair is expanded once per step: without that, the paths through the
  // nested optional repeats multiply (and recursed deep enough to overflow the stack).
  const Grammar g = parse_gbnf(R"(root ::= ((("a"?){0,4}){0,4}){0,4} "b")");
  EXPECT_TRUE(matches(g, "b"));
  EXPECT_TRUE(matches(g, std::string(64, 'a') + "b"));
  EXPECT_FALSE(matches(g, std::string(65, 'a') + "b"));
  EXPECT_FALSE(matches(g, "aba"));
  // Ambiguous past the limits: a clear error, not a crash or a hang.
  EXPECT_THROW(matches(parse_gbnf(R"(root ::= ((("a"?){0,100}){0,100}){0,100} "b")"), std::string(50, 'a') + "b"), Error);
}

TEST(GrammarMatch, RightRecursionStaysBounded) {
  CompiledGrammar g(parse_gbnf(R"(root ::= "[" [a-z]* "]")"));
  StateId s = g.advance(g.initial(), "[");
  const StateId inside = s;
  for (int i = 0; i < 1000; ++i) s = g.advance(s, "q");
  EXPECT_EQ(s, inside);  // reading a letter returns to the same state
  EXPECT_LT(g.n_states(), 10u);
  EXPECT_TRUE(g.accepting(g.advance(s, "]")));
  EXPECT_FALSE(g.can_continue(g.advance(s, "]")));
  EXPECT_EQ(g.advance(s, "]]"), kDead);
}

namespace {

// Token-by-token oracle: a token is allowed iff its bytes keep the grammar alive.
void expect_mask_matches_oracle(CompiledGrammar& g, StateId s, const TokenVocab& vocab) {
  const auto mask = g.mask(s, vocab);
  for (size_t id = 0; id < vocab.size(); ++id) {
    bool want;
    if (vocab.is_eog(int32_t(id))) want = g.accepting(s);
    else want = !vocab.bytes(int32_t(id)).empty() && g.advance(s, vocab.bytes(int32_t(id))) != kDead;
    ASSERT_EQ(mask->has(int32_t(id)), want) << "token " << id << " '" << vocab.bytes(int32_t(id)) << "'";
  }
}

}  // namespace

TEST(GrammarMask, MatchesTokenByTokenOracleOnARandomVocabulary) {
  std::mt19937 rng(7);
  const std::string alphabet[] = {"a", "b", "{", "}", "\"", ":", ",", " ", "1", "é", "\xe4", "\xb8", "\xad", "中"};
  std::vector<std::string> toks{"", "", "\"", "{", "}"};  // ids 0, 1: control tokens (1 is end of generation)
  for (int i = 0; i < 3000; ++i) {
    std::string t;
    for (int n = 1 + int(rng() % 5); n > 0; --n) t += alphabet[rng() % std::size(alphabet)];
    toks.push_back(t);
  }
  toks.push_back("ab"), toks.push_back("ab");  // two tokens with the same bytes
  const TokenVocab vocab(toks, {1});
  CompiledGrammar g(parse_gbnf(R"(root ::= "{" ws ( pair ( "," ws pair )* )? "}"
pair ::= str ws ":" ws val ws
val ::= str | [0-9]+ | root
str ::= "\"" [^"]* "\""
ws ::= " "?)"));
  std::vector<StateId> states{g.initial()};
  for (const char* prefix : {"{", "{\"", "{\"a", "{\"a\"", "{\"a\": ", "{\"a\": 1", "{\"a\":{\"b\"", "{\"中", "{\"\xe4", "{}"})
    states.push_back(g.advance(g.initial(), prefix));
  for (StateId s : states) {
    ASSERT_NE(s, kDead);
    expect_mask_matches_oracle(g, s, vocab);
  }
  EXPECT_TRUE(g.mask(states.back(), vocab)->has(1));  // complete: end of generation allowed
  EXPECT_EQ(g.mask(states.back(), vocab)->count(), 1u);
  EXPECT_FALSE(g.mask(states[1], vocab)->has(0));  // a control token never is
}

TEST(GrammarMask, MatcherAcceptsOnlyAllowedTokensAndCachesMasks) {
  const TokenVocab vocab({"", "yes", "no", "y", "es", "n", "o", "maybe"}, {0});
  auto g = std::make_shared<CompiledGrammar>(parse_gbnf(R"(root ::= "yes" | "no")"));
  auto vp = std::make_shared<const TokenVocab>(vocab);
  GrammarMatcher m(g, vp);
  auto first = m.allowed();
  EXPECT_TRUE(first->has(1) && first->has(2) && first->has(3) && first->has(5));
  EXPECT_FALSE(first->has(4) || first->has(6) || first->has(7) || first->has(0));
  EXPECT_EQ(m.allowed(), first);  // cached per state
  EXPECT_FALSE(m.accept(7));
  EXPECT_FALSE(m.accept(0));  // end of generation before the end
  EXPECT_TRUE(m.accept(3));
  EXPECT_FALSE(m.accepting());
  EXPECT_TRUE(m.accept(4));
  EXPECT_TRUE(m.is_complete());
  EXPECT_TRUE(m.accept(0));
  GrammarMatcher other(g, vp);  // a second sequence on the same grammar starts over
  EXPECT_EQ(other.allowed(), first);
}

// llama.cpp's grammar engine (llama-gbnf-validator, run outside the repository) on grammars and
// inputs of ours: the same language, so users' grammars mean the same here (tests/data/README.md).
TEST(GrammarParse, AgreesWithLlamaCppOnRecordedVerdicts) {
  const auto doc = nlohmann::json::parse(test::read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/gbnf_llama_cpp.json"));
  size_t n = 0;
  for (const auto& g : doc["grammars"]) {
    const Grammar grammar = parse_gbnf(g["grammar"].get<std::string>());
    for (const auto& c : g["cases"]) {
      const std::string text = c[0].get<std::string>();
      EXPECT_EQ(matches(grammar, text), c[1].get<bool>()) << g["name"] << ": '" << text << "'";
      ++n;
    }
  }
  EXPECT_GT(n, 400u);
}
