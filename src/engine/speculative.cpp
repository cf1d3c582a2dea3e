#include "engine/speculative.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "engine/heads.h"
#include "engine/suffix.h"
#include "sampling/sampler.h"

namespace serval {

SpecMethod parse_spec_method(const std::string& name) {
  if (name == "none" || name.empty()) return SpecMethod::None;
  if (name == "ngram") return SpecMethod::Ngram;
  if (name == "draft") return SpecMethod::Draft;
  if (name == "heads") return SpecMethod::Heads;
  if (name == "suffix") return SpecMethod::Suffix;
  fail("unknown speculative method '{}' (none, ngram, draft, heads or suffix)", name);
}

const char* to_string(SpecMethod m) {
  switch (m) {
    case SpecMethod::None: return "none";
    case SpecMethod::Ngram: return "ngram";
    case SpecMethod::Draft: return "draft";
    case SpecMethod::Heads: return "heads";
    case SpecMethod::Suffix: return "suffix";
  }
  return "?";
}

void SpeculativeConfig::validate() const {
  check(draft_max >= 1 && draft_max <= 64, "--draft-max must be 1..64 (got {})", draft_max);
  check(draft_min >= 1 && draft_min <= draft_max, "--draft-min must be 1..draft-max (got {})", draft_min);
  check(ngram_min >= 0 && lookup_min() <= ngram_max && ngram_max <= 64,
        "n-gram sizes must satisfy 1 <= min <= max <= 64 (got {}..{})", lookup_min(), ngram_max);
  check(max_running >= 1, "--spec-max-running must be at least 1 (got {})", max_running);
  check(draft_p_min >= 0 && draft_p_min <= 1, "--draft-p-min must be 0..1 (got {})", draft_p_min);
  check(method != SpecMethod::Draft || draft_model, "speculative method 'draft' needs a draft model (--model-draft)");
  check(method != SpecMethod::Heads || heads, "speculative method 'heads' needs a heads file (--spec-heads FILE)");
  check(!lookup_first() || method == SpecMethod::Draft || method == SpecMethod::Heads,
        "lookup first needs a draft model or heads behind it (ngram+draft, ngram+heads, suffix+draft or "
        "suffix+heads)");
  check(first == SpecMethod::None || first == SpecMethod::Ngram || first == SpecMethod::Suffix,
        "only prompt lookup or suffix speculation can go first");
  check(tree_width >= 1 && tree_width <= 64, "--spec-tree-width must be 1..64 (got {})", tree_width);
  check(heads_p_min >= 0 && heads_p_min <= 1, "--spec-heads-p-min must be 0..1 (got {})", heads_p_min);
  check(suffix_depth >= 1 && suffix_depth <= 64, "--spec-suffix-depth must be 1..64 (got {})", suffix_depth);
  check(suffix_factor > 0 && suffix_factor <= 64, "--spec-suffix-factor must be in (0, 64] (got {})", suffix_factor);
  check(suffix_p_min >= 0 && suffix_p_min <= 1, "--spec-suffix-p-min must be 0..1 (got {})", suffix_p_min);
  check(suffix_cache >= 0 && suffix_cache <= 1000000, "--spec-suffix-cache must be 0..1000000 (got {})",
        suffix_cache);
  check(draft_backoff_max >= 0 && draft_backoff_max <= 1024, "--draft-backoff must be 0..1024 (got {})",
        draft_backoff_max);
}

void SpeculativeConfig::set_method(const std::string& name) {
  const auto plus = name.find('+');
  const std::string lead = plus == std::string::npos ? "" : name.substr(0, plus);
  const std::string rest = plus == std::string::npos ? name : name.substr(plus + 1);
  check(plus == std::string::npos || ((lead == "ngram" || lead == "suffix") && (rest == "draft" || rest == "heads")),
        "unknown speculative method '{}' (none, ngram, suffix, draft, heads, or ngram+ / suffix+ then draft or heads)",
        name);
  first = plus == std::string::npos ? SpecMethod::None : parse_spec_method(lead);
  method = parse_spec_method(rest);
}

std::string SpeculativeConfig::method_name() const {
  return lookup_first() ? std::string(to_string(first)) + "+" + to_string(method) : to_string(method);
}

int32_t next_spec_len(int32_t current, size_t n_draft, size_t n_accepted, int32_t cap) {
  if (n_accepted < n_draft) return int32_t(n_accepted) + 1;
  return std::min(cap, 2 * std::max(1, current));
}

void check_same_vocabulary(const Model& target, const Model& draft) {
  const auto &a = target.tokenizer(), &b = draft.tokenizer();
  check(a.n_vocab() == b.n_vocab(), "the draft model's vocabulary has {} tokens, the target's {}", b.n_vocab(),
        a.n_vocab());
  check(draft.config().n_vocab >= a.n_vocab(), "the draft model's output has {} rows for {} tokens",
        draft.config().n_vocab, a.n_vocab());
  for (int32_t id = 0; id < a.n_vocab(); ++id)
    check(a.token_to_piece(id, true) == b.token_to_piece(id, true),
          "the draft model's token {} is '{}', the target's '{}'", id, b.token_to_piece(id, true),
          a.token_to_piece(id, true));
}

// ---- prompt lookup -------------------------------------------------------------------------------

std::vector<int32_t> NgramProposer::lookup(std::span<const int32_t> tokens, int32_t ngram_min, int32_t ngram_max,
                                           int32_t limit) {
  const int64_t n = int64_t(tokens.size());
  for (int64_t g = std::min<int64_t>(ngram_max, n - 1); g >= ngram_min; --g) {
    const auto key = tokens.subspan(n - g);
    // The most recent earlier occurrence that has at least one token after it.
    for (int64_t i = n - g - 1; i >= 0; --i) {
      if (!std::equal(key.begin(), key.end(), tokens.begin() + i)) continue;
      const int64_t from = i + g, to = std::min<int64_t>(n, from + limit);
      return {tokens.begin() + from, tokens.begin() + to};
    }
  }
  return {};
}

void NgramProposer::propose(std::span<Request* const> reqs, std::span<const int32_t> limits) {
  for (size_t i = 0; i < reqs.size(); ++i)
    reqs[i]->cut_draft(0), reqs[i]->draft = lookup(reqs[i]->tokens, config_.lookup_min(), config_.ngram_max, limits[i]);
}

LookupFirstProposer::LookupFirstProposer(const SpeculativeConfig& config, std::unique_ptr<Proposer> fallback)
    : fallback_(std::move(fallback)) {
  if (config.first == SpecMethod::Suffix) lookup_ = std::make_unique<SuffixProposer>(config, config.lookup_min());
  else lookup_ = std::make_unique<NgramProposer>(config);
}

void LookupFirstProposer::propose(std::span<Request* const> reqs, std::span<const int32_t> limits) {
  lookup_->propose(reqs, limits);
  rest_.clear();
  rest_limits_.clear();
  for (size_t i = 0; i < reqs.size(); ++i)
    if (reqs[i]->draft.empty()) rest_.push_back(reqs[i]), rest_limits_.push_back(limits[i]);
  if (!rest_.empty()) fallback_->propose(rest_, rest_limits_);
}

// ---- draft model ---------------------------------------------------------------------------------

DraftModelProposer::DraftModelProposer(const SpeculativeConfig& config, int32_t block_size)
    : model_(*config.draft_model),
      block_size_(block_size),
      p_min_(config.draft_p_min),
      backoff_max_(config.draft_backoff_max) {
  const auto& c = model_.config();
  const int64_t per_block = c.kv_bytes_per_token(2) * block_size;
  const int32_t n_blocks = int32_t(std::max<uint64_t>(1, config.draft_kv_bytes / uint64_t(per_block)));
  n_tokens_ = int64_t(n_blocks) * block_size;
  KvManagerConfig kc;
  kc.block_size = block_size;
  kc.prefix_caching = false;
  for (int g = 0; g < c.n_kv_groups(); ++g) {
    kc.blocks_per_group.push_back(n_blocks);
    kc.window_per_group.push_back(c.kv_group_is_swa(g) ? c.sliding_window : 0);
  }
  kv_ = std::make_unique<KvManager>(kc);
  empty_hit_.blocks.resize(c.n_kv_groups());
  cache_ = std::make_unique<KvCache>(c, n_tokens_, DType::F16);
  batch_ = Batch(c.n_kv_groups());
  batch_.block_size = block_size;
}

// Logits more than 20 below the top add at most e^-20 each: over 152K tokens 3e-4 to a sum of at least
// 1, nothing against a threshold like 0.8, and most of a vocabulary is that far down. Skipping their
// exp() makes this a compare per logit instead of an exp (about 1 ms per draft token on 152K).
float DraftModelProposer::top_probability(std::span<const float> logits, int32_t best) {
  double sum = 0;
  const float top = logits[size_t(best)], cut = top - 20.0f;
  for (float l : logits)
    if (l > cut) sum += std::exp(double(l - top));
  return float(1.0 / sum);
}

void DraftModelProposer::add_to_batch(Seq& seq, int32_t row, int32_t token, int64_t pos, bool logits) {
  batch_.tokens.push_back(token);
  batch_.positions.push_back(int32_t(pos));
  batch_.seq_ids.push_back(row);
  batch_.want_logits.push_back(logits);
  for (int g = 0; g < batch_.n_groups(); ++g)
    batch_.slots[g].push_back(seq.kv.table(g)[pos / block_size_] * block_size_ + int32_t(pos % block_size_));
}

bool DraftModelProposer::drafts_now(Seq& seq) {
  if (seq.skip == 0) return true;
  --seq.skip;
  return false;
}

void DraftModelProposer::record_outcome(Seq& seq, bool empty) {
  seq.backoff = empty ? std::min(backoff_max_, std::max(1, 2 * seq.backoff)) : 0;
  seq.skip = seq.backoff;
}

void DraftModelProposer::propose(std::span<Request* const> reqs, std::span<const int32_t> limits) {
  // Each request drafting: the last known token at n - 1 and drafts at n .. n + limit - 2 need KV.
  std::vector<std::pair<Request*, Seq*>> active;
  std::vector<int32_t> want;
  for (size_t i = 0; i < reqs.size(); ++i) {
    Request& r = *reqs[i];
    r.cut_draft(0);
    Seq& seq = seqs_[r.id];
    // Its last token is run again (for its logits); KV past it belongs to rejected drafts.
    seq.computed = std::min(seq.computed, r.num_tokens() - 1);
    const int64_t need = r.num_tokens() + limits[i] - 1;
    if (limits[i] < 1 || need > n_tokens_ || !drafts_now(seq)) continue;
    const KvAllocation* have = seq.kv.empty() ? nullptr : &seq.kv;
    if (!kv_->can_allocate(have, have ? nullptr : &empty_hit_, need)) continue;
    if (seq.kv.empty()) seq.kv = kv_->allocate(empty_hit_, need);
    else kv_->grow(seq.kv, need);
    active.push_back({&r, &seq});
    want.push_back(limits[i]);
  }
  const int64_t n_vocab = model_.n_logits();  // the draft's head may cover the vocabulary's first tokens only
  const int n_groups = batch_.n_groups();
  for (int32_t round = 0; !active.empty(); ++round) {
    batch_.tokens.clear(), batch_.positions.clear(), batch_.seq_ids.clear(), batch_.want_logits.clear();
    for (int g = 0; g < n_groups; ++g) batch_.slots[g].clear(), batch_.block_tables[g].clear();
    for (size_t s = 0; s < active.size(); ++s) {
      auto [r, seq] = active[s];
      for (int g = 0; g < n_groups; ++g) batch_.block_tables[g].push_back(seq->kv.table(g));
      if (round == 0) {  // catch up on the request's tokens the draft has not seen
        for (int64_t p = seq->computed; p < r->num_tokens(); ++p)
          add_to_batch(*seq, int32_t(s), r->tokens[p], p, p == r->num_tokens() - 1);
        seq->computed = r->num_tokens();
      } else {
        add_to_batch(*seq, int32_t(s), r->draft.back(), seq->computed, true);
        ++seq->computed;
      }
    }
    model_.forward(batch_, *cache_, logits_);
    ++passes_;
    std::vector<std::pair<Request*, Seq*>> next;
    std::vector<int32_t> next_want;
    for (size_t s = 0; s < active.size(); ++s) {
      auto [r, seq] = active[s];
      const std::span<const float> row(logits_.data() + s * n_vocab, size_t(n_vocab));
      const int32_t best = argmax(row);
      kv_->commit(seq->kv, {}, seq->computed);
      const bool confident = top_probability(row, best) >= p_min_;
      if (round == 0) record_outcome(*seq, !confident);
      if (!confident) continue;  // stop guessing for this one
      r->draft.push_back(best);
      if (int32_t(r->draft.size()) < want[s]) next.push_back(active[s]), next_want.push_back(want[s]);
    }
    active = std::move(next);
    want = std::move(next_want);
  }
}

void DraftModelProposer::forget(const Request& r) { seqs_.erase(r.id); }

int64_t DraftModelProposer::blocks_in_use() const {
  int64_t n = 0;
  for (int g = 0; g < kv_->n_groups(); ++g) n += kv_->pool(g).n_blocks() - kv_->pool(g).n_free();
  return n;
}

// ---- decoding heads ------------------------------------------------------------------------------

void HeadsProposer::propose(std::span<Request* const> reqs, std::span<const int32_t> limits) {
  for (size_t i = 0; i < reqs.size(); ++i) {
    Request& r = *reqs[i];
    r.cut_draft(0);
    auto it = last_.find(r.id);
    if (it == last_.end() || it->second.n_tokens != r.num_tokens()) continue;  // no hidden state for its last token
    const int32_t last = r.tokens.back();  // the token that hidden state gave
    const float* h = it->second.hidden.data();
    if (width_ > 1) heads_.propose_tree(h, last, limits[i], width_, r.draft, r.draft_parents, p_min_);
    else heads_.propose(h, last, limits[i], r.draft, p_min_);
  }
}

void HeadsProposer::verified(const Request& r, const float* hidden) {
  if (!hidden) return;
  Last& l = last_[r.id];
  l.n_tokens = r.num_tokens();
  l.hidden.assign(hidden, hidden + heads_.n_embd);
}

std::unique_ptr<Proposer> make_proposer(const SpeculativeConfig& config, const Model& target, int32_t block_size) {
  config.validate();
  if (config.lookup_first()) {
    SpeculativeConfig fallback = config;
    fallback.first = SpecMethod::None;
    return std::make_unique<LookupFirstProposer>(config, make_proposer(fallback, target, block_size));
  }
  switch (config.method) {
    case SpecMethod::None: return nullptr;
    case SpecMethod::Ngram: return std::make_unique<NgramProposer>(config);
    case SpecMethod::Suffix: return std::make_unique<SuffixProposer>(config);
    case SpecMethod::Draft:
      check_same_vocabulary(target, *config.draft_model);
      return std::make_unique<DraftModelProposer>(config, block_size);
    case SpecMethod::Heads:
      check(config.heads->n_embd == target.config().n_embd, "the heads are for hidden size {}, the model's is {}",
            config.heads->n_embd, target.config().n_embd);
      return std::make_unique<HeadsProposer>(*config.heads, config.tree_width, config.heads_p_min);
  }
  return nullptr;
}

}  // namespace serval
