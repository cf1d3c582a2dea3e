// Read-only memory mapping of a whole file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace serval {

class MappedFile {
 public:
  // Maps `path` read-only; throws Error naming the file when it cannot be opened or mapped.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // The file's bytes.
  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace serval
