// A model's matrices requantized to another type as it loads (LoadOptions::requant): vLLM's
// speculative_config "quantization" for a draft model, without a second file. Every tensor that
// `serval quantize --allow-requantize --pure FILE OUT TYPE` would convert is converted here the same
// way (each row dequantized to float, then quantize_row), so the bytes equal that file's; tensors whose
// rows are not whole blocks of the type are kept as they are (where the file command refuses).
// Design and figures: docs/speculative.md ("the 0.5B in Q4_0 as the draft").
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io/tensor_ref.h"

namespace serval {

class GgufFile;

class RequantTensors {
 public:
  // Throws Error for a type quantize_row cannot write.
  RequantTensors(const GgufFile& file, DType to);
  ~RequantTensors();
  RequantTensors(const RequantTensors&) = delete;
  RequantTensors& operator=(const RequantTensors&) = delete;
  // The converted tensor, or null where the file's own stands.
  const TensorRef* find(const std::string& name) const;
  size_t converted() const { return tensors_.size(); }
  // Whether `t` is converted to `to`.
  static bool converts(const TensorRef& t, DType to);

 private:
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  std::vector<TensorRef> tensors_;
  std::map<std::string, size_t> index_;
};

}  // namespace serval
