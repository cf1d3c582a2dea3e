#include "model/made_tensors.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "base/error.h"

namespace serval {
namespace {

size_t padded64(size_t n) { return (n + 63) / 64 * 64; }

}  // namespace

MadeTensors::MadeTensors(std::vector<TensorRef> tensors, const std::function<void(size_t, uint8_t*)>& fill,
                         const char* what)
    : tensors_(std::move(tensors)) {
  for (const TensorRef& t : tensors_) bytes_ += padded64(t.nbytes);
  if (bytes_ > 0) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(p != MAP_FAILED, "{}: cannot map {} bytes for the weights: {}", what, bytes_, std::strerror(errno));
    base_ = static_cast<uint8_t*>(p);
  }
  size_t offset = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    tensors_[i].data = base_ + offset;
    fill(i, base_ + offset);
    offset += padded64(tensors_[i].nbytes);
    index_.emplace(tensors_[i].name, i);
  }
}

MadeTensors::~MadeTensors() {
  if (base_) munmap(base_, bytes_);
}

const TensorRef* MadeTensors::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace serval
