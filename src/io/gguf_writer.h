// Writes GGUF version 3 files (metadata, then tensors aligned to 32 bytes), as the reader reads them.
// Used for files Serval makes itself: decoding heads (F32 tensors) and `serval quantize` (any type).
#pragma once
#include <cstdio>
#include <functional>
#include <cstdint>
#include <string>
#include <vector>

#include "io/gguf.h"

namespace serval {

class GgufWriter {
 public:
  void add_u32(const std::string& key, uint32_t value);
  void add_f32(const std::string& key, float value);
  void add_string(const std::string& key, const std::string& value);
  // Any metadata value as read by GgufFile (the same type goes back out).
  void add_value(const std::string& key, const GgufValue& value);
  // `ne` in GGUF order: ne[0] is the contiguous dimension.
  void add_f32_tensor(const std::string& name, std::vector<uint64_t> ne, const float* data);
  // A tensor of GGUF type number `type` whose `bytes` bytes are at `data`.
  void add_tensor(const std::string& name, const std::vector<uint64_t>& ne, uint32_t type, const void* data, size_t bytes);
  // A tensor's entry alone: its data is written by the caller after header() (streamed files) or
  // never (shape files). Not mixed with add_tensor in one file.
  void add_tensor_info(const std::string& name, const std::vector<uint64_t>& ne, uint32_t type, size_t bytes);
  // Offset of the next tensor's data from the start of the data section, and the alignment.
  static constexpr uint64_t kAlignment = 32;
  // The file up to its data section (magic, counts, metadata, tensor entries, padding).
  std::vector<uint8_t> header() const;
  // Writes the file (through a temporary, renamed on success); throws Error.
  void write(const std::string& path) const;
  // The same for a file of add_tensor_info entries, tensor i's bytes (as many as its entry said) made by
  // `tensor_bytes` into the buffer given, one tensor at a time (streamed, never all in memory).
  void write(const std::string& path, const std::function<void(size_t i, std::vector<uint8_t>& bytes)>& tensor_bytes) const;

 private:
  std::vector<uint8_t> kv_, infos_, data_;
  uint64_t n_kv_ = 0, n_tensors_ = 0;
  uint64_t info_only_end_ = 0;  // data bytes the add_tensor_info entries stand for
  std::vector<uint64_t> info_bytes_;  // each add_tensor_info entry's bytes
  bool info_only_ = false;
  // The header, then what `body` writes (false: failed), through a temporary renamed on success.
  void write_with(const std::string& path, const std::function<bool(std::FILE*)>& body) const;
};

}  // namespace serval
