// vLLM's --load-format dummy: a model's weights generated instead of read, from its GGUF header (a
// shape file, or any GGUF file read without its data). Useful where the weights cannot travel (a GPU
// machine lent for minutes), and for sizing or benchmarking a model without its weights.
// Design and use: docs/models.md ("Models without their weights").
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "io/tensor_ref.h"
#include "model/made_tensors.h"

namespace serval {

class GgufFile;

// The seed Serval's dummy weights are made with (LoadOptions::dummy_seed's default).
inline constexpr uint64_t kDummySeed = 0;

// The bytes of tensor `t` (its name, type and shape; t.data is ignored) as the dummy loader makes
// them: values from a fixed generator seeded by `seed`, the tensor's name and the row (splitmix64,
// then Box-Muller), N(0, 1/sqrt(ne[0])) per row; RMSNorm weights (`*norm.weight`) and RoPE factors
// (`rope_*`) 1; biases, attention sinks and expert-bias vectors 0; then quantized to the tensor's own
// type (quantize_row), so every machine, thread count and backend gets the same bytes. `out` holds
// t.nbytes bytes. Throws Error for a type Serval cannot quantize to.
void dummy_tensor_bytes(const TensorRef& t, uint64_t seed, uint8_t* out);

// Every tensor of a GGUF header made by dummy_tensor_bytes (model/made_tensors.h).
std::unique_ptr<MadeTensors> dummy_tensors(const GgufFile& header, uint64_t seed);

// `serval export-shape`: the shape file of a GGUF model (its metadata, plus kShapeOnlyKey = true, and
// its tensor entries; no data: a few MB), or with `full` a whole GGUF whose tensors are those
// dummy_tensor_bytes makes (streamed one tensor at a time; without the mark), which llama.cpp loads:
// the very bytes `--load-format dummy` runs. `model` may itself be a shape file.
void export_shape(const std::string& model, const std::string& out, bool full, uint64_t seed = kDummySeed);

}  // namespace serval
