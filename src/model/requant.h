// A model's matrices requantized to another type as it loads (LoadOptions::requant): vLLM's
// speculative_config "quantization" for a draft model, without a second file. Every tensor that
// `serval quantize --allow-requantize --pure FILE OUT TYPE` would convert is converted here the same
// way (each row dequantized to float, then quantize_row), so the bytes equal that file's; tensors whose
// rows are not whole blocks of the type are kept as they are (where the file command refuses).
// Design: docs/models.md ("Requantized as it loads"); figures: docs/speculative.md.
#pragma once
#include <memory>

#include "io/tensor_ref.h"
#include "model/made_tensors.h"

namespace serval {

class GgufFile;

// Whether `t` is converted to `to`.
bool requantizes(const TensorRef& t, DType to);
// The converted tensors of `file` (model/made_tensors.h); the others stay the file's. Throws Error for a
// type quantize_row cannot write.
std::unique_ptr<MadeTensors> requantized_tensors(const GgufFile& file, DType to);

}  // namespace serval
