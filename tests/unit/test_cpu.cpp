// available_cores(): the affinity mask capped by the cgroup CPU quota; the compute thread setting.
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "base/cpu.h"

namespace serval {
namespace {

namespace fs = std::filesystem;

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

// A fake root with /proc/self/{cgroup,mountinfo} and cgroup files under /sys/fs/cgroup.
struct FakeRoot {
  fs::path dir = fs::temp_directory_path() / ("serval-cpu-test-" + std::to_string(::getpid()));
  FakeRoot() { fs::remove_all(dir); }
  ~FakeRoot() { fs::remove_all(dir); }
  std::string root() const { return dir.string(); }
};

TEST(Cpu, AvailableCoresFollowsTheAffinityMask) {
  cpu_set_t old;
  ASSERT_EQ(sched_getaffinity(0, sizeof(old), &old), 0);
  const int n = available_cores();
  EXPECT_GE(n, 1);
  EXPECT_LE(n, CPU_COUNT(&old));
  if (const auto limit = cgroup_cpu_limit()) {
    EXPECT_LE(n, std::max(1, int(std::ceil(*limit - 1e-9))));
  }
  // Pinned to one CPU (this thread; sched_getaffinity(0) reads the calling thread's mask), one core.
  int first = 0;
  while (!CPU_ISSET(first, &old)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(available_cores(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(old), &old), 0);
  EXPECT_EQ(available_cores(), n);
}

TEST(Cpu, CgroupV2QuotaOfTheCgroupOrAnAncestor) {
  FakeRoot f;
  write(f.dir / "proc/self/cgroup", "0::/a/b\n");
  write(f.dir / "proc/self/mountinfo",
        "24 30 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n");
  EXPECT_FALSE(cgroup_cpu_limit(f.root()).has_value()) << "no cpu.max anywhere: no limit";
  write(f.dir / "sys/fs/cgroup/a/b/cpu.max", "max 100000\n");
  EXPECT_FALSE(cgroup_cpu_limit(f.root()).has_value()) << "'max' is no limit";
  write(f.dir / "sys/fs/cgroup/a/cpu.max", "150000 100000\n");
  EXPECT_DOUBLE_EQ(cgroup_cpu_limit(f.root()).value(), 1.5) << "an ancestor's quota applies";
  write(f.dir / "sys/fs/cgroup/a/b/cpu.max", "300000 100000\n");
  EXPECT_DOUBLE_EQ(cgroup_cpu_limit(f.root()).value(), 1.5) << "the tightest quota wins";
  write(f.dir / "sys/fs/cgroup/a/b/cpu.max", "50000 100000\n");
  EXPECT_DOUBLE_EQ(cgroup_cpu_limit(f.root()).value(), 0.5);
}

TEST(Cpu, CgroupV1CfsQuotaWithAMountRoot) {
  FakeRoot f;
  write(f.dir / "proc/self/cgroup", "5:memory:/m\n3:cpu,cpuacct:/docker/abc\n0::/\n");
  // A container: the hierarchy's mount shows /docker/abc as its root.
  write(f.dir / "proc/self/mountinfo",
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n");
  write(f.dir / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  write(f.dir / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  EXPECT_FALSE(cgroup_cpu_limit(f.root()).has_value()) << "quota -1 is no limit";
  write(f.dir / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "200000\n");
  EXPECT_DOUBLE_EQ(cgroup_cpu_limit(f.root()).value(), 2.0);
}

TEST(Cpu, NoCgroupFilesMeansNoLimit) {
  FakeRoot f;
  EXPECT_FALSE(cgroup_cpu_limit(f.root()).has_value());
  write(f.dir / "proc/self/cgroup", "garbage\n");
  write(f.dir / "proc/self/mountinfo", "garbage\n");
  EXPECT_FALSE(cgroup_cpu_limit(f.root()).has_value());
}

TEST(Cpu, ComputeThreadSetting) {
  set_compute_threads(3);
  EXPECT_EQ(compute_threads(), 3);
  set_compute_threads(0);
  EXPECT_EQ(compute_threads(), available_cores());
}

}  // namespace
}  // namespace serval
