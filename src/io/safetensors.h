// safetensors reader over mmap: a JSON header of tensor names, dtypes, shapes and byte ranges.
#pragma once
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/mapped_file.h"
#include "io/tensor_ref.h"

namespace serval {

class SafetensorsFile {
 public:
  // Opens and validates `path`; throws Error naming the file and the problem.
  explicit SafetensorsFile(const std::string& path);
  // Parses bytes held by the caller (they must outlive this object); `name` appears in errors.
  SafetensorsFile(const std::string& name, std::span<const uint8_t> bytes);

  const std::vector<TensorRef>& tensors() const { return tensors_; }
  const TensorRef* find_tensor(const std::string& name) const;

 private:
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  std::vector<TensorRef> tensors_;
  std::map<std::string, size_t> index_;

  void parse(std::span<const uint8_t> bytes);
};

}  // namespace serval
