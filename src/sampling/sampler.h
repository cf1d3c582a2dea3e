// Token sampling: logit bias, repetition/presence/frequency penalties, greedy, top-k, top-p, min-p,
// temperature, a seeded RNG per request, and top-n log-probabilities.
//
// Cost per token: a few linear passes over the vocabulary, never a full sort. Greedy is one argmax
// pass. Candidates come from partial selection (nth_element on the top-k, then a sorted prefix that
// grows only as far as top-p's mass or the sampled token needs). Penalties keep counts of the tokens
// in their window, updated by the tokens that entered (and left) it since the previous call.
#pragma once
#include <cstdint>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace serval {

struct SamplingParams {
  float temperature = 0.8f;  // <= 0: greedy
  int32_t top_k = 40;        // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  float repeat_penalty = 1.0f;
  // Tokens of the history (prompt + generated) the three penalties look back over, as llama.cpp's
  // repeat_last_n: the last 64 by default; -1: the whole history; 0: none.
  int32_t repeat_last_n = 64;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<std::pair<int32_t, float>> logit_bias;
  uint64_t seed = 0;
  int32_t n_logprobs = 0;  // top-n log-probabilities to report per token
  // Whether to compute the chosen token's log-probability: a log-sum-exp over the whole vocabulary
  // per token, the largest cost of a greedy step at large vocabularies. False (and n_logprobs 0):
  // SampleResult::logprob is NaN. Nothing else changes (the same tokens are drawn).
  bool compute_logprob = true;

  // Throws Error when a value is out of its valid range.
  void validate(int32_t n_vocab) const;
};

struct TokenLogprob {
  int32_t id;
  float logprob;
};

struct SampleResult {
  int32_t token;
  float logprob;                  // of the chosen token under the raw model distribution (NaN if not computed)
  std::vector<TokenLogprob> top;  // n_logprobs most likely tokens, most likely first
};

// Greedy choice: the highest logit, lowest id on ties.
int32_t argmax(std::span<const float> logits);
// log-softmax of the raw logits at `id`, and the top `n` entries (highest first, lowest id on ties).
SampleResult logprobs_of(std::span<const float> logits, int32_t id, int32_t n);

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // Picks the next token from `logits` given the tokens prompted or generated so far. Successive
  // calls are expected to pass one growing history (each call's history extends the previous one,
  // as the engine's request tokens do): the penalty counts are then updated by the new tokens only.
  // A history that is shorter, or differs at the last token counted, is recounted from scratch.
  SampleResult sample(std::span<const float> logits, std::span<const int32_t> history);

 private:
  // Occurrences of each token in the penalty window history[begin, end), kept across calls.
  struct WindowCounts {
    std::vector<std::pair<int32_t, int32_t>> entries;  // (token, count > 0), in no particular order
    std::unordered_map<int32_t, int32_t> index;        // token -> its position in entries
    size_t begin = 0, end = 0;
    int32_t last = -1;  // history[end - 1] when end > 0

    void clear();
    void add(int32_t token);
    void remove(int32_t token);
    // Brings the window to the last `window` tokens of `history` (< 0: all of it).
    void update(std::span<const int32_t> history, int32_t window);
  };

  SamplingParams params_;
  uint64_t rng_state_;
  WindowCounts counts_;
  // Scratch reused from call to call.
  std::vector<float> work_;
  std::vector<int32_t> idx_;
  std::vector<double> prob_, weight_;

  double next_uniform();  // [0, 1)
  int32_t sample_tempered(std::span<const float> logits);
};

}  // namespace serval
