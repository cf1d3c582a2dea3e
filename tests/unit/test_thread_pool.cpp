// The compute pool: every task of a job runs exactly once, jobs nest and race safely, -t is honoured.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "base/cpu.h"
#include "base/thread_pool.h"

namespace serval {
namespace {

struct ThreadsGuard {
  int saved = compute_threads();
  ~ThreadsGuard() { set_compute_threads(saved); }
};

TEST(ThreadPool, EveryTaskRunsExactlyOnce) {
  ThreadsGuard guard;
  for (int threads : {1, 2, 3, 8}) {
    set_compute_threads(threads);
    for (int64_t n : {0, 1, 2, 7, 1000, 100000}) {
      std::vector<std::atomic<int>> hits(n);
      parallel_for(n, [&](int64_t i) { hits[i].fetch_add(1, std::memory_order_relaxed); });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "task " << i << " of " << n << ", " << threads << " threads";
    }
  }
}

TEST(ThreadPool, UsesTheConfiguredThreadsAndNoMore) {
  ThreadsGuard guard;
  set_compute_threads(3);
  EXPECT_EQ(pool_threads(), 3);
  std::vector<std::atomic<int>> per_thread(3);
  std::atomic<int> bad{0};
  parallel_for(3000, [&](int64_t) {
    const int t = pool_thread_index();
    if (t < 0 || t >= 3) bad.fetch_add(1);
    else per_thread[t].fetch_add(1);
    for (volatile int spin = 0; spin < 200; ++spin) {
    }
  });
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(per_thread[0] + per_thread[1] + per_thread[2], 3000);
}

TEST(ThreadPool, NestedJobsRunInlineAndComplete) {
  ThreadsGuard guard;
  set_compute_threads(2);
  std::atomic<int64_t> sum{0};
  parallel_for(8, [&](int64_t i) { parallel_for(10, [&](int64_t j) { sum.fetch_add(i * 10 + j); }); });
  EXPECT_EQ(sum.load(), 79 * 80 / 2);
}

TEST(ThreadPool, JobsFromSeveralThreadsAtOnceAllComplete) {
  ThreadsGuard guard;
  set_compute_threads(2);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep) parallel_for(100, [&](int64_t) { total.fetch_add(1); });
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 50 * 100);
}

// Each change of the thread count rebuilds the pool on the next job, so the old pool is destroyed
// while its workers may not have run yet. A worker that first ran after the destructor's wake-up used
// to sleep forever (the join hung); a hang here fails the run at ctest's timeout.
TEST(ThreadPool, RebuildingRightAfterStartDoesNotHang) {
  ThreadsGuard guard;
  for (int i = 0; i < 300; ++i) {
    set_compute_threads(2 + i % 2);
    std::atomic<int> n{0};
    parallel_for(2, [&](int64_t) { n.fetch_add(1); });
    ASSERT_EQ(n.load(), 2);
  }
}

}  // namespace
}  // namespace serval
