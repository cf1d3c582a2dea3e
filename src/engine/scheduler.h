// Iteration-level scheduler: each step it plans which requests advance by how many tokens, under a
// token budget (chunked prefill) and a sequence cap, allocating their KV (ask, then commit). When the
// pool runs dry the lowest-priority running request is preempted (blocks freed, recomputed later).
#pragma once
#include <cstdint>
#include <deque>
#include <vector>

#include "engine/request.h"
#include "kv/kv_manager.h"

namespace serval {

enum class SchedulingPolicy { Fcfs, Priority };

struct SchedulerConfig {
  int64_t max_batched_tokens = 512;  // tokens per step, all requests together
  int32_t max_seqs = 64;             // running requests at most
  SchedulingPolicy policy = SchedulingPolicy::Fcfs;
};

struct ScheduledRequest {
  Request* request;
  int64_t num_new_tokens;  // tokens num_computed_tokens .. +num_new_tokens get their KV this step
};

struct SchedulerOutput {
  std::vector<ScheduledRequest> scheduled;
  std::vector<Request*> preempted;
  int64_t num_tokens = 0;
  bool empty() const { return scheduled.empty(); }
};

struct SchedulerStats {
  int64_t prefix_queries = 0;  // prompt tokens looked up in the prefix cache
  int64_t prefix_hits = 0;     // of which found cached
  int64_t preemptions = 0;
};

class Scheduler {
 public:
  Scheduler(KvManager& kv, SchedulerConfig config);

  // Queues a request (state Waiting).
  void add(Request* request);
  // Plans one step and allocates the KV it needs.
  SchedulerOutput schedule();
  // Takes a request out of the queues (finished or aborted) and frees its KV at once.
  void remove(Request* request);

  const std::vector<Request*>& running() const { return running_; }
  const std::deque<Request*>& waiting() const { return waiting_; }
  const SchedulerStats& stats() const { return stats_; }
  const SchedulerConfig& config() const { return config_; }

 private:
  KvManager& kv_;
  SchedulerConfig config_;
  std::vector<Request*> running_;
  std::deque<Request*> waiting_;
  SchedulerStats stats_;

  bool before(const Request* a, const Request* b) const;  // served earlier
  Request* pick_victim() const;
  void preempt(Request* r, SchedulerOutput& out, int64_t& budget);
  bool schedule_running(Request* r, SchedulerOutput& out, int64_t& budget);
  void schedule_waiting(SchedulerOutput& out, int64_t& budget);
};

}  // namespace serval
