// Tensors made while a model loads instead of read from its file: the dummy weights (model/dummy.h)
// and the requantized ones (model/requant.h). All of them live in one anonymous mapping; pages that a
// repacked matrix gives back are freed (and read zeros afterwards: bind_weights' `reloadable` = false).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "io/tensor_ref.h"

namespace serval {

class MadeTensors {
 public:
  // Each of `tensors` (name, type, shape and nbytes; data is ignored) gets nbytes of the mapping, and
  // fill(i, out) writes tensor i's bytes there. `what` names the purpose in an error.
  MadeTensors(std::vector<TensorRef> tensors, const std::function<void(size_t i, uint8_t* out)>& fill, const char* what);
  ~MadeTensors();
  MadeTensors(const MadeTensors&) = delete;
  MadeTensors& operator=(const MadeTensors&) = delete;
  // The made tensor of that name, or null.
  const TensorRef* find(const std::string& name) const;
  size_t size() const { return tensors_.size(); }

 private:
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  std::vector<TensorRef> tensors_;
  std::map<std::string, size_t> index_;
};

}  // namespace serval
