#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "base/error.h"

namespace serval {

SafetensorsFile::SafetensorsFile(const std::string& path)
    : path_(path), file_(std::make_unique<MappedFile>(path)) {
  parse(file_->bytes());
}

SafetensorsFile::SafetensorsFile(const std::string& name, std::span<const uint8_t> bytes) : path_(name) {
  parse(bytes);
}

void SafetensorsFile::parse(std::span<const uint8_t> bytes) {
  const std::string& path = path_;
  check(bytes.size() >= 8, "{}: truncated safetensors file (no header length)", path);
  uint64_t header_len;
  std::memcpy(&header_len, bytes.data(), 8);
  check(header_len <= bytes.size() - 8, "{}: safetensors header length {} exceeds the file size", path, header_len);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + header_len);
  } catch (const std::exception& e) {
    fail("{}: invalid safetensors JSON header: {}", path, e.what());
  }
  check(header.is_object(), "{}: safetensors header is not a JSON object", path);
  const uint8_t* data = bytes.data() + 8 + header_len;
  const uint64_t data_size = bytes.size() - 8 - header_len;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    check(entry.is_object() && entry.contains("dtype") && entry.contains("shape") && entry.contains("data_offsets"),
          "{}: tensor '{}' lacks dtype, shape or data_offsets", path, name);
    check(entry["dtype"].is_string(), "{}: tensor '{}' has a dtype that is not a string", path, name);
    const auto dtype = entry["dtype"].get<std::string>();
    DType type;
    if (dtype == "F32") type = DType::F32;
    else if (dtype == "F16") type = DType::F16;
    else if (dtype == "BF16") type = DType::BF16;
    // Integer tensors are buffers, not weights (BERT's embeddings.position_ids): not listed.
    else if (dtype == "U8") type = DType::U8;  // raw bytes (MXFP4 blocks and scales); other integer tensors are skipped
    else if (dtype == "I64" || dtype == "I32" || dtype == "I16" || dtype == "I8" || dtype == "BOOL") continue;
    else fail("{}: tensor '{}' has unsupported dtype {}", path, name, dtype);
    TensorRef t{name, type, {}, nullptr, 0};
    const auto& shape = entry["shape"];
    check(shape.is_array() && shape.size() <= 4, "{}: tensor '{}' has a bad shape", path, name);
    uint64_t n = 1;
    for (auto it = shape.rbegin(); it != shape.rend(); ++it) {
      check(it->is_number_unsigned() && it->get<uint64_t>() > 0 && it->get<uint64_t>() < (uint64_t(1) << 40),
            "{}: tensor '{}' has a bad dimension", path, name);
      t.ne.push_back(it->get<uint64_t>());
      check(!__builtin_mul_overflow(n, t.ne.back(), &n), "{}: tensor '{}' has too many elements", path, name);
    }
    if (t.ne.empty()) t.ne.push_back(1);
    const auto& off = entry["data_offsets"];
    check(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
          "{}: tensor '{}' has bad data_offsets", path, name);
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    check(begin <= end && end <= data_size, "{}: tensor '{}' data [{}, {}) runs past the end of the file", path, name,
          begin, end);
    t.nbytes = end - begin;
    uint64_t shape_bytes = 0;
    check(!__builtin_mul_overflow(n, uint64_t(dtype_info(type).block_bytes), &shape_bytes) && t.nbytes == shape_bytes, "{}: tensor '{}' byte size {} does not match its shape", path,
          name, t.nbytes);
    t.data = data + begin;
    // The kernels read elements in place (uint16_t / float loads): the data must be aligned to them.
    // Writers pad the header to 8 bytes, so real files are; the mapping itself is page-aligned.
    check(reinterpret_cast<uintptr_t>(t.data) % dtype_info(type).block_bytes == 0,
          "{}: tensor '{}' data at offset {} is not aligned to its {}-byte elements", path, name, 8 + header_len + begin,
          dtype_info(type).block_bytes);
    index_[name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }
  std::vector<const TensorRef*> by_offset;
  for (auto& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    check(by_offset[i - 1]->data + by_offset[i - 1]->nbytes <= by_offset[i]->data, "{}: tensors '{}' and '{}' overlap",
          path, by_offset[i - 1]->name, by_offset[i]->name);
}

const TensorRef* SafetensorsFile::find_tensor(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace serval
