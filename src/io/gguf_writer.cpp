#include "io/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "base/error.h"

namespace serval {
namespace {

constexpr uint32_t kTypeU32 = 4, kTypeF32 = 6, kTypeString = 8;  // GGUF metadata value types
constexpr uint32_t kTensorF32 = 0;  // ggml tensor type
constexpr size_t kAlign = GgufWriter::kAlignment;

template <typename T>
void put(std::vector<uint8_t>& b, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}

void put_string(std::vector<uint8_t>& b, const std::string& s) {
  put<uint64_t>(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}

void put_scalar(std::vector<uint8_t>& b, GgufValueType t, int64_t i, double f) {
  switch (t) {
    case GgufValueType::UINT8: put<uint8_t>(b, uint8_t(i)); break;
    case GgufValueType::INT8: put<int8_t>(b, int8_t(i)); break;
    case GgufValueType::UINT16: put<uint16_t>(b, uint16_t(i)); break;
    case GgufValueType::INT16: put<int16_t>(b, int16_t(i)); break;
    case GgufValueType::UINT32: put<uint32_t>(b, uint32_t(i)); break;
    case GgufValueType::INT32: put<int32_t>(b, int32_t(i)); break;
    case GgufValueType::UINT64: put<uint64_t>(b, uint64_t(i)); break;
    case GgufValueType::INT64: put<int64_t>(b, i); break;
    case GgufValueType::BOOL: put<uint8_t>(b, i != 0); break;
    case GgufValueType::FLOAT32: put<float>(b, float(f)); break;
    case GgufValueType::FLOAT64: put<double>(b, f); break;
    default: fail("internal: GGUF value type {} is not a scalar", uint32_t(t));
  }
}

void put_array(std::vector<uint8_t>& b, const GgufArray& a) {
  put<uint32_t>(b, uint32_t(a.elem_type));
  put<uint64_t>(b, a.size());
  if (a.elem_type == GgufValueType::STRING)
    for (const auto& s : a.strings) put_string(b, s);
  else if (a.elem_type == GgufValueType::FLOAT32 || a.elem_type == GgufValueType::FLOAT64)
    for (double f : a.floats) put_scalar(b, a.elem_type, 0, f);
  else
    for (int64_t i : a.ints) put_scalar(b, a.elem_type, i, 0);
}

}  // namespace

void GgufWriter::add_value(const std::string& key, const GgufValue& v) {
  put_string(kv_, key);
  put<uint32_t>(kv_, uint32_t(v.type));
  ++n_kv_;
  if (const auto* s = std::get_if<std::string>(&v.value)) return put_string(kv_, *s);
  if (const auto* a = std::get_if<GgufArray>(&v.value)) return put_array(kv_, *a);
  if (const auto* u = std::get_if<uint64_t>(&v.value)) return put<uint64_t>(kv_, *u);
  if (const auto* f = std::get_if<double>(&v.value)) return put_scalar(kv_, v.type, 0, *f);
  if (const auto* bl = std::get_if<bool>(&v.value)) return put<uint8_t>(kv_, *bl);
  put_scalar(kv_, v.type, std::get<int64_t>(v.value), 0);
}

void GgufWriter::add_u32(const std::string& key, uint32_t value) {
  put_string(kv_, key), put(kv_, kTypeU32), put(kv_, value), ++n_kv_;
}

void GgufWriter::add_f32(const std::string& key, float value) {
  put_string(kv_, key), put(kv_, kTypeF32), put(kv_, value), ++n_kv_;
}

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  put_string(kv_, key), put(kv_, kTypeString), put_string(kv_, value), ++n_kv_;
}

void GgufWriter::add_tensor_info(const std::string& name, const std::vector<uint64_t>& ne, uint32_t type, size_t bytes) {
  check(!ne.empty() && ne.size() <= 4, "GGUF tensor '{}' needs 1 to 4 dimensions", name);
  check(data_.empty(), "internal: GGUF tensor entries without data mixed with tensors with data");
  info_only_ = true;
  info_only_end_ = (info_only_end_ + kAlign - 1) / kAlign * kAlign;
  put_string(infos_, name);
  put<uint32_t>(infos_, uint32_t(ne.size()));
  for (uint64_t d : ne) put<uint64_t>(infos_, d);
  put<uint32_t>(infos_, type);
  put<uint64_t>(infos_, info_only_end_);
  info_only_end_ += bytes;
  info_bytes_.push_back(bytes);
  ++n_tensors_;
}

void GgufWriter::add_tensor(const std::string& name, const std::vector<uint64_t>& ne, uint32_t type, const void* data,
                            size_t bytes) {
  check(!info_only_, "internal: GGUF tensors with data mixed with entries without");
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

std::vector<uint8_t> GgufWriter::header() const {
  std::vector<uint8_t> head = {'G', 'G', 'U', 'F'};
  put<uint32_t>(head, 3);
  put<uint64_t>(head, n_tensors_);
  put<uint64_t>(head, n_kv_);
  head.insert(head.end(), kv_.begin(), kv_.end());
  head.insert(head.end(), infos_.begin(), infos_.end());
  head.resize((head.size() + kAlign - 1) / kAlign * kAlign, 0);
  return head;
}

void GgufWriter::write_with(const std::string& path, const std::function<bool(std::FILE*)>& body) const {
  const std::vector<uint8_t> head = header();
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  check(f != nullptr, "cannot write '{}': {}", tmp, std::strerror(errno));
  bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size();
  try {
    ok = ok && body(f);
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    fail("writing '{}' failed (disk full?)", path);
  }
  std::filesystem::rename(tmp, path);
}

void GgufWriter::write(const std::string& path) const {
  write_with(path, [&](FILE* f) { return std::fwrite(data_.data(), 1, data_.size(), f) == data_.size(); });
}

void GgufWriter::write(const std::string& path,
                       const std::function<void(size_t i, std::vector<uint8_t>& bytes)>& tensor_bytes) const {
  check(data_.empty(), "internal: a streamed GGUF holds tensor entries without data only");
  write_with(path, [&](FILE* f) {
    std::vector<uint8_t> bytes;
    uint64_t written = 0;
    for (size_t i = 0; i < info_bytes_.size(); ++i) {
      const uint64_t pad = (written + kAlign - 1) / kAlign * kAlign - written;
      bytes.assign(size_t(pad), 0);
      if (std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) return false;
      bytes.assign(size_t(info_bytes_[i]), 0);
      tensor_bytes(i, bytes);
      if (std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) return false;
      written += pad + info_bytes_[i];
    }
    return true;
  });
}

}  // namespace serval
