#include "quant/imatrix.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/error.h"
#include "base/file_util.h"
#include "io/gguf.h"
#include "io/gguf_writer.h"

namespace serval {
namespace {

constexpr const char* kSum2 = ".in_sum2";
constexpr const char* kCounts = ".counts";

std::vector<double> f32_tensor(const TensorRef& t) {
  check(t.type == DType::F32, "{}: imatrix tensors are F32, not {}", t.name, dtype_info(t.type).name);
  std::vector<double> v(t.n_elements());
  for (size_t i = 0; i < v.size(); ++i) {
    float f;
    std::memcpy(&f, t.data + 4 * i, 4);
    v[i] = f;
  }
  return v;
}

Imatrix load_gguf(const std::string& path) {
  const GgufFile g(path);
  Imatrix m;
  if (g.has("imatrix.datasets")) m.datasets = g.get_array("imatrix.datasets").strings;
  m.chunk_count = int(g.find_int("imatrix.chunk_count").value_or(0));
  m.chunk_size = int(g.find_int("imatrix.chunk_size").value_or(0));
  for (const auto& t : g.tensors()) {
    if (!t.name.ends_with(kSum2)) continue;
    const std::string name = t.name.substr(0, t.name.size() - std::strlen(kSum2));
    const TensorRef* c = g.find_tensor(name + kCounts);
    check(c != nullptr, "{}: {} has no {}{}", path, t.name, name, kCounts);
    ImatrixEntry e{f32_tensor(t), f32_tensor(*c)};
    check(!e.counts.empty() && e.sum2.size() % e.counts.size() == 0, "{}: {} and its counts disagree in shape", path,
          t.name);
    m.entries[name] = std::move(e);
  }
  check(!m.entries.empty(), "{}: no imatrix entries (no *.in_sum2 tensors)", path);
  return m;
}

template <class T>
T read_pod(std::ifstream& in, const std::string& path) {
  T v{};
  in.read(reinterpret_cast<char*>(&v), sizeof v);
  check(bool(in), "{}: the imatrix file ends early", path);
  return v;
}

std::string read_string(std::ifstream& in, const std::string& path, int32_t len) {
  check(len >= 0 && len <= (1 << 20), "{}: a name of {} bytes", path, len);
  std::string s(static_cast<size_t>(len), '\0');
  in.read(s.data(), len);
  check(bool(in), "{}: the imatrix file ends early", path);
  return s;
}

// The .dat stores mean squares times ncall; they come back as sums over ncall rows (count = ncall).
Imatrix load_dat(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(bool(in), "cannot open {}", path);
  Imatrix m;
  const auto n = read_pod<int32_t>(in, path);
  check(n >= 1 && n <= (1 << 20), "{}: not an imatrix file ({} entries)", path, n);
  for (int32_t i = 0; i < n; ++i) {
    const std::string name = read_string(in, path, read_pod<int32_t>(in, path));
    const auto ncall = read_pod<int32_t>(in, path);
    const auto nval = read_pod<int32_t>(in, path);
    check(nval >= 1 && nval <= (1 << 24), "{}: entry {} has {} values", path, name, nval);
    std::vector<float> v(static_cast<size_t>(nval));
    in.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * 4));
    check(bool(in), "{}: the imatrix file ends early", path);
    ImatrixEntry e{std::vector<double>(v.begin(), v.end()), {double(ncall > 0 ? ncall : 1)}};
    m.entries[name] = std::move(e);
  }
  if (in.peek() != EOF) {
    m.chunk_count = read_pod<int32_t>(in, path);
    m.datasets.push_back(read_string(in, path, read_pod<int32_t>(in, path)));
  }
  return m;
}

void save_gguf(const Imatrix& m, const std::string& path) {
  GgufWriter w;
  w.add_string("general.type", "imatrix");
  GgufArray datasets{GgufValueType::STRING, {}, {}, m.datasets};
  w.add_value("imatrix.datasets", GgufValue{GgufValueType::ARRAY, datasets});
  w.add_u32("imatrix.chunk_count", uint32_t(m.chunk_count));
  w.add_u32("imatrix.chunk_size", uint32_t(m.chunk_size));
  for (const auto& [name, e] : m.entries) {
    const std::vector<float> sum2(e.sum2.begin(), e.sum2.end()), counts(e.counts.begin(), e.counts.end());
    w.add_f32_tensor(name + kSum2, {uint64_t(e.n_per_row()), uint64_t(e.counts.size())}, sum2.data());
    w.add_f32_tensor(name + kCounts, {1, uint64_t(e.counts.size())}, counts.data());
  }
  w.write(path);
}

template <class T>
void put(std::ofstream& out, const T& v) {
  out.write(reinterpret_cast<const char*>(&v), sizeof v);
}

// ncall per entry is its rows over the chunk size, rounded up (llama.cpp's rule), at least 1.
void save_dat(const Imatrix& m, const std::string& path) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    check(bool(out), "cannot write {}", tmp);
    put(out, int32_t(m.entries.size()));
    for (const auto& [name, e] : m.entries) {
      put(out, int32_t(name.size()));
      out.write(name.data(), std::streamsize(name.size()));
      double rows = 0;
      for (double c : e.counts) rows = std::max(rows, c);
      const int32_t ncall = std::max<int32_t>(1, m.chunk_size > 0 ? int32_t((rows + m.chunk_size - 1) / m.chunk_size) : 1);
      put(out, ncall);
      put(out, int32_t(e.sum2.size()));
      const size_t per = size_t(e.n_per_row());
      for (size_t i = 0; i < e.sum2.size(); ++i) {
        const double c = e.counts[i / per];
        put(out, float(c > 0 ? e.sum2[i] / c * ncall : ncall));
      }
    }
    put(out, int32_t(m.chunk_count));
    const std::string ds = m.datasets.empty() ? "" : m.datasets.back();
    put(out, int32_t(ds.size()));
    out.write(ds.data(), std::streamsize(ds.size()));
    check(bool(out), "writing {} failed", tmp);
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace

void Imatrix::add(const std::string& name, const float* x, int64_t n_rows, int64_t cols, int64_t mat, int64_t n_mat) {
  ImatrixEntry& e = entries[name];
  if (e.counts.empty()) e.sum2.assign(size_t(cols * n_mat), 0.0), e.counts.assign(size_t(n_mat), 0.0);
  check(e.n_per_row() == cols && int64_t(e.counts.size()) == n_mat && mat >= 0 && mat < n_mat,
        "imatrix: {} was {} x {}, now {} x {}", name, e.counts.size(), e.n_per_row(), n_mat, cols);
  double* sum2 = e.sum2.data() + mat * cols;
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t j = 0; j < cols; ++j) sum2[j] += double(x[r * cols + j]) * x[r * cols + j];
  e.counts[size_t(mat)] += double(n_rows);
}

std::vector<float> Imatrix::importance(const std::string& name, int64_t cols, int64_t n_mat) const {
  const auto it = entries.find(name);
  if (it == entries.end()) return {};
  const ImatrixEntry& e = it->second;
  // A .dat file keeps one count per weight: its expert tensors' values are n_mat rows under that count.
  const bool one_count = e.counts.size() == 1 && int64_t(e.sum2.size()) == cols * n_mat;
  check(one_count || e.n_per_row() == cols, "imatrix entry {} is {} wide, the tensor's rows are {}", name, e.n_per_row(), cols);
  check(one_count || int64_t(e.counts.size()) == n_mat, "imatrix entry {} has {} matrices, the tensor {}", name,
        e.counts.size(), n_mat);
  std::vector<float> w(static_cast<size_t>(cols * n_mat));
  for (int64_t m = 0; m < n_mat; ++m)
    for (int64_t j = 0; j < cols; ++j) {
      const double n = e.counts[one_count ? 0 : size_t(m)];
      const float v = w[size_t(m * cols + j)] = n > 0 ? float(e.sum2[size_t(m * cols + j)] / n) : 1.0f;
      check(std::isfinite(v), "imatrix entry {} has a non-finite value at column {}", name, j);
    }
  return w;
}

Imatrix load_imatrix(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(bool(in), "cannot open imatrix file {}", path);
  char magic[4] = {};
  in.read(magic, 4);
  return std::memcmp(magic, "GGUF", 4) == 0 ? load_gguf(path) : load_dat(path);
}

void save_imatrix(const Imatrix& m, const std::string& path, bool dat) {
  if (dat) return save_dat(m, path);
  save_gguf(m, path);
}

}  // namespace serval
