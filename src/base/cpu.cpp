#include "base/cpu.h"

#include <sched.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

namespace serval {
namespace {

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) out.push_back(std::move(cur)), cur.clear();
    else cur += c;
  }
  out.push_back(std::move(cur));
  return out;
}

std::optional<long long> to_number(const std::string& s) {
  try {
    size_t used = 0;
    const long long v = std::stoll(s, &used);
    return used == s.size() ? std::optional<long long>(v) : std::nullopt;
  } catch (...) {
    return std::nullopt;
  }
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// Where a cgroup hierarchy is mounted: the mount point and the cgroup path it shows as its root.
struct Mount {
  std::string point, root;
};

// The mount of the v2 hierarchy (v1 = false) or of the v1 hierarchy with the cpu controller.
std::optional<Mount> find_mount(const std::string& mountinfo, bool v1) {
  std::istringstream in(mountinfo);
  std::string line;
  while (std::getline(in, line)) {
    // "ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS"
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    const auto head = split(line.substr(0, dash), ' ');
    const auto tail = split(line.substr(dash + 3), ' ');
    if (head.size() < 5 || tail.size() < 3) continue;
    if (!v1 && tail[0] == "cgroup2") return Mount{head[4], head[3]};
    if (v1 && tail[0] == "cgroup") {
      for (const auto& opt : split(tail[2], ','))
        if (opt == "cpu") return Mount{head[4], head[3]};
    }
  }
  return std::nullopt;
}

// This process's cgroup path in the v2 hierarchy (v1 = false) or the v1 cpu hierarchy.
std::optional<std::string> find_cgroup(const std::string& proc_cgroup, bool v1) {
  std::istringstream in(proc_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    // "ID:CONTROLLERS:PATH"; the v2 line is "0::PATH".
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (!v1 && line.substr(0, a) == "0" && controllers.empty()) return path;
    if (v1)
      for (const auto& c : split(controllers, ','))
        if (c == "cpu") return path;
  }
  return std::nullopt;
}

// Cores allowed by one cgroup directory's files; nullopt when unlimited or unreadable.
std::optional<double> dir_limit(const std::string& dir, bool v1) {
  if (!v1) {
    const auto text = read_file(dir + "/cpu.max");  // "QUOTA PERIOD" or "max PERIOD"
    if (!text) return std::nullopt;
    const auto f = split(trim(*text), ' ');
    if (f.size() != 2) return std::nullopt;
    const auto quota = to_number(f[0]), period = to_number(f[1]);
    if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;
    return double(*quota) / double(*period);
  }
  const auto q = read_file(dir + "/cpu.cfs_quota_us"), p = read_file(dir + "/cpu.cfs_period_us");
  if (!q || !p) return std::nullopt;
  const auto quota = to_number(trim(*q)), period = to_number(trim(*p));  // quota -1: unlimited
  if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;
  return double(*quota) / double(*period);
}

std::optional<double> hierarchy_limit(const std::string& root, const std::string& proc_cgroup,
                                      const std::string& mountinfo, bool v1) {
  const auto path = find_cgroup(proc_cgroup, v1);
  const auto mount = find_mount(mountinfo, v1);
  if (!path || !mount) return std::nullopt;
  // The cgroup's directory: its path relative to what the mount shows as its root.
  std::string rel = *path;
  if (mount->root != "/" && rel.compare(0, mount->root.size(), mount->root) == 0) rel = rel.substr(mount->root.size());
  std::optional<double> best;
  // The cgroup and each ancestor up to the mount point: the tightest quota applies.
  while (true) {
    while (rel.size() > 1 && rel.back() == '/') rel.pop_back();
    const std::string dir = root + mount->point + (rel == "/" ? "" : rel);
    if (const auto l = dir_limit(dir, v1)) best = best ? std::min(*best, *l) : *l;
    if (rel.empty() || rel == "/") break;
    const size_t slash = rel.rfind('/');
    rel = slash == std::string::npos || slash == 0 ? "/" : rel.substr(0, slash);
  }
  return best;
}

int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

std::atomic<int> g_compute_threads{0};  // 0: not set, available_cores()

}  // namespace

std::optional<double> cgroup_cpu_limit(const std::string& root) {
  const auto proc_cgroup = read_file(root + "/proc/self/cgroup");
  const auto mountinfo = read_file(root + "/proc/self/mountinfo");
  if (!proc_cgroup || !mountinfo) return std::nullopt;
  const auto v2 = hierarchy_limit(root, *proc_cgroup, *mountinfo, false);
  const auto v1 = hierarchy_limit(root, *proc_cgroup, *mountinfo, true);
  if (v1 && v2) return std::min(*v1, *v2);
  return v1 ? v1 : v2;
}

int available_cores() {
  int n = affinity_cores();
  if (const auto limit = cgroup_cpu_limit()) n = std::min(n, std::max(1, int(std::ceil(*limit - 1e-9))));
  return n;
}

void set_compute_threads(int n) {
  g_compute_threads.store(n > 0 ? n : available_cores(), std::memory_order_relaxed);
  apply_compute_threads();
}

int compute_threads() {
  int n = g_compute_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  n = available_cores();
  int expected = 0;
  g_compute_threads.compare_exchange_strong(expected, n, std::memory_order_relaxed);
  return g_compute_threads.load(std::memory_order_relaxed);
}

void apply_compute_threads() {
#ifdef _OPENMP
  const int n = compute_threads();
  if (omp_get_max_threads() != n) omp_set_num_threads(n);
#endif
}

}  // namespace serval
