// Regex to GBNF, checked against std::regex (ECMAScript, an independent implementation) on hand-picked
// and random strings, plus Python-only syntax, non-ASCII text and every refused construct.
#include <gtest/gtest.h>

#include <random>
#include <regex>
#include <string>
#include <vector>

#include "base/error.h"
#include "grammar/gbnf.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"

namespace serval::grammar {
namespace {

struct OracleCase {
  std::string pattern;
  std::string alphabet;               // random strings are drawn from these characters
  std::vector<std::string> samples;   // hand-picked strings
};

const std::vector<OracleCase> kOracleCases = {
    {"abc", "abc", {"abc", "ab", "abcc", ""}},
    {"a|b|c", "abcd", {"a", "c", "ab", ""}},
    {"a(b|c)*d", "abcd", {"ad", "abcbd", "abd", "a", "bd"}},
    {"(ab)+", "ab", {"ab", "abab", "aba", ""}},
    {"a?b?c?", "abc", {"", "abc", "ac", "ca", "aa"}},
    {"a{2,4}", "ab", {"a", "aa", "aaaa", "aaaaa"}},
    {"a{3}", "a", {"aa", "aaa", "aaaa"}},
    {"(ab){2,}", "ab", {"ab", "abab", "ababab", "aba"}},
    {"[a-c]+x", "abcdx", {"x", "ax", "cbax", "dx"}},
    {"[^ab]*", "abc1 ", {"", "c1 c", "ca"}},
    {"\\d+(\\.\\d{1,2})?", "12.a", {"1", "12.3", "1.234", ".5", "1."}},
    {"\\w+@\\w+\\.com", "a1_@.com", {"a@b.com", "a_1@x1.com", "@b.com", "a@b.con"}},
    {"(a|ab)(c|bcd)(d*)", "abcd", {"abcd", "ac", "abcdd", "abd"}},
    {"(a*)*b", "ab", {"b", "aab", "", "a", "aba"}},
    {"(a*b*)*c", "abc", {"c", "abbac", "ab"}},
    {"((a|b)?c){2,3}", "abc", {"cc", "acbc", "ccc", "cccc", "c"}},
    {"(|a)+b", "ab", {"b", "ab", "aab", "a"}},
    {"(?:x|)*y", "xy", {"y", "xxy", "x"}},
    {"(a{0,2}b){1,2}", "ab", {"b", "aab", "abaab", "aaab", ""}},
    {"x*?y+?", "xy", {"", "y", "xxyy", "yx"}},
    {"^(foo|bar)$", "fobar", {"foo", "bar", "fo", "foobar"}},
    {"(?:a|b)*abb", "ab", {"abb", "babb", "ab", "abba"}},
    {"\\s*a\\s*", "a \t\n", {"a", " a\t", "\na\n ", "aa"}},
    {"[.]\\.", ".a", {"..", "a.", "."}},
    {".a.", "ab. \t", {"bab", " a ", "aa", "ba"}},
    {"[\\]\\\\-]+", "]\\-a", {"]", "\\-]", "a"}},
    {"\\D\\W\\S", "a1 _.", {"a a", "1 a", "a_a", ". ."}},
    {"[^\\d\\s]+", "a1 .", {"a.", "a1", ""}},
    {"\\x41\\u0042[\\x30-\\x32]", "AB0123", {"AB0", "AB2", "AB3", "ab0"}},
    {"a{0}b", "ab", {"b", "ab"}},
    {"(a|b|)(c|)", "abc", {"", "a", "ac", "c", "ca"}},
    {"a(?:b(?:c(?:d)?)?)?", "abcd", {"a", "abc", "abcd", "ad"}},
    {"[a-cx-z]{2}|q", "abcxyzq", {"ax", "zz", "q", "qq", "aq"}},
    {"\"[^\"\\\\]*\"", "\"\\a", {"\"\"", "\"a\"", "\"\\\"", "\"a"}},
    // a group whose only non-empty part is quantified, quantified again (the grammar fuzzer's
    // "((\x15b?){0}c?){0,3}" once became `"c"?{0,3}`, which GBNF cannot parse)
    {"(a{0}c?){0,3}", "ac", {"", "c", "ccc", "cccc", "a"}},
    {"((ab?){0}c+){2}", "abc", {"cc", "ccc", "c", "abcc"}},
};

std::string random_string(std::mt19937& rng, const std::string& alphabet) {
  std::string s;
  const size_t len = rng() % 8;
  for (size_t i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
  return s;
}

TEST(Regex, AgreesWithStdRegex) {
  std::mt19937 rng(1234);
  for (const OracleCase& c : kOracleCases) {
    SCOPED_TRACE(c.pattern);
    const std::string gbnf = regex_to_gbnf(c.pattern);
    const Grammar g = parse_gbnf(gbnf);
    const std::regex re(c.pattern, std::regex::ECMAScript);
    std::vector<std::string> inputs = c.samples;
    for (int i = 0; i < 300; ++i) inputs.push_back(random_string(rng, c.alphabet));
    int matched = 0;
    for (const std::string& s : inputs) {
      const bool expected = std::regex_match(s, re);
      matched += expected;
      ASSERT_EQ(matches(g, s), expected) << "input '" << s << "'\n" << gbnf;
    }
    EXPECT_GT(matched, 0);  // the test data exercises both outcomes
    EXPECT_LT(matched, int(inputs.size()));
  }
}

// Syntax std::regex lacks (Python's), and characters beyond ASCII (std::regex works on bytes).
TEST(Regex, PythonSyntaxAndUnicode) {
  const std::vector<std::tuple<std::string, std::string, bool>> cases = {
      {"(?P<word>ab)+", "abab", true},   {"(?P<word>ab)+", "aba", false},
      {"(?<n>x)y", "xy", true},          {"a{,2}", "", true},
      {"a{,2}", "aa", true},             {"a{,2}", "aaa", false},
      {"\\U0001F600+", "😀😀", true},    {"\\u{1F600}", "😀", true},
      {"é+", "éé", true},                {"é+", "e", false},
      {"[α-ω]+", "λόγ", false},          {"[α-ω]+", "λογ", true},
      {"a.b", "aéb", true},              {"a.b", "a😀b", true},
      {"a.b", "a\nb", false},            {"[^a]", "日", true},
      {"[^a]", "a", false},              {"\\W", "é", true},
      {"\\s", "\u3000", true},           {"\\S", "\u3000", false},
      {"[\\s\\S]", "\n", true},          {"[\\b]", "\b", true},
      {"\\0", std::string(1, '\0'), true}, {"(?:^a|^b)c$", "bc", true},
      {"^$", "", true},                  {"\\$\\^", "$^", true},
  };
  for (const auto& [pattern, text, expected] : cases) {
    EXPECT_EQ(matches(parse_gbnf(regex_to_gbnf(pattern)), text), expected) << pattern << " on '" << text << "'";
  }
}

TEST(Regex, LongRepetitionsAndRuleName) {
  const Grammar g = parse_gbnf(regex_to_gbnf("a{1000}"));
  EXPECT_TRUE(matches(g, std::string(1000, 'a')));
  EXPECT_FALSE(matches(g, std::string(999, 'a')));
  EXPECT_FALSE(matches(g, std::string(1001, 'a')));
  const std::string named = regex_to_gbnf("[0-9]+", "my-number");
  EXPECT_EQ(named.rfind("my-number ::= ", 0), 0u) << named;
  EXPECT_TRUE(matches(parse_gbnf(named, "my-number"), "123"));
  EXPECT_TRUE(matches(parse_gbnf(regex_to_gbnf("")), ""));
  EXPECT_FALSE(matches(parse_gbnf(regex_to_gbnf("")), "a"));
}

TEST(Regex, RefusesUnsupportedSyntax) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"(a)\\1", "backreference"},       {"(?P<n>a)(?P=n)", "backreference"},
      {"\\k<n>", "backreference"},       {"(?=a)a", "lookahead"},
      {"(?!a)b", "lookahead"},           {"(?<=a)b", "lookbehind"},
      {"(?<!a)b", "lookbehind"},         {"a\\b", "word boundaries"},
      {"\\Ba", "word boundaries"},       {"(?i)abc", "inline flags"},
      {"(?#note)a", "group syntax"},     {"a*+", "possessive"},
      {"a++", "possessive"},             {"a^b", "'^' in the middle"},
      {"a$b", "'$' in the middle"},      {"(^a)*", "'^' in the middle"},
      {"^*a", "quantifier on an anchor"}, {"(a", "missing ')'"},
      {"a)", "unbalanced ')'"},          {"[a", "missing ']'"},
      {"[z-a]", "bad character range"},  {"[a-\\d]", "bad character range"},
      {"a{10001}", "above 10000"},       {"a{3,2}", "bad repetition range"},
      {"*a", "nothing to repeat"},       {"a**", "multiple repeat"},
      {"\\p{L}", "Unicode property"},    {"[[:alpha:]]", "POSIX"},
      {"[]a]", "\\]"},                   {"a{x", "escaped as \\{"},
      {"\\q", "unsupported escape"},     {"\\x4", "hexadecimal"},
      {"\\uD800", "scalar value"},       {"\\01", "octal"},
      {"ab\\", "ends with"},             {"\xFF", "UTF-8"},
      {"[^\\s\\S]", "matches nothing"},  {"(?P<1a>x)", "group name"},
  };
  for (const auto& [pattern, message] : cases) {
    try {
      regex_to_gbnf(pattern);
      ADD_FAILURE() << "accepted " << pattern;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << pattern << ": " << e.what();
    }
  }
}

}  // namespace
}  // namespace serval::grammar
