#include "io/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "base/error.h"

namespace serval {
namespace {

constexpr uint32_t kTypeU32 = 4, kTypeF32 = 6, kTypeString = 8;  // GGUF metadata value types
constexpr uint32_t kTensorF32 = 0;  // ggml tensor type
constexpr size_t kAlign = 32;

template <typename T>
void put(std::vector<uint8_t>& b, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}

void put_string(std::vector<uint8_t>& b, const std::string& s) {
  put<uint64_t>(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}

}  // namespace

void GgufWriter::add_u32(const std::string& key, uint32_t value) {
  put_string(kv_, key), put(kv_, kTypeU32), put(kv_, value), ++n_kv_;
}

void GgufWriter::add_f32(const std::string& key, float value) {
  put_string(kv_, key), put(kv_, kTypeF32), put(kv_, value), ++n_kv_;
}

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  put_string(kv_, key), put(kv_, kTypeString), put_string(kv_, value), ++n_kv_;
}

void GgufWriter::add_tensor(const std::string& name, const std::vector<uint64_t>& ne, uint32_t type, const void* data,
                            size_t bytes) {
  check(!ne.empty() && ne.size() <= 4, "GGUF tensor '{}' needs 1 to 4 dimensions", name);
  data_.resize((data_.size() + kAlign - 1) / kAlign * kAlign, 0);
  put_string(infos_, name);
  put<uint32_t>(infos_, uint32_t(ne.size()));
  for (uint64_t d : ne) put<uint64_t>(infos_, d);
  put<uint32_t>(infos_, type);
  put<uint64_t>(infos_, data_.size());
  const auto* p = static_cast<const uint8_t*>(data);
  data_.insert(data_.end(), p, p + bytes);
  ++n_tensors_;
}

void GgufWriter::add_f32_tensor(const std::string& name, std::vector<uint64_t> ne, const float* data) {
  uint64_t n = 1;
  for (uint64_t d : ne) n *= d;
  add_tensor(name, ne, kTensorF32, data, n * sizeof(float));
}

void GgufWriter::write(const std::string& path) const {
  std::vector<uint8_t> head = {'G', 'G', 'U', 'F'};
  put<uint32_t>(head, 3);
  put<uint64_t>(head, n_tensors_);
  put<uint64_t>(head, n_kv_);
  head.insert(head.end(), kv_.begin(), kv_.end());
  head.insert(head.end(), infos_.begin(), infos_.end());
  head.resize((head.size() + kAlign - 1) / kAlign * kAlign, 0);
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  check(f != nullptr, "cannot write '{}': {}", tmp, std::strerror(errno));
  const bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size() &&
                  std::fwrite(data_.data(), 1, data_.size(), f) == data_.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    fail("writing '{}' failed (disk full?)", path);
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace serval
