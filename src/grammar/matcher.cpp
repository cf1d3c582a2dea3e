#include "grammar/matcher.h"

#include <algorithm>
#include <bit>
#include <numeric>
#include <unordered_set>

#include "base/error.h"

namespace serval::grammar {
namespace {

constexpr int32_t kNone = -1;            // no parent: the bottom of a stack
constexpr int32_t kAcceptStack = 0;      // node 0 stands for the empty stack (the text is complete)
constexpr size_t kMaxNodes = 8u << 20;   // stack nodes per grammar
constexpr size_t kMaxStates = 1u << 20;  // parse states per grammar
constexpr size_t kMaxStacks = 4096;      // stacks in one state (an ambiguous grammar's blow-up)
constexpr size_t kMaxCachedMasks = 512;  // token masks kept per grammar (then the cache restarts)
constexpr size_t kMaxExpansions = 200000;  // (position, parent) pairs expanded in one step
constexpr int32_t kUnknown = -2;

// The grammar flattened: each alternative's elements, then an end marker (kind End).
struct Flat {
  enum Kind : uint8_t { Bytes, Rule, End };
  Kind kind;
  int32_t rule;
  ByteSet bytes;
};

uint64_t hash_ids(const std::vector<int32_t>& v) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t x : v) h = (h ^ uint32_t(x)) * 1099511628211ull;
  return h;
}

}  // namespace

struct CompiledGrammar::Impl {
  std::vector<Flat> flat;
  std::vector<std::vector<int32_t>> starts;  // per rule: the flat position of each alternative
  // Stack nodes: (position, parent node); node 0 is the empty stack.
  struct Node {
    int32_t pos, parent;
  };
  std::vector<Node> nodes{{-1, kNone}};
  std::unordered_map<uint64_t, int32_t> node_ids;
  // States: sorted stack ids whose tops are byte sets (or node 0), and their transitions.
  std::vector<std::vector<int32_t>> states;
  std::vector<int32_t> trans;  // 256 entries per state (kUnknown until first taken), one flat table
  std::unordered_multimap<uint64_t, StateId> state_ids;
  std::unordered_map<StateId, std::shared_ptr<const TokenMask>> masks;
  std::vector<std::pair<int32_t, int32_t>> work;  // expand_all's pending (position, parent)
  std::unordered_set<uint64_t> seen;               // and the pairs it expanded this session
  const TokenVocab* mask_vocab = nullptr;          // the vocabulary the cached masks are for
  size_t mask_vocab_size = 0;

  explicit Impl(const Grammar& g) {
    starts.resize(g.rules.size());
    for (size_t r = 0; r < g.rules.size(); ++r)
      for (const Sequence& alt : g.rules[r].alternatives) {
        starts[r].push_back(int32_t(flat.size()));
        for (const Element& e : alt)
          flat.push_back(e.kind == Element::Bytes ? Flat{Flat::Bytes, -1, e.bytes} : Flat{Flat::Rule, e.rule, {}});
        flat.push_back(Flat{Flat::End, -1, {}});
      }
    for (int32_t start : starts[size_t(g.root)]) work.push_back({start, kNone});
    std::vector<int32_t> first;
    expand_all(first);
    check(intern_state(first) == 0, "grammar: the start rule matches nothing");  // state 0: the start
  }

  int32_t intern_node(int32_t pos, int32_t parent) {
    const uint64_t key = (uint64_t(uint32_t(pos)) << 32) | uint32_t(parent + 1);
    const auto [it, added] = node_ids.try_emplace(key, int32_t(nodes.size()));
    if (added) {
      check(nodes.size() < kMaxNodes, "grammar: too many parse stacks (over {}); the grammar is too complex", kMaxNodes);
      nodes.push_back({pos, parent});
    }
    return it->second;
  }

  // The leaf stacks reached, without reading a byte, from each pending "match flat[pos...], then the
  // stack `parent`" in `work`. Iterative (nesting depth is the grammar's, not the C++ stack's), and
  // each (pos, parent) pair is expanded once per session: nested optional repetitions reach the same
  // pair along many paths.
  void expand_all(std::vector<int32_t>& out) {
    while (!work.empty()) {
      const auto [pos, parent] = work.back();
      work.pop_back();
      if (!seen.insert((uint64_t(uint32_t(pos)) << 32) | uint32_t(parent + 1)).second) continue;
      check(seen.size() <= kMaxExpansions, "grammar: over {} expansions in one step; the grammar is too ambiguous",
            kMaxExpansions);
      const Flat& e = flat[size_t(pos)];
      if (e.kind == Flat::Bytes) {
        out.push_back(intern_node(pos, parent));
      } else if (e.kind == Flat::End) {
        if (parent == kNone) out.push_back(kAcceptStack);
        else work.push_back({nodes[size_t(parent)].pos, nodes[size_t(parent)].parent});
      } else {
        // A rule reference: its alternatives, then what follows it. A reference last in its
        // alternative returns straight to the caller (no node), so right recursion stays bounded.
        const int32_t cont = flat[size_t(pos) + 1].kind == Flat::End ? parent : intern_node(pos + 1, parent);
        for (int32_t start : starts[size_t(e.rule)]) work.push_back({start, cont});
      }
    }
  }

  StateId intern_state(std::vector<int32_t>& stacks) {
    if (stacks.empty()) return kDead;
    std::sort(stacks.begin(), stacks.end());
    stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
    check(stacks.size() <= kMaxStacks, "grammar: a parse state with over {} stacks; the grammar is too ambiguous", kMaxStacks);
    const uint64_t h = hash_ids(stacks);
    for (auto [it, last] = state_ids.equal_range(h); it != last; ++it)
      if (states[size_t(it->second)] == stacks) return it->second;
    check(states.size() < kMaxStates, "grammar: too many parse states (over {})", kMaxStates);
    const StateId id = StateId(states.size());
    states.push_back(stacks);
    trans.resize(trans.size() + 256, kUnknown);
    state_ids.emplace(h, id);
    return id;
  }

  StateId step(StateId s, uint8_t byte) {
    const int32_t known = trans[size_t(s) * 256 + byte];
    if (known != kUnknown) return known;
    std::vector<int32_t> next;
    work.clear();
    seen.clear();
    for (int32_t id : states[size_t(s)]) {
      if (id == kAcceptStack) continue;
      const Node n = nodes[size_t(id)];
      if (flat[size_t(n.pos)].bytes.has(byte)) work.push_back({n.pos + 1, n.parent});
    }
    expand_all(next);
    const StateId r = intern_state(next);
    trans[size_t(s) * 256 + byte] = r;
    return r;
  }

  bool accepting(StateId s) const { return states[size_t(s)].front() == kAcceptStack; }
  bool can_continue(StateId s) const {
    const auto& v = states[size_t(s)];
    return v.size() > 1 || v.front() != kAcceptStack;
  }

  std::shared_ptr<const TokenMask> compute_mask(StateId s, const TokenVocab& vocab);
};

std::shared_ptr<const TokenMask> CompiledGrammar::Impl::compute_mask(StateId s, const TokenVocab& vocab) {
  auto mask = std::make_shared<TokenMask>();
  mask->bits.assign((vocab.size() + 63) / 64, 0);
  auto set = [&](int32_t id) { mask->bits[size_t(id) >> 6] |= uint64_t(1) << (id & 63); };
  std::vector<StateId> at(size_t(vocab.max_depth) + 1);
  at[0] = s;
  const int32_t n = int32_t(vocab.byte.size());
  for (int32_t i = 1; i < n;) {
    const int32_t d = vocab.depth[size_t(i)];
    const StateId next = step(at[size_t(d - 1)], vocab.byte[size_t(i)]);
    if (next == kDead) {
      i = vocab.end[size_t(i)];
      continue;
    }
    at[size_t(d)] = next;
    for (int32_t k = vocab.tok_begin[size_t(i)]; k < vocab.tok_begin[size_t(i) + 1]; ++k) set(vocab.tokens[size_t(k)]);
    ++i;
  }
  if (accepting(s))
    for (int32_t id : vocab.eog()) set(id);
  return mask;
}

CompiledGrammar::CompiledGrammar(const Grammar& g) : impl_(std::make_shared<Impl>(g)) {}

StateId CompiledGrammar::advance(StateId s, uint8_t byte) {
  std::lock_guard lock(mu_);
  return s == kDead ? kDead : impl_->step(s, byte);
}

StateId CompiledGrammar::advance(StateId s, std::string_view bytes) {
  std::lock_guard lock(mu_);
  for (char c : bytes) {
    if (s == kDead) break;
    s = impl_->step(s, uint8_t(c));
  }
  return s;
}

bool CompiledGrammar::accepting(StateId s) {
  std::lock_guard lock(mu_);
  return s != kDead && impl_->accepting(s);
}

bool CompiledGrammar::can_continue(StateId s) {
  std::lock_guard lock(mu_);
  return s != kDead && impl_->can_continue(s);
}

std::shared_ptr<const TokenMask> CompiledGrammar::mask(StateId s, const TokenVocab& vocab) {
  std::lock_guard lock(mu_);
  if (s == kDead) {  // nothing is allowed
    auto none = std::make_shared<TokenMask>();
    none->bits.assign((vocab.size() + 63) / 64, 0);
    return none;
  }
  if (impl_->mask_vocab != &vocab || impl_->mask_vocab_size != vocab.size()) {  // masks are per vocabulary
    impl_->masks.clear();
    impl_->mask_vocab = &vocab, impl_->mask_vocab_size = vocab.size();
  }
  if (auto it = impl_->masks.find(s); it != impl_->masks.end()) return it->second;
  if (impl_->masks.size() >= kMaxCachedMasks) impl_->masks.clear();
  auto m = impl_->compute_mask(s, vocab);
  impl_->masks.emplace(s, m);
  return m;
}

size_t CompiledGrammar::n_states() {
  std::lock_guard lock(mu_);
  return impl_->states.size();
}

size_t CompiledGrammar::n_cached_masks() {
  std::lock_guard lock(mu_);
  return impl_->masks.size();
}

bool matches(const Grammar& g, std::string_view text) {
  CompiledGrammar cg(g);
  return cg.accepting(cg.advance(cg.initial(), text));
}

size_t TokenMask::count() const {
  size_t n = 0;
  for (uint64_t w : bits) n += size_t(std::popcount(w));
  return n;
}

TokenVocab::TokenVocab(std::vector<std::string> token_bytes, std::vector<int32_t> eog)
    : bytes_(std::move(token_bytes)), eog_(std::move(eog)) {
  std::vector<int32_t> order;
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (!bytes_[i].empty() && !is_eog(int32_t(i))) order.push_back(int32_t(i));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return bytes_[size_t(a)] < bytes_[size_t(b)]; });
  byte.push_back(0), depth.push_back(0), end.push_back(0), tok_begin.push_back(0);
  std::vector<int32_t> path{0};  // path[d]: the node at depth d on the current branch
  const std::string* prev = nullptr;
  auto close = [&](size_t keep) {  // ends the subtrees of path[keep..]
    while (path.size() > keep) end[size_t(path.back())] = int32_t(byte.size()), path.pop_back();
  };
  for (int32_t id : order) {
    const std::string& s = bytes_[size_t(id)];
    size_t common = 0;
    if (prev)
      while (common < s.size() && common < prev->size() && s[common] == (*prev)[common]) ++common;
    close(common + 1);
    for (size_t d = common; d < s.size(); ++d) {
      path.push_back(int32_t(byte.size()));
      byte.push_back(uint8_t(s[d])), depth.push_back(int32_t(d + 1)), end.push_back(0);
      tok_begin.push_back(int32_t(tokens.size()));
    }
    tokens.push_back(id);
    max_depth = std::max(max_depth, int32_t(s.size()));
    prev = &s;
  }
  close(0);
  tok_begin.push_back(int32_t(tokens.size()));
}

bool TokenVocab::is_eog(int32_t id) const { return std::find(eog_.begin(), eog_.end(), id) != eog_.end(); }

GrammarMatcher::GrammarMatcher(std::shared_ptr<CompiledGrammar> grammar, std::shared_ptr<const TokenVocab> vocab)
    : grammar_(std::move(grammar)), vocab_(std::move(vocab)), state_(grammar_->initial()) {}

std::shared_ptr<const TokenMask> GrammarMatcher::allowed() { return grammar_->mask(state_, *vocab_); }

bool GrammarMatcher::accept(int32_t id) {
  if (id < 0 || size_t(id) >= vocab_->size()) return false;
  if (vocab_->is_eog(id)) return grammar_->accepting(state_);
  const std::string& b = vocab_->bytes(id);
  if (b.empty()) return false;
  const StateId next = grammar_->advance(state_, b);
  if (next == kDead) return false;
  state_ = next;
  return true;
}

bool GrammarMatcher::accepting() { return grammar_->accepting(state_); }
bool GrammarMatcher::is_complete() { return grammar_->accepting(state_) && !grammar_->can_continue(state_); }

}  // namespace serval::grammar
