// The searching quantizers: the k-quants and IQ4_NL, and Q4_0..Q5_1 with an importance matrix, as
// llama.cpp's `llama-quantize` runs them (docs/quantization.md says which search each type makes). Internal to
// tensor/quantize.cpp; compiled without fused multiply-adds, as ggml's quantizers are, so that the
// bytes agree.
#pragma once
#include <cstddef>
#include <cstdint>

namespace serval::kquant {

// One 256-element super-block of `x` into one block of the type. `qw`: the importance of each of
// its 256 columns (from an imatrix), or null for llama.cpp's reference search.
void q2_k(const float* x, uint8_t* out, const float* qw);
void q3_k(const float* x, uint8_t* out, const float* qw);
void q4_k(const float* x, uint8_t* out, const float* qw);
void q5_k(const float* x, uint8_t* out, const float* qw);
void q6_k(const float* x, uint8_t* out, const float* qw);
// One 32-element block of `x` into an IQ4_NL block (an F16 scale and 16 bytes of indices into
// iq4nl_values).
void iq4_nl(const float* x, uint8_t* out, const float* qw);
// A whole row of `n` values as Q4_0 / Q5_0 (`with_min` false) or Q4_1 / Q5_1 with importance `qw`
// (non-null, n values): llama.cpp's weighted searches (the row's mean square enters the weights).
void legacy_row(const float* x, uint8_t* out, size_t n, const float* qw, int bits, bool with_min);

// The sixteen non-uniform levels of IQ4_NL.
extern const int8_t iq4nl_values[16];

}  // namespace serval::kquant
