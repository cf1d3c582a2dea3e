#include "model/dummy.h"

#include <cmath>

#include "base/error.h"
#include "base/thread_pool.h"
#include "io/gguf.h"
#include "io/gguf_writer.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

enum class Fill { Normal, Ones, Zeros };

// What a tensor's values are, by its GGUF name.
Fill fill_of(const std::string& name) {
  if (name.ends_with("norm.weight") || name.starts_with("rope_")) return Fill::Ones;
  if (name.ends_with(".bias") || name.ends_with("attn_sinks.weight") || name.find("exp_probs_b") != std::string::npos)
    return Fill::Zeros;
  return Fill::Normal;
}

// Row `row` of a tensor: n values N(0, sigma) from the generator of (seed, tensor, row), by
// Box-Muller on 53-bit uniforms (in double: the same bits wherever the same libm runs).
void normal_row(uint64_t tensor_seed, uint64_t row, float sigma, float* x, int64_t n) {
  uint64_t state = tensor_seed ^ (row * 0xD1B54A32D192ED03ull);
  for (int64_t i = 0; i < n; i += 2) {
    const double u1 = (double(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = double(splitmix64(state) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1)), a = 2.0 * M_PI * u2;
    x[i] = float(r * std::cos(a)) * sigma;
    if (i + 1 < n) x[i + 1] = float(r * std::sin(a)) * sigma;
  }
}

}  // namespace

void dummy_tensor_bytes(const TensorRef& t, uint64_t seed, uint8_t* out) {
  check(can_quantize_to(t.type), "--load-format dummy: tensor '{}' is {}, a type Serval cannot make", t.name,
        dtype_info(t.type).name);
  check(!t.ne.empty() && t.ne[0] > 0, "--load-format dummy: tensor '{}' has no rows", t.name);
  const int64_t n = int64_t(t.ne[0]), n_rows = int64_t(t.n_elements() / t.ne[0]);
  const size_t row = row_bytes(t.type, size_t(n));
  const Fill fill = fill_of(t.name);
  const uint64_t tensor_seed = seed ^ fnv1a(t.name);
  const float sigma = float(1.0 / std::sqrt(double(n)));
  // Chunks of about 64K values, so that small tensors are one task and large ones spread.
  const int64_t per_task = std::max<int64_t>(1, 65536 / n), n_tasks = (n_rows + per_task - 1) / per_task;
  parallel_for(n_tasks, [&](int64_t task) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t r = task * per_task; r < std::min(n_rows, (task + 1) * per_task); ++r) {
      if (fill == Fill::Normal) normal_row(tensor_seed, uint64_t(r), sigma, x.data(), n);
      else std::fill(x.begin(), x.end(), fill == Fill::Ones ? 1.0f : 0.0f);
      quantize_row(t.type, x.data(), out + size_t(r) * row, size_t(n));
    }
  });
}

std::unique_ptr<MadeTensors> dummy_tensors(const GgufFile& header, uint64_t seed) {
  const std::vector<TensorRef>& tensors = header.tensors();
  return std::make_unique<MadeTensors>(
      tensors, [&](size_t i, uint8_t* out) { dummy_tensor_bytes(tensors[i], seed, out); }, "--load-format dummy");
}

void export_shape(const std::string& model, const std::string& out, bool full, uint64_t seed) {
  const GgufFile in(model, GgufFile::Data::Absent);
  GgufWriter w;
  for (const auto& [key, value] : in.metadata())
    if (key != kShapeOnlyKey && key != "general.alignment") w.add_value(key, value);
  if (!full) w.add_value(kShapeOnlyKey, {GgufValueType::BOOL, true});
  for (const TensorRef& t : in.tensors()) w.add_tensor_info(t.name, t.ne, uint32_t(t.type), t.nbytes);
  if (!full) return w.write(out);  // the header alone
  w.write(out, [&](size_t i, std::vector<uint8_t>& bytes) { dummy_tensor_bytes(in.tensors()[i], seed, bytes.data()); });
}

}  // namespace serval
