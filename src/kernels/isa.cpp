#include "kernels/isa.h"

#include <atomic>
#include <cstdlib>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "base/error.h"

namespace serval::cpu {
namespace {

#if defined(__x86_64__)
// Linux grants AMX tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
}

// CPUID bits (leaf 1 ECX; leaf 7 sub-leaf 0 EBX, ECX, EDX), and the register state the OS saves (XCR0):
// read directly, as GCC's and clang's __builtin_cpu_supports do not know the same feature names.
struct CpuBits {
  unsigned l1c = 0, l7b = 0, l7c = 0, l7d = 0;
  unsigned long long xcr0 = 0;
  bool has(unsigned reg, int bit) const { return (reg >> bit) & 1u; }
};

CpuBits read_cpu() {
  CpuBits c;
  unsigned a, b, d;
  if (__get_cpuid(1, &a, &b, &c.l1c, &d) == 0) return c;
  __get_cpuid_count(7, 0, &a, &c.l7b, &c.l7c, &c.l7d);
  if (c.has(c.l1c, 27)) {  // OSXSAVE: XGETBV is available
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    c.xcr0 = (static_cast<unsigned long long>(hi) << 32) | lo;
  }
  return c;
}

bool detect_avx512_bf16() {
  unsigned max_sub = 0, b, c, d, a1 = 0;
  if (__get_cpuid_count(7, 0, &max_sub, &b, &c, &d) == 0 || max_sub < 1) return false;
  __get_cpuid_count(7, 1, &a1, &b, &c, &d);
  return (a1 >> 5) & 1u;
}

bool detect_amx_bf16() {
  const CpuBits c = read_cpu();
  return c.has(c.l7d, 22);
}

Isa detect() {
  const CpuBits c = read_cpu();
  const bool ymm_state = (c.xcr0 & 0x6) == 0x6, zmm_state = (c.xcr0 & 0xE6) == 0xE6;
  const bool avx2 = ymm_state && c.has(c.l7b, 5) && c.has(c.l1c, 12) && c.has(c.l1c, 29);  // AVX2, FMA, F16C
  if (!avx2) return Isa::Scalar;
  // AVX-512 F (EBX 16), DQ (17), BW (30), VL (31), VNNI (ECX 11).
  const bool avx512 = zmm_state && c.has(c.l7b, 16) && c.has(c.l7b, 17) && c.has(c.l7b, 30) && c.has(c.l7b, 31) &&
                      c.has(c.l7c, 11);
  if (!avx512) return Isa::Avx2;
  const bool amx = c.has(c.l7d, 24) && c.has(c.l7d, 25) && request_amx();  // AMX-TILE, AMX-INT8
  return amx ? Isa::Amx : Isa::Avx512;
}
#else
Isa detect() { return Isa::Scalar; }
bool detect_avx512_bf16() { return false; }
bool detect_amx_bf16() { return false; }
#endif

Isa from_env(Isa detected) {
  const char* env = std::getenv("SERVAL_ISA");
  if (!env || !*env) return detected;
  const Isa want = parse_isa(env);
  check(int(want) <= int(detected), "SERVAL_ISA={}: this CPU runs at most {}", env, isa_name(detected));
  return want;
}

std::atomic<int> g_active{-1};

}  // namespace

Isa detected_isa() {
  static const Isa isa = detect();
  return isa;
}

bool has_avx512_bf16() {
  static const bool bf16 = int(detected_isa()) >= int(Isa::Avx512) && detect_avx512_bf16();
  return bf16;
}

bool has_amx_bf16() {
  static const bool bf16 = detected_isa() == Isa::Amx && detect_amx_bf16();
  return bf16;
}

Isa active_isa() {
  int v = g_active.load(std::memory_order_relaxed);
  if (v < 0) {
    int expected = -1;
    g_active.compare_exchange_strong(expected, int(from_env(detected_isa())));
    v = g_active.load(std::memory_order_relaxed);
  }
  return Isa(v);
}

void force_isa(Isa isa) {
  check(int(isa) <= int(detected_isa()), "ISA level {} is above what this CPU runs ({})", isa_name(isa),
        isa_name(detected_isa()));
  g_active.store(int(isa), std::memory_order_relaxed);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Amx: return "amx";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx})
    if (name == isa_name(i)) return i;
  fail("unknown ISA level '{}' (scalar, avx2, avx512, amx)", name);
}

}  // namespace serval::cpu
