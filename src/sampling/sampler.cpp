#include "sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "base/error.h"

namespace serval {

void SamplingParams::validate(int32_t n_vocab) const {
  check(std::isfinite(temperature) && temperature >= 0, "temperature must be >= 0 (got {})", temperature);
  check(std::isfinite(top_p) && top_p > 0 && top_p <= 1, "top_p must be in (0, 1] (got {})", top_p);
  check(std::isfinite(min_p) && min_p >= 0 && min_p <= 1, "min_p must be in [0, 1] (got {})", min_p);
  check(std::isfinite(repeat_penalty) && repeat_penalty > 0, "repeat_penalty must be > 0 (got {})", repeat_penalty);
  check(std::isfinite(presence_penalty) && std::abs(presence_penalty) <= 2, "presence_penalty must be in [-2, 2]");
  check(std::isfinite(frequency_penalty) && std::abs(frequency_penalty) <= 2, "frequency_penalty must be in [-2, 2]");
  check(n_logprobs >= 0 && n_logprobs <= 20, "logprobs must be in [0, 20] (got {})", n_logprobs);
  for (const auto& [id, bias] : logit_bias)
    check(id >= 0 && id < n_vocab && std::isfinite(bias), "logit_bias token {} is outside the vocabulary", id);
}

int32_t argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

SampleResult logprobs_of(std::span<const float> logits, int32_t id, int32_t n) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(double(l) - mx);
  const float log_z = mx + float(std::log(sum));
  SampleResult r{id, logits[id] - log_z, {}};
  if (n > 0) {
    std::vector<int32_t> idx(logits.size());
    std::iota(idx.begin(), idx.end(), 0);
    const auto k = std::min<size_t>(n, idx.size());
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    for (size_t i = 0; i < k; ++i) r.top.push_back({idx[i], logits[idx[i]] - log_z});
  }
  return r;
}

Sampler::Sampler(SamplingParams params) : params_(std::move(params)), rng_state_(params_.seed ^ 0x9E3779B97F4A7C15ull) {}

double Sampler::next_uniform() {  // splitmix64: small, fast, the same everywhere
  uint64_t z = (rng_state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return double(z >> 11) * (1.0 / 9007199254740992.0);
}

SampleResult Sampler::sample(std::span<const float> raw, std::span<const int32_t> history) {
  const auto& p = params_;
  std::vector<float> logits(raw.begin(), raw.end());
  for (const auto& [id, bias] : p.logit_bias) logits[id] += bias;
  if (p.repeat_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    const size_t window = p.repeat_last_n < 0 ? history.size() : std::min<size_t>(history.size(), p.repeat_last_n);
    std::unordered_map<int32_t, int> counts;
    for (size_t i = history.size() - window; i < history.size(); ++i) ++counts[history[i]];
    for (const auto& [id, count] : counts) {
      if (id < 0 || id >= int32_t(logits.size())) continue;
      float& l = logits[id];
      l = l > 0 ? l / p.repeat_penalty : l * p.repeat_penalty;
      l -= float(count) * p.frequency_penalty + p.presence_penalty;
    }
  }
  int32_t chosen;
  if (p.temperature <= 0) {
    chosen = argmax(logits);
  } else {
    // Candidates sorted by logit; top-k, then top-p and min-p on the untempered softmax.
    std::vector<int32_t> idx(logits.size());
    std::iota(idx.begin(), idx.end(), 0);
    size_t k = p.top_k > 0 ? std::min<size_t>(p.top_k, idx.size()) : idx.size();
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), by_logit);
    idx.resize(k);
    std::vector<double> prob(k);
    double sum = 0;
    for (size_t i = 0; i < k; ++i) sum += (prob[i] = std::exp(double(logits[idx[i]]) - logits[idx[0]]));
    size_t keep = k;
    if (p.top_p < 1.0f) {
      double cum = 0;
      for (size_t i = 0; i < k; ++i) {
        cum += prob[i] / sum;
        if (cum >= p.top_p) { keep = i + 1; break; }
      }
    }
    if (p.min_p > 0.0f)
      while (keep > 1 && prob[keep - 1] < p.min_p * prob[0]) --keep;
    std::vector<double> w(keep);
    double total = 0;
    for (size_t i = 0; i < keep; ++i)
      total += (w[i] = std::exp((double(logits[idx[i]]) - logits[idx[0]]) / p.temperature));
    double u = next_uniform() * total;
    chosen = idx[keep - 1];
    for (size_t i = 0; i < keep; ++i) {
      if (u < w[i]) { chosen = idx[i]; break; }
      u -= w[i];
    }
  }
  return logprobs_of(raw, chosen, p.n_logprobs);
}

}  // namespace serval
