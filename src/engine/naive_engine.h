// The baseline Serval is measured against, in the same binary: static batches as Hugging Face
// generate() runs them. Each batch is padded to its longest prompt; KV is reserved contiguously for
// (longest prompt + largest max_tokens) per request; every request of the batch keeps computing
// (padding) until the last one is done; the next batch starts only then.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/request.h"
#include "model/model.h"

namespace serval {

struct NaiveRequest {
  std::vector<int32_t> prompt;
  GenerationParams params;
};

struct NaiveResult {
  std::vector<std::vector<int32_t>> outputs;  // generated tokens per request, in input order
  std::vector<double> ttft_s, e2e_s;          // per request, from the start of the run
  int64_t computed_tokens = 0;                // real and padding tokens through the model
  double reserved_slot_steps = 0, used_slot_steps = 0;  // KV reserved vs holding a token, summed over steps
  double seconds = 0;
};

class NaiveEngine {
 public:
  NaiveEngine(const Model& model, int32_t batch_size, DType kv_type = DType::F16);
  // Runs every request to completion in static batches of `batch_size`, in order.
  NaiveResult run(const std::vector<NaiveRequest>& requests);

 private:
  const Model& model_;
  int32_t batch_size_;
  DType kv_type_;
};

}  // namespace serval
