// Instruction-set levels of the CPU kernels and the one place that picks the level they run at.
//
// The binary targets a portable x86-64 baseline; each level's kernels are compiled in files of their
// own with that level's flags and are only called when the CPU (and the OS, for AVX-512 state and
// AMX tiles) supports them. A kernel is never silently replaced by a lower level's: tests force each
// level the machine can run through force_isa() and compare it with the scalar reference.
#pragma once
#include <string>

namespace serval::cpu {

enum class Isa {
  Scalar = 0,  // portable C++ (the same arithmetic as the SIMD levels, element by element)
  Avx2 = 1,    // AVX2 + FMA + F16C
  Avx512 = 2,  // AVX-512 F/BW/VL/DQ + VNNI
  Amx = 3,     // Avx512 + AMX-INT8/BF16 tiles (Intel); granted by the kernel through arch_prctl
};

// The best level this CPU and OS can run.
Isa detected_isa();
// Whether the CPU has AVX512_BF16 (VDPBF16PS; CPUID leaf 7 sub-leaf 1 EAX bit 5) on top of the
// Avx512 level. A feature within a level: the level enum is unchanged, kernels query it themselves.
bool has_avx512_bf16();
// Whether the Amx level also has AMX-BF16 (TDPBF16PS; CPUID leaf 7 EDX bit 22): the BF16 tiles of
// cpu::prepare_bf16_tiles. False below the Amx level.
bool has_amx_bf16();
// The level kernels use: detected_isa(), or lower when forced (force_isa, or SERVAL_ISA=scalar|avx2|
// avx512|amx in the environment at start-up). Throws Error when asked for a level above detected_isa().
Isa active_isa();
void force_isa(Isa isa);
// "scalar", "avx2", "avx512", "amx"; parse_isa throws Error on other names.
const char* isa_name(Isa isa);
Isa parse_isa(const std::string& name);

}  // namespace serval::cpu
