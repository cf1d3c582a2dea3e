// One engine step as rank 0 sends it to the other ranks: the batch plan, the KV slot copies made
// since the previous step, and the shape of rank 0's KV cache (each rank keeps its share of it).
#pragma once
#include <cstdint>
#include <vector>

#include "dist/comm.h"
#include "model/model.h"

namespace serval::dist {

struct Step {
  bool stop = true;  // a default Step stops the workers
  bool want_hidden = false;
  uint64_t cache_id = 0;
  DType kv_type = DType::F16;
  std::vector<int64_t> n_slots;  // per KV group
  std::vector<KvCache::SlotCopy> copies;
  Batch batch = Batch(1);
};

// The step of a forward pass of `batch` over `kv` (takes kv's pending slot copies).
Step make_step(const Batch& batch, KvCache& kv, bool want_hidden);
// Broadcast from rank 0 (its size, then its bytes); every rank calls them in step.
void send_step(Comm& comm, const Step& step);
Step recv_step(Comm& comm);

}  // namespace serval::dist
