#include "engine/request.h"

#include <cstring>

namespace serval {

const char* to_string(RequestState s) {
  switch (s) {
    case RequestState::Waiting: return "waiting";
    case RequestState::Running: return "running";
    case RequestState::Preempted: return "preempted";
    case RequestState::Finished: return "finished";
  }
  return "?";
}

const char* to_string(FinishReason r) {
  switch (r) {
    case FinishReason::None: return "none";
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Abort: return "abort";
    case FinishReason::Error: return "error";
  }
  return "?";
}

Request::Request(RequestId id_, std::vector<int32_t> prompt, GenerationParams params_, TokenCallback cb, int64_t arrival_)
    : id(id_), tokens(std::move(prompt)), n_prompt(int64_t(tokens.size())), params(std::move(params_)),
      on_token(std::move(cb)), arrival(arrival_), sampler(params.sampling) {}

uint64_t Request::cache_salt() const {
  if (params.adapter < 0) return 0;
  uint32_t bits;
  std::memcpy(&bits, &params.adapter_scale, 4);
  // Any fixed mixing works: the salt only has to differ between (adapter, scale) pairs.
  uint64_t h = (uint64_t(uint32_t(params.adapter) + 1) << 32 | bits) * 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 29) ^ 0x5E7A1u;
}

}  // namespace serval
