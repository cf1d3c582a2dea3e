// Suffix speculation (after SuffixDecoding, Oliaro et al. 2024): the request's own tokens (prompt and
// output so far) and the outputs of earlier requests (a bounded store) are searched for the longest
// match of the request's last tokens, up to `depth` tokens. Every occurrence of that match votes for
// what followed it: the continuations form a trie whose node counts say how often each continuation
// occurred. The proposal is grown from that trie best first (the node whose path has the most votes),
// while a node's share of the votes is at least `p_min`, with at most `width` children per node and at
// most `factor` x the match length tokens: a long match is trusted further than a one-token one.
// Prompt lookup is the special case of one occurrence (the latest) of a match of at most 4 tokens.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "engine/request.h"
#include "engine/speculative.h"

namespace serval {

struct SuffixParams {
  int32_t depth = 24;      // longest match looked for (vLLM's suffix_decoding_max_tree_depth)
  float factor = 1.0f;     // tokens proposed <= factor x match length (suffix_decoding_max_spec_factor)
  float p_min = 0.1f;      // a node needs this share of the occurrences' votes (suffix_decoding_min_token_prob)
  int32_t width = 1;       // children per node (1: a chain)
};

// A proposal: tokens with their parents (-1: the last known token), parents before children; `score`
// is the expected number of accepted tokens if each node is kept with its share of the votes.
struct SuffixDraft {
  std::vector<int32_t> tokens, parents;
  float score = 0;
  int32_t match = 0;  // length of the matched suffix
};

// The longest match of the end of `text` within `text` itself (excluding the end), and the continuations
// it proposes, at most `limit` tokens.
SuffixDraft suffix_draft(std::span<const int32_t> text, const SuffixParams& p, int32_t limit);

// Earlier requests' outputs, the oldest dropped beyond `max_docs` documents or `max_tokens` tokens (the
// newest document is always kept; 4 Mi tokens are about 50 MB with the index), indexed by their token
// pairs.
class SuffixStore {
 public:
  explicit SuffixStore(int32_t max_docs, int64_t max_tokens = int64_t(1) << 22)
      : max_docs_(max_docs), max_tokens_(max_tokens) {}
  void add(std::span<const int32_t> tokens);
  // The longest match of the end of `text` (at least 2 tokens) in the stored outputs, as suffix_draft.
  SuffixDraft draft(std::span<const int32_t> text, const SuffixParams& p, int32_t limit) const;
  int64_t docs() const { return int64_t(docs_.size()); }
  int64_t tokens() const { return end_ - base_; }
  int64_t index_entries() const;  // offsets in the index, stale ones included

 private:
  struct Doc {
    int64_t start;  // offset of tokens[0] in the store's numbering
    std::vector<int32_t> tokens;
  };
  int32_t max_docs_;
  int64_t max_tokens_;
  std::deque<Doc> docs_;
  int64_t base_ = 0, end_ = 0;  // offsets of the oldest kept token and one past the newest
  // (t[i-1], t[i]) -> offsets i, oldest first; offsets below base_ are stale and skipped.
  std::unordered_map<uint64_t, std::vector<int64_t>> index_;
  int64_t cleaned_at_ = 0;  // base_ when the index was last cleared of stale offsets
  const Doc* find(int64_t offset) const;
};

// The proposer (`--spec suffix`): the better-scoring of the request's own draft and the store's;
// the outputs of requests that finish (stop or length) join the store.
class SuffixProposer : public Proposer {
 public:
  // Drafts from matches shorter than min_match tokens are dropped (in front of a draft model or heads).
  explicit SuffixProposer(const SpeculativeConfig& config, int32_t min_match = 1);
  void propose(std::span<Request* const> reqs, std::span<const int32_t> limits) override;
  bool makes_trees() const override { return params_.width > 1; }
  bool sizes_own_drafts() const override { return true; }  // the match length sizes a draft
  void finished(const Request& r) override;
  const SuffixStore& store() const { return store_; }

 private:
  SuffixParams params_;
  int32_t min_match_;
  SuffixStore store_;
};

}  // namespace serval
