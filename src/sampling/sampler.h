// Token sampling: logit bias, repetition/presence/frequency penalties, greedy, top-k, top-p, min-p,
// temperature, a seeded RNG per request, and top-n log-probabilities.
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace serval {

struct SamplingParams {
  float temperature = 0.8f;  // <= 0: greedy
  int32_t top_k = 40;        // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  float repeat_penalty = 1.0f;
  int32_t repeat_last_n = 64;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<std::pair<int32_t, float>> logit_bias;
  uint64_t seed = 0;
  int32_t n_logprobs = 0;  // top-n log-probabilities to report per token

  // Throws Error when a value is out of its valid range.
  void validate(int32_t n_vocab) const;
};

struct TokenLogprob {
  int32_t id;
  float logprob;
};

struct SampleResult {
  int32_t token;
  float logprob;                  // of the chosen token under the raw model distribution
  std::vector<TokenLogprob> top;  // n_logprobs most likely tokens, most likely first
};

// Greedy choice: the highest logit, lowest id on ties.
int32_t argmax(std::span<const float> logits);
// log-softmax of the raw logits at `id`, and the top `n` entries.
SampleResult logprobs_of(std::span<const float> logits, int32_t id, int32_t n);

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // Picks the next token from `logits` given the tokens generated or prompted so far.
  SampleResult sample(std::span<const float> logits, std::span<const int32_t> history);

 private:
  SamplingParams params_;
  uint64_t rng_state_;
  double next_uniform();  // [0, 1)
};

}  // namespace serval
