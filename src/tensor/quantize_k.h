// The k-quant and IQ4_NL block quantizers, as llama.cpp's `llama-quantize` runs them without an
// importance matrix (docs/quantization.md says which search each type makes). Internal to
// tensor/quantize.cpp; compiled without fused multiply-adds, as ggml's quantizers are, so that the
// bytes agree.
#pragma once
#include <cstdint>

namespace serval::kquant {

// One 256-element super-block of `x` into one block of the type.
void q2_k(const float* x, uint8_t* out);
void q3_k(const float* x, uint8_t* out);
void q4_k(const float* x, uint8_t* out);
void q5_k(const float* x, uint8_t* out);
void q6_k(const float* x, uint8_t* out);
// One 32-element block of `x` into an IQ4_NL block (an F16 scale and 16 bytes of indices into
// iq4nl_values).
void iq4_nl(const float* x, uint8_t* out);

// The sixteen non-uniform levels of IQ4_NL.
extern const int8_t iq4nl_values[16];

}  // namespace serval::kquant
