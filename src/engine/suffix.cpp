#include "engine/suffix.h"

#include <algorithm>
#include <cmath>
#include <queue>

namespace serval {

namespace {

// Occurrences of the longest match: where each continuation starts, in the order they were found.
struct Matches {
  int32_t length = 0;
  std::vector<std::span<const int32_t>> continuations;

  // An occurrence matching `len` tokens followed by `after`: kept if it is among the longest.
  void offer(int32_t len, std::span<const int32_t> after) {
    if (len < length || after.empty()) return;
    if (len > length) length = len, continuations.clear();
    continuations.push_back(after);
  }
};

// How many of the tokens ending at a[ia] and b[ib] (inclusive) agree, reading backwards, at most `cap`.
int32_t backward_match(std::span<const int32_t> a, int64_t ia, std::span<const int32_t> b, int64_t ib, int32_t cap) {
  int32_t k = 0;
  while (k < cap && ia - k >= 0 && ib - k >= 0 && a[size_t(ia - k)] == b[size_t(ib - k)]) ++k;
  return k;
}

// The continuations' trie, votes per node, grown best first into a draft.
class VoteTrie {
 public:
  explicit VoteTrie(int32_t max_depth) : max_depth_(max_depth) { nodes_.push_back({-1, -1, 0, 0}); }

  void add(std::span<const int32_t> continuation) {
    int32_t at = 0;
    ++nodes_[0].votes;
    const size_t n = std::min<size_t>(continuation.size(), size_t(max_depth_));
    for (size_t d = 0; d < n; ++d) at = child(at, continuation[d]), ++nodes_[size_t(at)].votes;
  }

  // Best first: the candidate with the most votes (the earlier-made one on a tie, which came from the
  // first occurrence offered), while it has at least p_min of the root's votes.
  SuffixDraft grow(int32_t limit, int32_t width, float p_min) const {
    SuffixDraft out;
    const float total = float(nodes_[0].votes);
    if (total == 0) return out;
    auto worse = [&](int32_t a, int32_t b) {
      const auto &na = nodes_[size_t(a)], &nb = nodes_[size_t(b)];
      return na.votes != nb.votes ? na.votes < nb.votes : a > b;
    };
    std::priority_queue<int32_t, std::vector<int32_t>, decltype(worse)> open(worse);
    std::vector<int32_t> slot(nodes_.size(), -1), taken(nodes_.size(), 0);
    for (int32_t c : children_of(0)) open.push(c);
    while (!open.empty() && int32_t(out.tokens.size()) < limit) {
      const int32_t n = open.top();
      open.pop();
      const Node& node = nodes_[size_t(n)];
      const float p = float(node.votes) / total;
      if (p < p_min) break;  // every other candidate has no more votes
      if (taken[size_t(node.parent)] >= width) continue;
      ++taken[size_t(node.parent)];
      slot[size_t(n)] = int32_t(out.tokens.size());
      out.tokens.push_back(node.token);
      out.parents.push_back(node.parent == 0 ? -1 : slot[size_t(node.parent)]);
      out.score += p;
      for (int32_t c : children_of(n)) open.push(c);
    }
    return out;
  }

 private:
  struct Node {
    int32_t token, parent, votes, first_child;  // first_child 0: none (the root is never a child)
    int32_t next_sibling = 0;
  };
  int32_t max_depth_;
  std::vector<Node> nodes_;

  int32_t child(int32_t at, int32_t token) {
    int32_t last = 0;
    for (int32_t c = nodes_[size_t(at)].first_child; c != 0; c = nodes_[size_t(c)].next_sibling) {
      if (nodes_[size_t(c)].token == token) return c;
      last = c;
    }
    const auto id = int32_t(nodes_.size());
    nodes_.push_back({token, at, 0, 0});
    if (last == 0) nodes_[size_t(at)].first_child = id;
    else nodes_[size_t(last)].next_sibling = id;
    return id;
  }
  std::vector<int32_t> children_of(int32_t at) const {
    std::vector<int32_t> out;
    for (int32_t c = nodes_[size_t(at)].first_child; c != 0; c = nodes_[size_t(c)].next_sibling) out.push_back(c);
    return out;
  }
};

// The draft the matches vote for: depth at most factor x the match length (at least 1), `limit` tokens.
SuffixDraft draft_from(const Matches& m, const SuffixParams& p, int32_t limit) {
  if (m.continuations.empty() || limit <= 0) return {};
  const auto depth = int32_t(std::clamp<double>(std::ceil(double(p.factor) * m.length), 1.0, double(limit)));
  VoteTrie trie(depth);
  for (auto c : m.continuations) trie.add(c);
  SuffixDraft d = trie.grow(limit, p.width, p.p_min);
  d.match = m.length;
  return d;
}

constexpr size_t kMaxPerKey = 256;  // occurrences of one token pair the store keeps (the newest)

uint64_t pair_key(int32_t a, int32_t b) { return uint64_t(uint32_t(a)) << 32 | uint32_t(b); }

}  // namespace

SuffixDraft suffix_draft(std::span<const int32_t> text, const SuffixParams& p, int32_t limit) {
  const auto n = int64_t(text.size());
  Matches m;
  // Latest first, so that on a tie of votes the most recent continuation wins (as prompt lookup's).
  for (int64_t j = n - 2; j >= 0; --j) {
    if (text[size_t(j)] != text[size_t(n - 1)]) continue;
    m.offer(backward_match(text, j, text, n - 1, p.depth), text.subspan(size_t(j + 1)));
  }
  return draft_from(m, p, limit);
}

void SuffixStore::add(std::span<const int32_t> tokens) {
  if (tokens.size() < 3 || max_docs_ <= 0) return;
  docs_.push_back({end_, {tokens.begin(), tokens.end()}});
  for (size_t i = 1; i < tokens.size(); ++i) {
    auto& list = index_[pair_key(tokens[i - 1], tokens[i])];
    list.push_back(end_ + int64_t(i));
    if (list.size() >= 2 * kMaxPerKey) list.erase(list.begin(), list.end() - kMaxPerKey);
  }
  end_ += int64_t(tokens.size());
  if (int64_t(docs_.size()) <= max_docs_ && end_ - base_ <= max_tokens_) return;
  while (docs_.size() > 1 && (int64_t(docs_.size()) > max_docs_ || end_ - base_ > max_tokens_)) {
    docs_.pop_front();
    base_ = docs_.front().start;
  }
  // Drop the stale offsets once there are as many as live tokens (amortized over the adds), so the
  // index holds at most twice the tokens kept.
  if (base_ - cleaned_at_ < end_ - base_) return;
  cleaned_at_ = base_;
  for (auto it = index_.begin(); it != index_.end();) {
    auto& list = it->second;
    list.erase(list.begin(), std::lower_bound(list.begin(), list.end(), base_));
    it = list.empty() ? index_.erase(it) : std::next(it);
  }
}

int64_t SuffixStore::index_entries() const {
  int64_t n = 0;
  for (const auto& [key, list] : index_) n += int64_t(list.size());
  return n;
}

const SuffixStore::Doc* SuffixStore::find(int64_t offset) const {
  auto it = std::upper_bound(docs_.begin(), docs_.end(), offset, [](int64_t o, const Doc& d) { return o < d.start; });
  return it == docs_.begin() ? nullptr : &*std::prev(it);
}

SuffixDraft SuffixStore::draft(std::span<const int32_t> text, const SuffixParams& p, int32_t limit) const {
  const auto n = int64_t(text.size());
  if (n < 2 || docs_.empty()) return {};
  const auto it = index_.find(pair_key(text[size_t(n - 2)], text[size_t(n - 1)]));
  if (it == index_.end()) return {};
  Matches m;
  for (auto o = it->second.rbegin(); o != it->second.rend() && *o >= base_; ++o) {  // newest first
    const Doc* d = find(*o);
    const std::span<const int32_t> doc(d->tokens);
    const int64_t at = *o - d->start;
    m.offer(backward_match(doc, at, text, n - 1, p.depth), doc.subspan(size_t(at + 1)));
  }
  return draft_from(m, p, limit);
}

SuffixProposer::SuffixProposer(const SpeculativeConfig& c, int32_t min_match)
    : params_{c.suffix_depth, c.suffix_factor, c.suffix_p_min, c.tree_width},
      min_match_(min_match),
      store_(c.suffix_cache) {}

void SuffixProposer::propose(std::span<Request* const> reqs, std::span<const int32_t> limits) {
  for (size_t i = 0; i < reqs.size(); ++i) {
    Request& r = *reqs[i];
    SuffixDraft d = suffix_draft(r.tokens, params_, limits[i]);
    if (d.match < min_match_) d = {};
    if (store_.docs() > 0) {
      SuffixDraft g = store_.draft(r.tokens, params_, limits[i]);
      if (g.match >= min_match_ && g.score > d.score) d = std::move(g);
    }
    r.cut_draft(0);
    r.draft = std::move(d.tokens);
    if (params_.width > 1) r.draft_parents = std::move(d.parents);
  }
}

void SuffixProposer::finished(const Request& r) {
  store_.add(std::span<const int32_t>(r.tokens).subspan(size_t(r.n_prompt)));
}

}  // namespace serval
