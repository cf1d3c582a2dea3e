// The scheduler as a planner: which requests run, how many tokens each gets, which one is preempted
// and what preemption gives back, asserted step by step (the engine's tests only see final tokens).
// The engine's part is played here: after a step, each scheduled request's tokens count as computed.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>

#include "engine/scheduler.h"

namespace serval {
namespace {

struct Planner {
  KvManager kv;
  Scheduler sched;
  std::vector<std::unique_ptr<Request>> requests;
  Planner(int32_t blocks, int32_t block_size, SchedulerConfig config)
      : kv(KvManagerConfig{block_size, {blocks}, {0}, false}), sched(kv, config) {}

  Request* add(int n_prompt, int32_t priority = 0) {
    std::vector<int32_t> prompt(n_prompt);
    std::iota(prompt.begin(), prompt.end(), int32_t(100 * (requests.size() + 1)));
    GenerationParams params;
    params.priority = priority;
    requests.push_back(std::make_unique<Request>(RequestId(requests.size()), prompt, params, nullptr,
                                                 int64_t(requests.size())));
    sched.add(requests.back().get());
    return requests.back().get();
  }
  // One step, its tokens then marked computed; a request whose prompt is done gets a new token.
  SchedulerOutput step() {
    SchedulerOutput out = sched.schedule();
    for (const auto& s : out.scheduled) {
      s.request->num_computed_tokens += s.num_new_tokens;
      if (s.request->num_computed_tokens == s.request->num_tokens()) s.request->tokens.push_back(7);
    }
    return out;
  }
};

int64_t sum_new(const SchedulerOutput& out) {
  int64_t n = 0;
  for (const auto& s : out.scheduled) n += s.num_new_tokens;
  return n;
}

TEST(Scheduler, ChunkedPrefillSharesTheTokenBudgetInArrivalOrder) {
  Planner p(64, 4, {16, 8, SchedulingPolicy::Fcfs});
  Request* a = p.add(10);
  Request* b = p.add(10);
  const auto s1 = p.step();
  ASSERT_EQ(s1.scheduled.size(), 2u);
  EXPECT_EQ(s1.scheduled[0].request, a);
  EXPECT_EQ(s1.scheduled[0].num_new_tokens, 10);
  EXPECT_EQ(s1.scheduled[1].request, b);
  EXPECT_EQ(s1.scheduled[1].num_new_tokens, 6) << "the rest of the budget: a chunk of b's prompt";
  EXPECT_EQ(s1.num_tokens, 16);
  const auto s2 = p.step();  // a decodes one token, b finishes its prompt
  ASSERT_EQ(s2.scheduled.size(), 2u);
  EXPECT_EQ(s2.scheduled[0].num_new_tokens, 1);
  EXPECT_EQ(s2.scheduled[1].num_new_tokens, 4);
  EXPECT_EQ(s2.num_tokens, sum_new(s2));
  EXPECT_EQ(s2.num_tokens, 5);
}

TEST(Scheduler, MaxSeqsCapsTheRunningRequests) {
  Planner p(64, 4, {512, 2, SchedulingPolicy::Fcfs});
  p.add(3), p.add(3);
  Request* c = p.add(3);
  const auto s1 = p.step();
  EXPECT_EQ(s1.scheduled.size(), 2u);
  EXPECT_EQ(p.sched.running().size(), 2u);
  ASSERT_EQ(p.sched.waiting().size(), 1u);
  EXPECT_EQ(p.sched.waiting().front(), c);
}

// A pool of 4 blocks of 4 tokens. The first request (4 prompt tokens) runs alone, then decodes while
// the second (8) prefills: the pool is full. When the second needs a third block, the request served
// last is preempted: with the priority policy the lower priority, even though it arrived first (and
// comes first in the running list).
TEST(Scheduler, PreemptionTakesTheLowestPriorityAndGivesEverythingBack) {
  Planner p(4, 4, {512, 8, SchedulingPolicy::Priority});
  Request* low = p.add(4, /*priority=*/5);
  p.step();  // low runs alone
  Request* high = p.add(8, /*priority=*/0);
  p.step();  // high's prompt; low decoded a token and needs a third block now
  EXPECT_EQ(p.kv.pool(0).n_free(), 0);
  const auto s = p.step();
  ASSERT_EQ(s.preempted.size(), 1u);
  EXPECT_EQ(s.preempted[0], low);
  EXPECT_EQ(low->state, RequestState::Preempted);
  EXPECT_EQ(low->num_computed_tokens, 0) << "a preempted request is recomputed from the start";
  EXPECT_TRUE(low->kv.empty()) << "its blocks go back to the pool";
  EXPECT_EQ(low->n_preemptions, 1);
  EXPECT_EQ(p.sched.stats().preemptions, 1);
  ASSERT_EQ(p.sched.waiting().size(), 1u);
  EXPECT_EQ(p.sched.waiting().front(), low);
  ASSERT_EQ(s.scheduled.size(), 1u);
  EXPECT_EQ(s.scheduled[0].request, high);
  EXPECT_EQ(s.num_tokens, 1);
  EXPECT_EQ(p.kv.pool(0).n_free(), 1) << "high holds 3 blocks; low's 2 were freed";
  EXPECT_TRUE(p.step().scheduled.size() == 1) << "low waits: it needs 2 blocks and 1 is free";
}

TEST(Scheduler, FcfsPreemptsTheLatestArrival) {
  Planner p(4, 4, {512, 8, SchedulingPolicy::Fcfs});
  Request* first = p.add(4, /*priority=*/5);  // priorities do not matter under FCFS
  p.step();
  Request* second = p.add(8, /*priority=*/0);
  p.step();
  const auto s = p.step();
  ASSERT_EQ(s.preempted.size(), 1u);
  EXPECT_EQ(s.preempted[0], second);
  ASSERT_EQ(s.scheduled.size(), 1u);
  EXPECT_EQ(s.scheduled[0].request, first);
}

TEST(Scheduler, RemovedRequestsLeaveTheirQueueAndFreeTheirBlocks) {
  Planner p(8, 4, {512, 8, SchedulingPolicy::Fcfs});
  Request* a = p.add(8);
  p.step();
  Request* b = p.add(8, 0);
  p.sched.remove(b);  // still waiting
  EXPECT_TRUE(p.sched.waiting().empty());
  p.sched.remove(a);  // running
  EXPECT_TRUE(p.sched.running().empty());
  EXPECT_EQ(p.kv.pool(0).n_free(), 8);
}

}  // namespace
}  // namespace serval
