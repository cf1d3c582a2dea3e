// GBNF grammars (llama.cpp's format, so users' grammars carry over), parsed into a byte-level form.
//
// Text:   rule-name ::= alternatives        (one rule per line; a rule may continue on the next
//                                             lines inside parentheses or after `|`)
//         "literal" with escapes \n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH
//         [a-z0-9_] [^"\\] character classes (code points), `.` any character
//         ( ... ) groups, a | b alternatives, x* x+ x? x{m} x{m,} x{m,n} repetition, # comments
// Characters are Unicode code points; the parsed grammar works on UTF-8 bytes: every character class
// becomes the byte sequences of its code-point ranges, so a token's bytes are matched one at a time
// and a token may end inside a character.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/error.h"

namespace serval::grammar {

// A set of bytes.
struct ByteSet {
  std::array<uint64_t, 4> bits{};
  void add(uint8_t b) { bits[b >> 6] |= uint64_t(1) << (b & 63); }
  void add_range(uint8_t lo, uint8_t hi) {
    for (unsigned b = lo; b <= hi; ++b) add(uint8_t(b));
  }
  bool has(uint8_t b) const { return (bits[b >> 6] >> (b & 63)) & 1; }
  bool operator==(const ByteSet&) const = default;
};

// One element of a sequence: a byte from `bytes`, or a reference to rule `rule`.
struct Element {
  enum Kind : uint8_t { Bytes, Rule } kind;
  int32_t rule = -1;
  ByteSet bytes;
};

using Sequence = std::vector<Element>;

struct Rule {
  std::string name;
  std::vector<Sequence> alternatives;  // an empty sequence matches the empty string
};

// A parsed grammar: rules[root] is the start rule. Helper rules made for groups, repetitions and
// character classes have names "<parent>-<n>".
struct Grammar {
  std::vector<Rule> rules;
  int32_t root = 0;
};

// Parses GBNF text; `root` names the start rule. Throws serval::Error with the line and column of
// the first problem: a syntax error, an undefined or duplicate rule, a missing root, left recursion
// (a rule that can reach itself without reading a byte), an empty character class, or limits
// (text over 1 MiB, repetition counts over 10000, more than 100000 rules).
Grammar parse_gbnf(std::string_view text, std::string_view root = "root");

// The UTF-8 byte-range sequences that match exactly the code points lo..hi (surrogates excluded):
// each inner vector is one alternative, a byte range per byte position.
std::vector<std::vector<std::pair<uint8_t, uint8_t>>> utf8_sequences(uint32_t lo, uint32_t hi);

// A GBNF string literal for `text` (quoted and escaped).
std::string gbnf_literal(std::string_view text);

}  // namespace serval::grammar
