// CPU resources: how many cores this process may use, and the process-wide number of compute threads.
// OpenMP's thread count is per thread (a new thread starts with the runtime's default), so the count
// is kept here and every thread that runs model compute applies it: the main thread through
// set_compute_threads, EngineLoop's thread on start and before each step.
#pragma once
#include <optional>
#include <string>

namespace serval {

// Cores this process may run on: the CPUs of its affinity mask (sched_getaffinity), capped by its
// cgroup's CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us, rounded up); at least 1.
int available_cores();

// The tightest CPU quota of this process's cgroup and its ancestors, in cores (quota / period);
// nullopt when there is none. `root` prefixes every path read (/proc/self/cgroup,
// /proc/self/mountinfo, the cgroup files): tests point it at a fake tree.
std::optional<double> cgroup_cpu_limit(const std::string& root = "");

// Sets the compute thread count: n > 0 that many, n <= 0 available_cores(). Applies it to the
// calling thread at once.
void set_compute_threads(int n);
// The compute thread count (available_cores() until set).
int compute_threads();
// Makes the calling thread's parallel regions use compute_threads() threads.
void apply_compute_threads();

}  // namespace serval
