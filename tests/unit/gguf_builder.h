// Writes small GGUF files byte by byte for tests (written from the format description).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace serval::test {

class GgufBuilder {
 public:
  std::vector<uint8_t> kv;  // encoded key-value pairs
  std::vector<uint8_t> ti;  // encoded tensor infos
  std::vector<uint8_t> data;
  uint64_t n_kv = 0, n_tensors = 0;
  uint32_t version = 3;

  template <typename T>
  static void put(std::vector<uint8_t>& b, T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  static void put_str(std::vector<uint8_t>& b, const std::string& s) {
    put<uint64_t>(b, s.size());
    b.insert(b.end(), s.begin(), s.end());
  }
  void add_u32(const std::string& k, uint32_t v) { put_str(kv, k); put<uint32_t>(kv, 4); put(kv, v); ++n_kv; }
  void add_f32(const std::string& k, float v) { put_str(kv, k); put<uint32_t>(kv, 6); put(kv, v); ++n_kv; }
  void add_bool(const std::string& k, bool v) { put_str(kv, k); put<uint32_t>(kv, 7); put<uint8_t>(kv, v); ++n_kv; }
  void add_str(const std::string& k, const std::string& v) { put_str(kv, k); put<uint32_t>(kv, 8); put_str(kv, v); ++n_kv; }
  void add_str_array(const std::string& k, const std::vector<std::string>& v) {
    put_str(kv, k); put<uint32_t>(kv, 9); put<uint32_t>(kv, 8); put<uint64_t>(kv, v.size());
    for (const auto& s : v) put_str(kv, s);
    ++n_kv;
  }
  void add_f32_array(const std::string& k, const std::vector<float>& v) {
    put_str(kv, k); put<uint32_t>(kv, 9); put<uint32_t>(kv, 6); put<uint64_t>(kv, v.size());
    for (float f : v) put(kv, f);
    ++n_kv;
  }
  // Adds a tensor whose bytes are appended to the data section (aligned to 32).
  void add_tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, const std::vector<uint8_t>& bytes,
                  int64_t offset_override = -1) {
    while (data.size() % 32) data.push_back(0);
    put_str(ti, name);
    put<uint32_t>(ti, ne.size());
    for (auto d : ne) put<uint64_t>(ti, d);
    put<uint32_t>(ti, type);
    put<uint64_t>(ti, offset_override >= 0 ? uint64_t(offset_override) : data.size());
    data.insert(data.end(), bytes.begin(), bytes.end());
    ++n_tensors;
  }
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> b = {'G', 'G', 'U', 'F'};
    put<uint32_t>(b, version);
    put<uint64_t>(b, n_tensors);
    put<uint64_t>(b, n_kv);
    b.insert(b.end(), kv.begin(), kv.end());
    b.insert(b.end(), ti.begin(), ti.end());
    while (b.size() % 32) b.push_back(0);
    b.insert(b.end(), data.begin(), data.end());
    return b;
  }
};

inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace serval::test
