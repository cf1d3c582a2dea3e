// The compute thread pool: persistent workers that run the tasks of one parallel job at a time.
//
// A job is `n_tasks` independent tasks. Tasks are handed out one at a time through an atomic ticket
// (dynamic scheduling), and the calling thread works on them too: when another process takes a
// core, the threads that still run take over the tasks of the one that does not, instead of waiting
// at a barrier for a fixed share to finish. A call returns once every task has run; workers that
// never woke up are not waited for.
//
// Idle workers spin briefly (the next job of a forward pass follows within microseconds), then sleep
// on a futex. The pool's size is compute_threads() (cpu.h): `-t` sets it; it is rebuilt when the
// setting changes. A job started from inside a task, or while another thread's job runs, runs on
// the calling thread alone (same results: tasks never depend on which thread runs them).
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

namespace serval {

// The thread index of the current task, 0 .. pool_threads()-1 (0 outside a job): per-thread scratch.
int pool_thread_index();
// Threads a job may use (compute_threads()).
int pool_threads();

namespace detail {
using TaskFn = void (*)(void* ctx, int64_t task, int thread);
void run_job(int64_t n_tasks, TaskFn fn, void* ctx);
}  // namespace detail

// Runs fn(task) for every task in [0, n_tasks) on the pool; returns when all have run.
template <class F>
void parallel_for(int64_t n_tasks, F&& fn) {
  if (n_tasks <= 0) return;
  if (n_tasks == 1) return void(fn(int64_t(0)));
  auto call = [](void* ctx, int64_t task, int) { (*static_cast<std::remove_reference_t<F>*>(ctx))(task); };
  detail::run_job(n_tasks, call, const_cast<void*>(static_cast<const void*>(&fn)));
}

}  // namespace serval
