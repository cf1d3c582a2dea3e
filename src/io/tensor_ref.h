// A tensor stored in a mapped model file: type, shape and where its bytes are.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "io/ggml_types.h"

namespace serval {

struct TensorRef {
  std::string name;
  DType type = DType::F32;
  std::vector<uint64_t> ne;  // GGUF order: ne[0] is the innermost (contiguous) dimension
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;

  uint64_t n_elements() const {
    uint64_t n = 1;
    for (auto d : ne) n *= d;
    return n;
  }
  // Elements in one row (ne[0]) and number of rows (product of the rest).
  uint64_t row_len() const { return ne.empty() ? 1 : ne[0]; }
  uint64_t n_rows() const { return ne.empty() ? 1 : n_elements() / ne[0]; }
};

}  // namespace serval
