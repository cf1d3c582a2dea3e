#include "kernels/isa.h"

#include <atomic>
#include <cstdlib>

#if defined(__x86_64__)
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

Isa detect() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (!avx2) return Isa::Scalar;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vnni");
  if (!avx512) return Isa::Avx2;
  const bool amx = __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("amx-tile") && request_amx();
  return amx ? Isa::Amx : Isa::Avx512;
}
#else
Isa detect() { return Isa::Scalar; }
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
