#include "model/requant.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/error.h"
#include "base/thread_pool.h"
#include "io/gguf.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

size_t padded64(size_t n) { return (n + 63) / 64 * 64; }

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

bool RequantTensors::converts(const TensorRef& t, DType to) {
  return t.type != to && quantizable_tensor(t) && t.row_len() % uint64_t(dtype_info(to).block_elems) == 0;
}

RequantTensors::RequantTensors(const GgufFile& file, DType to) {
  check(can_quantize_to(to), "cannot requantize a model to {}", dtype_info(to).name);
  for (const TensorRef& t : file.tensors())
    if (converts(t, to)) bytes_ += padded64(row_bytes(to, size_t(t.row_len())) * t.n_rows());
  if (bytes_ > 0) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(p != MAP_FAILED, "requantizing to {}: cannot map {} bytes: {}", dtype_info(to).name, bytes_, std::strerror(errno));
    base_ = static_cast<uint8_t*>(p);
  }
  size_t offset = 0;
  for (const TensorRef& t : file.tensors()) {
    if (!converts(t, to)) continue;
    TensorRef made = t;
    made.type = to;
    made.data = base_ + offset;
    made.nbytes = row_bytes(to, size_t(t.row_len())) * t.n_rows();
    convert(t, to, base_ + offset);
    offset += padded64(made.nbytes);
    index_.emplace(made.name, tensors_.size());
    tensors_.push_back(std::move(made));
  }
}

RequantTensors::~RequantTensors() {
  if (base_) munmap(base_, bytes_);
}

const TensorRef* RequantTensors::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace serval
