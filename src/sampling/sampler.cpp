#include "sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "base/error.h"

namespace serval {

namespace {

// Candidate sets at most this large are sorted whole (their sums then run in sorted order, as a full
// sort would give); larger ones are sorted only as far as needed and summed in token-id order.
constexpr size_t kSortWhole = 1024;
// The sorted prefix of a large candidate set grows by at least this much, and at least doubles.
constexpr size_t kFirstChunk = 64;

}  // namespace

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

// std::max_element's answer (the first largest; NaN never compares larger, and a NaN first element is
// the answer), in two passes that vectorize: the largest value in 16 lanes, then its first index. One
// pass of max_element's compare and branch took 0.39 ms on 151,936 logits, these two 0.06 ms: per
// verified token of speculative decoding, whose rows are all greedy-sampled.
int32_t argmax(std::span<const float> logits) {
  const size_t n = logits.size();
  if (n == 0 || std::isnan(logits[0])) return 0;
  constexpr size_t kLanes = 16;
  float lane[kLanes];
  std::fill(lane, lane + kLanes, -std::numeric_limits<float>::infinity());
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (size_t j = 0; j < kLanes; ++j) lane[j] = logits[i + j] > lane[j] ? logits[i + j] : lane[j];
  float top = *std::max_element(lane, lane + kLanes);
  for (; i < n; ++i) top = logits[i] > top ? logits[i] : top;
  for (size_t k = 0; k < n; ++k)
    if (logits[k] == top) return int32_t(k);
  return 0;  // not reached: logits[0] is a number, so top is one of the logits
}

SampleResult logprobs_of(std::span<const float> logits, int32_t id, int32_t n) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(double(l) - mx);
  const float log_z = mx + float(std::log(sum));
  SampleResult r{id, logits[id] - log_z, {}};
  if (n > 0) {
    // The best n so far, best first; most tokens are rejected by one comparison with the n-th.
    const size_t k = std::min<size_t>(n, logits.size());
    auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::vector<int32_t> best;
    best.reserve(k + 1);
    for (int32_t t = 0; t < int32_t(logits.size()); ++t) {
      if (best.size() == k && !better(t, best.back())) continue;
      best.insert(std::upper_bound(best.begin(), best.end(), t, better), t);
      if (best.size() > k) best.pop_back();
    }
    r.top.reserve(k);
    for (int32_t t : best) r.top.push_back({t, logits[t] - log_z});
  }
  return r;
}

void Sampler::WindowCounts::clear() {
  entries.clear();
  index.clear();
  begin = end = 0;
  last = -1;
}

void Sampler::WindowCounts::add(int32_t token) {
  const auto [it, inserted] = index.try_emplace(token, int32_t(entries.size()));
  if (inserted) entries.push_back({token, 1});
  else ++entries[it->second].second;
}

void Sampler::WindowCounts::remove(int32_t token) {
  const auto it = index.find(token);
  if (it == index.end()) return;  // not expected: every token removed was added
  const int32_t i = it->second;
  if (--entries[i].second > 0) return;
  if (i + 1 < int32_t(entries.size())) {
    entries[i] = entries.back();
    index[entries[i].first] = i;
  }
  entries.pop_back();
  index.erase(it);
}

void Sampler::WindowCounts::update(std::span<const int32_t> history, int32_t window) {
  const size_t n = history.size();
  const size_t first = window < 0 ? 0 : n - std::min<size_t>(n, size_t(window));
  // Not an extension of the history counted so far, or no overlap with it: start over.
  if (n < end || (end > 0 && history[end - 1] != last) || first < begin || first >= end) {
    clear();
    begin = end = first;
  }
  for (; begin < first; ++begin) remove(history[begin]);
  for (; end < n; ++end) add(history[end]);
  last = n > 0 ? history[n - 1] : -1;
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
  const bool penalties = p.repeat_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  std::span<const float> logits = raw;
  if (penalties || !p.logit_bias.empty()) {
    work_.assign(raw.begin(), raw.end());
    for (const auto& [id, bias] : p.logit_bias) work_[id] += bias;
    if (penalties) {
      counts_.update(history, p.repeat_last_n);
      for (const auto& [id, count] : counts_.entries) {
        if (id < 0 || id >= int32_t(work_.size())) continue;
        float& l = work_[id];
        l = l > 0 ? l / p.repeat_penalty : l * p.repeat_penalty;
        l -= float(count) * p.frequency_penalty + p.presence_penalty;
      }
    }
    logits = work_;
  }
  const int32_t chosen = p.temperature <= 0 ? argmax(logits) : sample_tempered(logits);
  if (!p.compute_logprob && p.n_logprobs == 0) return {chosen, std::numeric_limits<float>::quiet_NaN(), {}};
  return logprobs_of(raw, chosen, p.n_logprobs);
}

// Candidates in order of logit (lowest id on ties): top-k, then top-p and min-p on the untempered
// softmax of the top-k, then a draw from the tempered softmax of what is left. Only a prefix of the
// order is ever sorted: as far as top-p's mass, min-p's cut or the drawn token reach.
int32_t Sampler::sample_tempered(std::span<const float> logits) {
  const auto& p = params_;
  const size_t n_vocab = logits.size();
  const size_t k = p.top_k > 0 ? std::min<size_t>(p.top_k, n_vocab) : n_vocab;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  idx_.resize(n_vocab);
  std::iota(idx_.begin(), idx_.end(), 0);
  if (k < n_vocab) std::nth_element(idx_.begin(), idx_.begin() + k, idx_.end(), by_logit);  // idx_[0, k): top-k
  // The last of the top-k in order: a token is a candidate when it does not come after it.
  const int32_t kth = k < n_vocab ? *std::max_element(idx_.begin(), idx_.begin() + k, by_logit) : -1;
  auto candidate = [&](int32_t t) { return kth < 0 || !by_logit(kth, t); };

  size_t sorted = 0;  // idx_[0, sorted) is in order
  auto sort_to = [&](size_t n) {
    if (n <= sorted) return;
    n = k <= kSortWhole ? k : std::min(k, std::max({n, 2 * sorted, sorted + kFirstChunk}));
    if (n < k) std::nth_element(idx_.begin() + sorted, idx_.begin() + n, idx_.begin() + k, by_logit);
    std::sort(idx_.begin() + sorted, idx_.begin() + n, by_logit);
    sorted = n;
  };
  sort_to(1);
  const float top = logits[idx_[0]];
  // Untempered probabilities (relative to the top token); for a large candidate set they are computed
  // once for the whole vocabulary, for a small one where needed.
  bool all_probs = false;
  auto prob = [&](int32_t t) { return all_probs ? prob_[t] : std::exp(double(logits[t]) - top); };
  auto need_all_probs = [&] {
    if (all_probs) return;
    prob_.resize(n_vocab);
    for (size_t t = 0; t < n_vocab; ++t) prob_[t] = std::exp(double(logits[t]) - top);
    all_probs = true;
  };
  auto weight = [&](int32_t t) {
    return p.temperature == 1.0f ? prob(t) : std::exp((double(logits[t]) - top) / p.temperature);
  };
  // f summed over the first n candidates in order when they are sorted, else over the candidates
  // `in` accepts in token-id order (the same value up to rounding in the last bits).
  auto sum_over = [&](size_t n, auto f, auto in) {
    double s = 0;
    if (n <= sorted) {
      for (size_t i = 0; i < n; ++i) s += f(idx_[i]);
    } else {
      need_all_probs();
      for (int32_t t = 0; t < int32_t(n_vocab); ++t)
        if (in(t)) s += f(t);
    }
    return s;
  };

  size_t keep = k;
  if (p.top_p < 1.0f) {
    const double sum = sum_over(k, prob, candidate);
    double cum = 0;
    for (size_t i = 0; i < k; ++i) {
      sort_to(i + 1);
      cum += prob(idx_[i]) / sum;
      if (cum >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  const double min_prob = p.min_p * prob(idx_[0]);
  bool min_p_cut = false;  // keep was counted over an unsorted candidate set
  if (p.min_p > 0.0f) {
    if (keep <= sorted) {
      while (keep > 1 && prob(idx_[keep - 1]) < min_prob) --keep;
    } else {  // probabilities fall along the order: those >= min_prob are a prefix of it
      need_all_probs();
      size_t n = 0;
      for (int32_t t = 0; t < int32_t(n_vocab); ++t) n += candidate(t) && prob_[t] >= min_prob;
      keep = std::max<size_t>(1, n);
      min_p_cut = true;
    }
  }
  const double total =
      sum_over(keep, weight, [&](int32_t t) { return candidate(t) && (!min_p_cut || prob_[t] >= min_prob); });
  double u = next_uniform() * total;
  for (size_t i = 0; i < keep; ++i) {
    sort_to(i + 1);
    const double w = weight(idx_[i]);
    if (u < w) return idx_[i];
    u -= w;
  }
  sort_to(keep);
  return idx_[keep - 1];
}

}  // namespace serval
