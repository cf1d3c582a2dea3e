#include "model/requant.h"

#include <algorithm>
#include <vector>

#include "base/error.h"
#include "base/thread_pool.h"
#include "io/gguf.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

// Rows of `in` dequantized to float and quantized as `to` into `out`, rows in parallel.
void convert(const TensorRef& in, DType to, uint8_t* out) {
  const int64_t cols = int64_t(in.row_len()), rows = int64_t(in.n_rows());
  const size_t in_row = row_bytes(in.type, size_t(cols)), out_row = row_bytes(to, size_t(cols));
  const int64_t chunk = std::max<int64_t>(1, 16384 / cols);  // rows per task
  parallel_for((rows + chunk - 1) / chunk, [&](int64_t task) {
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = task * chunk; r < std::min(rows, (task + 1) * chunk); ++r) {
      dequantize_row(in.type, in.data + size_t(r) * in_row, row.data(), size_t(cols));
      quantize_row(to, row.data(), out + size_t(r) * out_row, size_t(cols));
    }
  });
}

}  // namespace

bool requantizes(const TensorRef& t, DType to) {
  return t.type != to && quantizable_tensor(t) && t.row_len() % uint64_t(dtype_info(to).block_elems) == 0;
}

std::unique_ptr<MadeTensors> requantized_tensors(const GgufFile& file, DType to) {
  check(can_quantize_to(to), "cannot requantize a model to {}", dtype_info(to).name);
  std::vector<const TensorRef*> sources;
  std::vector<TensorRef> made;
  for (const TensorRef& t : file.tensors()) {
    if (!requantizes(t, to)) continue;
    sources.push_back(&t);
    made.push_back(t);
    made.back().type = to;
    made.back().nbytes = row_bytes(to, size_t(t.row_len())) * t.n_rows();
  }
  return std::make_unique<MadeTensors>(
      std::move(made), [&](size_t i, uint8_t* out) { convert(*sources[i], to, out); }, "requantizing");
}

}  // namespace serval
