// Matching a grammar byte by byte, and the per-step token masks of constrained decoding.
//
// A parse state is the set of the grammar's pending stacks (an Earley-like pushdown automaton, as
// llama.cpp's grammar sampler): each stack is the rest of a rule to match and its callers, the top
// always a byte set. Stacks are interned as linked nodes (a stack's id is its identity), states as
// sorted sets of stack ids, and transitions are remembered per (state, byte): the automaton becomes
// a DFA built lazily, as far as it is used.
//
// A token mask is the set of vocabulary tokens whose bytes the state can read. It comes from one
// walk of the vocabulary's byte trie that prunes every subtree the state cannot enter, and it is
// cached per state: inside a JSON string, say, every step is in the same state and costs a lookup.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "grammar/gbnf.h"

namespace serval::grammar {

using StateId = int32_t;
constexpr StateId kDead = -1;

// The vocabulary as bytes, in a trie. Tokens with no bytes (control tokens) are never allowed by a
// grammar; `eog` tokens are allowed when the grammar is complete.
class TokenVocab {
 public:
  TokenVocab(std::vector<std::string> token_bytes, std::vector<int32_t> eog);
  size_t size() const { return bytes_.size(); }
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }
  const std::vector<int32_t>& eog() const { return eog_; }
  bool is_eog(int32_t id) const;

  // The trie in depth-first order: node i > 0 reads byte[i] after its parent (at depth[i] - 1);
  // nodes i+1 .. end[i]-1 are its subtree; tokens[tok_begin[i] .. tok_begin[i+1]) end at it.
  std::vector<uint8_t> byte;
  std::vector<int32_t> depth, end, tok_begin, tokens;
  int32_t max_depth = 0;

 private:
  std::vector<std::string> bytes_;
  std::vector<int32_t> eog_;
};

// A bit per vocabulary token.
struct TokenMask {
  std::vector<uint64_t> bits;
  bool has(int32_t id) const { return (bits[size_t(id) >> 6] >> (id & 63)) & 1; }
  size_t count() const;
};

// A grammar ready for matching, with its lazily built states, transitions and token masks. Shared
// by every request using the same grammar; its methods lock an internal mutex.
class CompiledGrammar {
 public:
  explicit CompiledGrammar(const Grammar& g);

  StateId initial() const { return 0; }
  StateId advance(StateId s, uint8_t byte);
  StateId advance(StateId s, std::string_view bytes);  // kDead if any byte is refused
  bool accepting(StateId s);                           // the text so far is a whole sentence
  bool can_continue(StateId s);                        // some byte may follow

  // The tokens allowed in state s: those whose bytes lead to a live state, and the vocabulary's
  // end-of-generation tokens when s is accepting. Cached per state (up to a memory budget).
  std::shared_ptr<const TokenMask> mask(StateId s, const TokenVocab& vocab);

  // Sizes, for tests and metrics.
  size_t n_states();
  size_t n_cached_masks();

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
  std::mutex mu_;
};

// Whether all of `text` is a sentence of the grammar.
bool matches(const Grammar& g, std::string_view text);

// One sequence's progress through a grammar, token by token.
class GrammarMatcher {
 public:
  GrammarMatcher(std::shared_ptr<CompiledGrammar> grammar, std::shared_ptr<const TokenVocab> vocab);
  std::shared_ptr<const TokenMask> allowed();  // the tokens that may come next
  // Reads token `id`; false (and no change) if the grammar refuses it. An end-of-generation token
  // is accepted only in an accepting state.
  bool accept(int32_t id);
  bool is_complete();  // accepting, and no byte may follow: only end-of-generation remains
  bool accepting();

 private:
  std::shared_ptr<CompiledGrammar> grammar_;
  std::shared_ptr<const TokenVocab> vocab_;
  StateId state_ = 0;
};

}  // namespace serval::grammar
