// The roofline probe (kernels/probe.h): runs the per-level loops (probe_*.cpp) on the compute pool,
// and the streaming read of a large buffer (portable code; SSE2 loads on x86-64).
#include "kernels/probe.h"

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <emmintrin.h>
#include <sys/syscall.h>
#endif

#include "base/error.h"
#include "base/thread_pool.h"
#include "kernels/cpu/probe_loops.h"
#include "kernels/isa.h"

namespace serval::cpu {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

using Loop = uint64_t (*)(int64_t iters, uint64_t* sink);

// Calibrates the iteration count on this thread for `seconds`, then runs the loop on every compute
// thread at once (one task per thread); total operations over the job's wall time, best of 3.
double peak(Loop loop, double seconds) {
  uint64_t sink = 0;
  int64_t iters = 1024;
  double t = 0;
  for (;;) {  // also warms the core up to the frequency it keeps under this instruction mix
    const auto t0 = Clock::now();
    loop(iters, &sink);
    t = since(t0);
    if (t > 0.02 || iters > (int64_t(1) << 40)) break;
    iters *= 4;
  }
  iters = std::max<int64_t>(1, int64_t(double(iters) * seconds / t));
  const int threads = pool_threads();
  std::vector<uint64_t> ops(threads), sinks(threads);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    parallel_for(threads, [&](int64_t task) { ops[task] = loop(iters, &sinks[task]); });
    const double wall = since(t0);
    double total = 0;
    for (uint64_t o : ops) total += double(o);
    best = std::max(best, total / wall);
  }
  for (uint64_t s : sinks) sink += s;
  asm volatile("" : : "r"(sink));
  return best;
}

#if defined(__x86_64__)
bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
}
#endif

// Sum of the 64-bit words of [p, p + n) (n a multiple of 128 bytes), four independent accumulators.
uint64_t read_sum(const uint8_t* p, size_t n) {
#if defined(__x86_64__)
  __m128i s0 = _mm_setzero_si128(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < n; i += 128) {
    const __m128i* v = reinterpret_cast<const __m128i*>(p + i);
    s0 = _mm_add_epi64(s0, _mm_add_epi64(_mm_load_si128(v + 0), _mm_load_si128(v + 4)));
    s1 = _mm_add_epi64(s1, _mm_add_epi64(_mm_load_si128(v + 1), _mm_load_si128(v + 5)));
    s2 = _mm_add_epi64(s2, _mm_add_epi64(_mm_load_si128(v + 2), _mm_load_si128(v + 6)));
    s3 = _mm_add_epi64(s3, _mm_add_epi64(_mm_load_si128(v + 3), _mm_load_si128(v + 7)));
  }
  alignas(16) uint64_t w[2];
  _mm_store_si128(reinterpret_cast<__m128i*>(w), _mm_add_epi64(_mm_add_epi64(s0, s1), _mm_add_epi64(s2, s3)));
  return w[0] + w[1];
#else
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i < n / 8; i += 4) s0 += w[i], s1 += w[i + 1], s2 += w[i + 2], s3 += w[i + 3];
  return s0 + s1 + s2 + s3;
#endif
}

size_t default_read_bytes() {
  long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (llc <= 0) llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
  const size_t mib = size_t(1) << 20;
  size_t bytes = std::clamp(size_t(std::max(0L, llc)) * 4, 256 * mib, 2048 * mib);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) bytes = std::min(bytes, size_t(pages) * size_t(page) / 4);
  return bytes;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

bool probe_has_avx512_bf16() {
#if defined(__x86_64__)
  if (int(detected_isa()) < int(Isa::Avx512)) return false;  // ZMM state and AVX-512 F/BW/VL/DQ/VNNI
  unsigned max_sub = 0, b, c, d, eax1 = 0;
  if (__get_cpuid_count(7, 0, &max_sub, &b, &c, &d) == 0 || max_sub < 1) return false;
  __get_cpuid_count(7, 1, &eax1, &b, &c, &d);
  return (eax1 >> 5) & 1u;  // CPUID.(EAX=7, ECX=1):EAX bit 5 = AVX512_BF16
#else
  return false;
#endif
}

double probe_int8_avx512_ops(double seconds) {
#if defined(SERVAL_X86_KERNELS)
  if (int(detected_isa()) >= int(Isa::Avx512)) return peak(probe::vnni_loop, seconds);
#endif
  return 0;
}

double probe_int8_amx_ops(double seconds) {
#if defined(SERVAL_X86_KERNELS)
  if (detected_isa() == Isa::Amx && request_amx()) return peak(probe::amx_loop, seconds);
#endif
  return 0;
}

double probe_bf16_avx512_flops(double seconds) {
#if defined(SERVAL_X86_KERNELS)
  if (probe_has_avx512_bf16()) return peak(probe::bf16_loop, seconds);
#endif
  return 0;
}

double probe_read_bytes_per_s(size_t bytes, int passes) {
  constexpr size_t kChunk = size_t(4) << 20;  // tasks of 4 MiB, claimed dynamically
  bytes = bytes / 4096 * 4096;
  check(bytes >= 4096 && passes > 0, "read probe: {} bytes, {} passes", bytes, passes);
  std::unique_ptr<uint8_t, FreeDeleter> buf(static_cast<uint8_t*>(std::aligned_alloc(4096, bytes)));
  check(buf != nullptr, "read probe: cannot allocate {} bytes", bytes);
  const int64_t n_chunks = int64_t((bytes + kChunk - 1) / kChunk);
  auto chunk = [&](int64_t c) { return std::pair{size_t(c) * kChunk, std::min(bytes, size_t(c + 1) * kChunk)}; };
  parallel_for(n_chunks, [&](int64_t c) {  // first touch by the threads that read (NUMA placement)
    const auto [lo, hi] = chunk(c);
    std::memset(buf.get() + lo, int(c * 37 + 1), hi - lo);
  });
  std::vector<uint64_t> sums(n_chunks);
  double best = 0;
  for (int p = 0; p < passes; ++p) {
    const auto t0 = Clock::now();
    parallel_for(n_chunks, [&](int64_t c) {
      const auto [lo, hi] = chunk(c);
      sums[c] += read_sum(buf.get() + lo, hi - lo);
    });
    best = std::max(best, double(bytes) / since(t0));
  }
  uint64_t sink = 0;
  for (uint64_t s : sums) sink += s;
  asm volatile("" : : "r"(sink));
  return best;
}

RooflinePeaks probe_roofline(const ProbeOptions& o) {
  RooflinePeaks r;
  r.threads = pool_threads();
  r.int8_avx512_ops = probe_int8_avx512_ops(o.seconds);
  r.int8_amx_ops = probe_int8_amx_ops(o.seconds);
  r.bf16_avx512_flops = probe_bf16_avx512_flops(o.seconds);
  r.read_buffer_bytes = o.read_buffer_bytes ? o.read_buffer_bytes : default_read_bytes();
  r.read_passes = o.read_passes;
  r.read_bytes_per_s = probe_read_bytes_per_s(r.read_buffer_bytes, r.read_passes);
  return r;
}

const char* RooflinePeaks::int8_peak_level() const {
  if (int8_amx_ops <= 0 && int8_avx512_ops <= 0) return "none";
  return int8_amx_ops > int8_avx512_ops ? "amx" : "avx512-vnni";
}

std::string RooflinePeaks::describe() const {
  std::string s = fmt::format("{} thread{}:", threads, threads == 1 ? "" : "s");
  auto add = [&](const char* what, double v, const char* unit) {
    s += v > 0 ? fmt::format(" {} {:.2f} {},", what, v * 1e-12, unit) : fmt::format(" {} not run,", what);
  };
  add("int8 avx512-vnni (vpdpbusd)", int8_avx512_ops, "TOPS");
  add("int8 amx (tdpbsud)", int8_amx_ops, "TOPS");
  add("bf16 avx512 (vdpbf16ps)", bf16_avx512_flops, "TFLOPS");
  s += fmt::format(" read {:.1f} GB/s ({} MiB buffer, best of {} passes)", read_bytes_per_s * 1e-9,
                   read_buffer_bytes >> 20, read_passes);
  return s;
}

}  // namespace serval::cpu
