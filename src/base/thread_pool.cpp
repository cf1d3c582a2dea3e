#include "base/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SERVAL_PAUSE() _mm_pause()
#else
#define SERVAL_PAUSE() std::this_thread::yield()
#endif

#include "base/cpu.h"

namespace serval {
namespace {

thread_local int t_thread_index = 0;
thread_local bool t_in_job = false;

// The ticket packs the job's task count and the next task to hand out, so a claim (one CAS) is
// valid only for the job it was read from: count in the high 32 bits, next index in the low 32.
constexpr uint64_t pack(uint64_t n, uint64_t next) { return (n << 32) | next; }
constexpr int64_t ticket_n(uint64_t t) { return int64_t(t >> 32); }
constexpr int64_t ticket_next(uint64_t t) { return int64_t(t & 0xFFFFFFFFu); }

class Pool {
 public:
  explicit Pool(int n_threads) : n_threads_(n_threads) {
    // A worker starts from the generation at construction, not the one it finds when it first runs:
    // a job (or the destructor) may have moved it on already, and that must not be mistaken for seen.
    const uint32_t start = generation_.load(std::memory_order_acquire);
    for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i, start] { worker(i, start); });
  }
  ~Pool() {
    stop_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int size() const { return n_threads_; }

  // One job at a time (the caller holds the pool's mutex).
  void run(int64_t n_tasks, detail::TaskFn fn, void* ctx) {
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(pack(uint64_t(n_tasks), 0), std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    work(0);
    for (int spins = 0; done_.load(std::memory_order_acquire) != n_tasks; ++spins) {
      if (spins < 4096) SERVAL_PAUSE();
      else std::this_thread::yield();
    }
    ticket_.store(0, std::memory_order_release);
  }

 private:
  // Claims and runs tasks until none are left, several per claim when a job has many (about 16 claims
  // per thread: a claim and its count are two contended atomics, which cost more than a row's work).
  // fn_ and ctx_ are read after a successful claim: they were written before the ticket was published,
  // and are not rewritten until every claimed task is done, so a late worker never runs a task of the
  // wrong job.
  void work(int thread) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while (ticket_next(t) < ticket_n(t)) {
      const int64_t n = ticket_n(t), first = ticket_next(t);
      const int64_t step = std::max<int64_t>(1, n / (int64_t(n_threads_) * kClaimsPerThread));
      const int64_t last = std::min(n, first + step);
      if (!ticket_.compare_exchange_weak(t, pack(uint64_t(n), uint64_t(last)), std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;
      t_in_job = true;
      for (int64_t task = first; task < last; ++task) fn_(ctx_, task, thread);
      t_in_job = false;
      done_.fetch_add(last - first, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }
  static constexpr int64_t kClaimsPerThread = 16;

  void worker(int index, uint32_t seen) {
    t_thread_index = index;
    for (;;) {
      if (stop_.load(std::memory_order_acquire)) return;
      uint32_t g = seen;
      for (int spins = 0; (g = generation_.load(std::memory_order_acquire)) == seen && spins < 20000; ++spins)
        SERVAL_PAUSE();
      if (g == seen) generation_.wait(seen, std::memory_order_acquire);
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      work(index);
    }
  }

  const int n_threads_;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> generation_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> stop_{false};
  detail::TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
};

std::mutex g_pool_mutex;
std::unique_ptr<Pool> g_pool;  // guarded by g_pool_mutex

void run_inline(int64_t n_tasks, detail::TaskFn fn, void* ctx) {
  for (int64_t i = 0; i < n_tasks; ++i) fn(ctx, i, t_thread_index);
}

}  // namespace

int pool_thread_index() { return t_thread_index; }
int pool_threads() { return compute_threads(); }

namespace detail {
void run_job(int64_t n_tasks, TaskFn fn, void* ctx) {
  const int threads = compute_threads();
  if (t_in_job || threads <= 1 || n_tasks >= (int64_t(1) << 31)) return run_inline(n_tasks, fn, ctx);
  std::unique_lock lock(g_pool_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return run_inline(n_tasks, fn, ctx);  // another thread's job runs
  if (!g_pool || g_pool->size() != threads) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(threads);
  }
  g_pool->run(n_tasks, fn, ctx);
}
}  // namespace detail

}  // namespace serval
