// Per-ISA row dot products over GGUF blocks (vec_dot_avx512.cpp, built with AVX-512 flags).
#pragma once
#include <cstdint>

#include "io/ggml_types.h"

namespace serval::cpu {
// vec_dot_rows for the types it has (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; 1..4 rows); false for the
// others. Call only when active_isa() >= Isa::Avx512.
bool vec_dot_rows_avx512(DType t, const uint8_t* w, const uint8_t* const* acts, int n_rows, int64_t n, float* out);
}  // namespace serval::cpu
