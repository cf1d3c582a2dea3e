// The roofline probe (kernels/probe.h): every level the CPU has is measured, the others are not, and
// the AMX probe leaves the tile configuration of the pool's threads as the GEMM loaded it.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "base/cpu.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "kernels/probe.h"
#include "random_blocks.h"

namespace serval {
namespace {

bool cpuinfo_flag(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      std::istringstream words(line);
      for (std::string w; words >> w;)
        if (w == flag) return true;
      return false;
    }
  return false;
}

TEST(Probe, MeasuresExactlyTheLevelsTheCpuHas) {
  cpu::ProbeOptions o;
  o.seconds = 0.005;
  o.read_buffer_bytes = size_t(8) << 20;
  o.read_passes = 2;
  const cpu::RooflinePeaks p = cpu::probe_roofline(o);
  const cpu::Isa isa = cpu::detected_isa();
  EXPECT_EQ(p.threads, compute_threads());
  EXPECT_EQ(p.int8_avx512_ops > 0, int(isa) >= int(cpu::Isa::Avx512));
  EXPECT_EQ(p.int8_amx_ops > 0, isa == cpu::Isa::Amx);
  EXPECT_EQ(p.bf16_avx512_flops > 0, cpu::probe_has_avx512_bf16());
  EXPECT_GT(p.read_bytes_per_s, 0);
  EXPECT_EQ(p.read_buffer_bytes, size_t(8) << 20);
  if (int(isa) >= int(cpu::Isa::Avx512) && std::ifstream("/proc/cpuinfo")) {
    EXPECT_EQ(cpu::probe_has_avx512_bf16(), cpuinfo_flag("avx512_bf16"));
  }
  EXPECT_STREQ(p.int8_peak_level(), isa == cpu::Isa::Amx ? (p.int8_amx_ops > p.int8_avx512_ops ? "amx" : "avx512-vnni")
                                    : int(isa) >= int(cpu::Isa::Avx512) ? "avx512-vnni"
                                                                        : "none");
}

// gemm_amx.cpp loads its tile configuration once per thread; the probe runs on the same pool threads
// and must put that configuration back, or the next product would read tiles of the wrong shape.
TEST(Probe, AmxProbeKeepsTheGemmTileConfiguration) {
  if (cpu::detected_isa() != cpu::Isa::Amx) GTEST_SKIP() << "no AMX on this CPU (" << cpu::isa_name(cpu::detected_isa()) << ")";
  const cpu::Isa saved_isa = cpu::active_isa();
  const int saved_threads = compute_threads();
  cpu::force_isa(cpu::Isa::Amx);
  set_compute_threads(2);
  const int64_t rows = 256, cols = 512, n_tok = 64;
  const auto bytes = test::random_rows(DType::Q8_0, rows, cols, 3);
  WeightMatrix w{DType::Q8_0, rows, cols, bytes.data(), row_bytes(DType::Q8_0, cols)};
  cpu::prepare_weights(w);
  const auto x = test::random_floats(size_t(n_tok * cols), 4);
  std::vector<float> before(rows * n_tok), after(rows * n_tok);
  cpu::matmul(w, x.data(), before.data(), n_tok);
  EXPECT_GT(cpu::probe_int8_amx_ops(0.002), 0);
  cpu::matmul(w, x.data(), after.data(), n_tok);
  EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0);
  set_compute_threads(saved_threads);
  cpu::force_isa(saved_isa);
}

}  // namespace
}  // namespace serval
