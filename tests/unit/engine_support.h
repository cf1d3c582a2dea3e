// Shared helpers of the engine and speculative-decoding tests: the plain-decoding oracle.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/request.h"
#include "model/model.h"
#include "model/session.h"
#include "sampling/sampler.h"

namespace serval::test {

struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  FinishReason reason = FinishReason::None;
};

// The oracle: one sequence on its own cache, plain decoding, sampled with the same parameters.
inline Outcome run_alone(const Model& m, const std::vector<int32_t>& prompt, const GenerationParams& p,
                         DType kv_type = DType::F16) {
  SingleSequence seq(m, int64_t(prompt.size()) + p.max_tokens, kv_type);
  Sampler sampler(p.sampling);
  std::vector<int32_t> history = prompt;
  auto logits = seq.eval(prompt);
  Outcome o;
  for (int i = 0; i < p.max_tokens; ++i) {
    const auto r = sampler.sample(logits, history);
    o.tokens.push_back(r.token);
    o.logprobs.push_back(r.logprob);
    history.push_back(r.token);
    if (!p.ignore_eos && m.tokenizer().is_end_of_generation(r.token)) return o.reason = FinishReason::Stop, o;
    if (i + 1 < p.max_tokens) logits = seq.eval(std::vector<int32_t>{r.token});
  }
  o.reason = FinishReason::Length;
  return o;
}

}  // namespace serval::test
