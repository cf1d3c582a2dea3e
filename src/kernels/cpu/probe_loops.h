// The register-only loops of the roofline probe (kernels/probe.h), one per ISA level, each compiled in
// a file of its own with that level's flags. Each runs `iters` iterations, writes a value depending on
// every result to *sink (so the loop is not removed) and returns the operations it performed (2 per
// multiply-add).
#pragma once
#include <cstdint>

namespace serval::cpu::probe {

uint64_t vnni_loop(int64_t iters, uint64_t* sink);  // probe_avx512.cpp: VPDPBUSD zmm
uint64_t bf16_loop(int64_t iters, uint64_t* sink);  // probe_bf16.cpp: VDPBF16PS zmm
// probe_amx.cpp: TDPBSUD on 16 x 64-byte tiles. The thread's tile configuration is saved before and
// restored after, so a pool thread's GEMM configuration (gemm_amx.cpp keeps it per thread) survives.
uint64_t amx_loop(int64_t iters, uint64_t* sink);

}  // namespace serval::cpu::probe
