// Speculative decoding: a proposer guesses the next few tokens of a request; the engine runs them
// through the target model in the normal flattened batch (one logits row per guess, plus one) and
// keeps the longest prefix the target agrees with, plus the target's own next token.
//
// Proposals are deterministic (a point mass), so verification samples each row with the request's
// own sampler and accepts a guess exactly when the sampled token equals it. For a point-mass draft q
// this *is* the rejection rule of Leviathan et al. / Chen et al. (accept with min(1, p(d)/q(d)) =
// p(d), else sample from norm(max(0, p - q)) = p without d): the output distribution is the target's.
// Each emitted token costs one draw of the request's RNG, in the same order as plain decoding, and
// the forward pass is batch invariant, so the output is token-for-token that of plain decoding, at any
// temperature and seed.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/request.h"
#include "kv/kv_manager.h"
#include "model/model.h"

namespace serval {

struct DecodingHeads;

enum class SpecMethod { None, Ngram, Draft, Heads, Suffix };

// "none", "ngram", "draft", "heads", "suffix"; throws Error otherwise.
SpecMethod parse_spec_method(const std::string& name);
const char* to_string(SpecMethod m);

struct SpeculativeConfig {
  SpecMethod method = SpecMethod::None;
  // Prompt lookup (Ngram) or suffix speculation (Suffix) first; `method` (draft or heads) proposes
  // only for the requests whose lookup found no earlier occurrence of at least `ngram_min` tokens.
  // Named "ngram+draft", "suffix+heads" ...; None: no lookup in front.
  SpecMethod first = SpecMethod::None;
  int32_t draft_max = 8;    // tokens proposed per step at most (llama.cpp's --draft-max)
  int32_t draft_min = 1;    // proposals shorter than this are dropped (llama.cpp's --draft-min)
  int32_t ngram_min = 0;    // prompt lookup: the shortest suffix of the tokens matched (0: lookup_min())
  int32_t ngram_max = 4;    // ... and the longest (tried first)
  int32_t max_running = 4;  // with more running requests than this, nobody speculates
  const Model* draft_model = nullptr;  // SpecMethod::Draft
  // The draft model stops guessing at a token it gives less than this probability (llama.cpp's
  // --draft-p-min): an unlikely guess costs a draft step and is likely rejected.
  float draft_p_min = 0.8f;
  // After a request's draft came back empty (no guess reached draft_p_min), the draft model skips it
  // for 1, 2, 4 ... steps, at most this many (0: never skips); a non-empty draft resets the wait.
  int32_t draft_backoff_max = 8;
  uint64_t draft_kv_bytes = 64ull << 20;  // the draft model's own KV cache
  const DecodingHeads* heads = nullptr;   // SpecMethod::Heads
  // Heads: candidates per head in the token tree (1: one chain of each head's likeliest token). A tree
  // pays only with accurate heads: each token costs verification compute, and the heads trained here
  // (about 40 % top-1) were slower with width 4 than with a chain (docs/speculative.md).
  int32_t tree_width = 1;
  // Heads: a chain stops before the first guess whose path probability (the product of the heads'
  // probabilities of their guesses) is below this; the heads' confidence, not the adaptive length,
  // sets how long a chain is.
  float heads_p_min = 0.3f;
  // Suffix speculation (engine/suffix.h; vLLM's suffix_decoding_* settings): the longest match looked
  // for, tokens proposed per matched token, a node's least share of the occurrences' votes, and how many
  // finished requests' outputs are kept to match against.
  int32_t suffix_depth = 24;
  float suffix_factor = 1.0f;
  float suffix_p_min = 0.1f;
  int32_t suffix_cache = 1000;

  // ngram_min, or by default 1 alone and 3 in front of a draft model or heads: a match of one or two
  // tokens is a poor guess next to theirs.
  int32_t lookup_min() const { return ngram_min > 0 ? ngram_min : lookup_first() ? 3 : 1; }
  bool lookup_first() const { return first != SpecMethod::None; }
  void validate() const;  // throws Error for impossible values
  // "none", "ngram", "suffix", "draft", "heads", or "ngram+" / "suffix+" followed by "draft" or "heads":
  // sets method and first; throws Error otherwise.
  void set_method(const std::string& name);
  std::string method_name() const;  // the name set_method takes
};

// Counters of what speculation proposed and what the target kept (vLLM's spec_decode_* metrics).
struct SpecStats {
  int64_t drafts = 0;           // verification steps with at least one proposed token
  int64_t draft_tokens = 0;     // tokens proposed
  int64_t accepted_tokens = 0;  // of which accepted
  std::vector<int64_t> accepted_per_pos;  // [i]: drafts whose token i was accepted
};

// Adaptive proposal length: after a draft of n_draft tokens of which n_accepted were kept, the next
// proposal may be twice as long (at most `cap`) when all were kept, else one longer than what was kept.
int32_t next_spec_len(int32_t current, size_t n_draft, size_t n_accepted, int32_t cap);

// The draft model must share the target's vocabulary token for token; throws Error naming the first
// difference.
void check_same_vocabulary(const Model& target, const Model& draft);

class Proposer {
 public:
  virtual ~Proposer() = default;
  // Sets reqs[i]->draft to at most limits[i] tokens likely to follow reqs[i]->tokens.
  virtual void propose(std::span<Request* const> reqs, std::span<const int32_t> limits) = 0;
  // Whether verified() needs the target's final hidden states.
  virtual bool wants_hidden() const { return false; }
  // Whether proposals may be token trees (Request::draft_parents); their limit is then a number of
  // tokens, not a chain length that adapts to acceptance.
  virtual bool makes_trees() const { return false; }
  // Whether the proposer sizes its drafts itself (a tree, or heads that stop where they are unsure):
  // it is then given the cap, not the adaptive length (Engine::propose_drafts).
  virtual bool sizes_own_drafts() const { return makes_trees(); }
  // After a step: `r`'s tokens now hold the accepted prefix of its draft and one more token, sampled
  // from the row whose final hidden state (n_embd floats) is `hidden` (when wants_hidden()).
  virtual void verified(const Request& /*r*/, const float* /*hidden*/) {}
  // `r` finished with its whole output (stop or length), before forget(r).
  virtual void finished(const Request& /*r*/) {}
  // `r` finished or was preempted: drop what is kept for it.
  virtual void forget(const Request& /*r*/) {}
  // Blocks of the proposer's own KV cache held for requests (0 for proposers without one).
  virtual int64_t blocks_in_use() const { return 0; }
};

// Prompt lookup: the longest suffix of the request's tokens (ngram_max down to ngram_min tokens) that
// occurred before, most recent occurrence first; proposes the tokens that followed it.
class NgramProposer : public Proposer {
 public:
  explicit NgramProposer(const SpeculativeConfig& config) : config_(config) {}
  void propose(std::span<Request* const> reqs, std::span<const int32_t> limits) override;
  // The proposal for one token sequence (exposed for tests).
  static std::vector<int32_t> lookup(std::span<const int32_t> tokens, int32_t ngram_min, int32_t ngram_max,
                                     int32_t limit);

 private:
  SpeculativeConfig config_;
};

// Lookup first (prompt lookup or suffix speculation, as config.first says: free, and long when the
// output copies the prompt or an earlier output) with matches of at least lookup_min() tokens;
// `fallback` (a draft model or heads) proposes for the requests lookup found nothing for.
class LookupFirstProposer : public Proposer {
 public:
  LookupFirstProposer(const SpeculativeConfig& config, std::unique_ptr<Proposer> fallback);
  void propose(std::span<Request* const> reqs, std::span<const int32_t> limits) override;
  bool wants_hidden() const override { return fallback_->wants_hidden(); }
  bool makes_trees() const override { return lookup_->makes_trees() || fallback_->makes_trees(); }
  bool sizes_own_drafts() const override { return fallback_->sizes_own_drafts(); }
  void verified(const Request& r, const float* hidden) override { fallback_->verified(r, hidden); }
  void finished(const Request& r) override { lookup_->finished(r), fallback_->finished(r); }
  void forget(const Request& r) override { fallback_->forget(r); }
  int64_t blocks_in_use() const override { return fallback_->blocks_in_use(); }

 private:
  std::unique_ptr<Proposer> lookup_;
  std::unique_ptr<Proposer> fallback_;
  std::vector<Request*> rest_;
  std::vector<int32_t> rest_limits_;
};

// A small model of the same vocabulary drafts greedily, with its own paged KV cache: one forward pass
// catches each request up (its new tokens), then one pass per further draft token, all requests batched.
class DraftModelProposer : public Proposer {
 public:
  DraftModelProposer(const SpeculativeConfig& config, int32_t block_size);
  void propose(std::span<Request* const> reqs, std::span<const int32_t> limits) override;
  void forget(const Request& r) override;
  int64_t kv_tokens() const { return n_tokens_; }  // capacity of the draft KV cache
  int64_t forward_passes() const { return passes_; }  // of the draft model, so far
  int64_t blocks_in_use() const override;
  // Softmax probability of `best` (the argmax) in `logits`, within 3e-4 (logits 20 below it are left out).
  static float top_probability(std::span<const float> logits, int32_t best);

 private:
  struct Seq {
    KvAllocation kv;
    int64_t computed = 0;  // leading request tokens whose draft KV is in the cache
    int32_t backoff = 0;   // steps skipped after the last empty draft (0 after a non-empty one)
    int32_t skip = 0;      // steps still to skip
  };
  const Model& model_;
  int32_t block_size_;
  float p_min_;
  int32_t backoff_max_;
  int64_t n_tokens_;
  int64_t passes_ = 0;
  std::unique_ptr<KvManager> kv_;
  std::unique_ptr<KvCache> cache_;
  std::map<RequestId, Seq> seqs_;
  PrefixHit empty_hit_;  // no blocks in any group: where a new sequence starts
  Batch batch_;
  std::vector<float> logits_;

  void add_to_batch(Seq& seq, int32_t row, int32_t token, int64_t pos, bool logits);
  // Whether `seq` drafts this step (its back-off wait counts down otherwise).
  bool drafts_now(Seq& seq);
  void record_outcome(Seq& seq, bool empty);
};

// Medusa-style heads (engine/heads.h): from the hidden state that gave a request's last token, head k
// guesses the token k + 1 places after it. A token tree of each head's `tree_width` likeliest tokens
// (DecodingHeads::propose_tree), or one chain with width 1.
class HeadsProposer : public Proposer {
 public:
  HeadsProposer(const DecodingHeads& heads, int32_t tree_width, float p_min)
      : heads_(heads), width_(tree_width), p_min_(p_min) {}
  bool wants_hidden() const override { return true; }
  bool makes_trees() const override { return width_ > 1; }
  bool sizes_own_drafts() const override { return true; }
  void propose(std::span<Request* const> reqs, std::span<const int32_t> limits) override;
  void verified(const Request& r, const float* hidden) override;
  void forget(const Request& r) override { last_.erase(r.id); }

 private:
  struct Last {
    int64_t n_tokens = 0;  // the request's length when `hidden` was taken
    std::vector<float> hidden;
  };
  const DecodingHeads& heads_;
  int32_t width_;
  float p_min_;
  std::map<RequestId, Last> last_;
};

std::unique_ptr<Proposer> make_proposer(const SpeculativeConfig& config, const Model& target, int32_t block_size);

}  // namespace serval
