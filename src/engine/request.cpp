#include "engine/request.h"

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

}  // namespace serval
