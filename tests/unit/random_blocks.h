// Random but well-formed quantized rows for kernel tests: random bytes with finite, modest scales.
#pragma once
#include <cstring>
#include <random>
#include <vector>

#include "io/ggml_types.h"
#include "tensor/dequant.h"

namespace serval::test {

// Offsets of the f16 scale fields inside one block of each type.
inline std::vector<size_t> half_fields(DType t) {
  switch (t) {
    case DType::Q4_0: case DType::Q5_0: case DType::Q8_0: case DType::IQ4_NL: return {0};
    case DType::Q4_1: case DType::Q5_1: return {0, 2};
    case DType::Q2_K: return {80, 82};
    case DType::Q3_K: return {108};
    case DType::Q4_K: case DType::Q5_K: return {0, 2};
    case DType::Q6_K: return {208};
    default: return {};
  }
}

inline std::vector<uint8_t> random_rows(DType t, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  const auto& info = dtype_info(t);
  std::vector<uint8_t> b(rows * row_bytes(t, cols));
  for (auto& x : b) x = uint8_t(rng());
  const auto put = [&](uint8_t* p, float f) {
    const uint16_t h = t == DType::BF16 ? uint16_t([&] { uint32_t u; std::memcpy(&u, &f, 4); return u >> 16; }())
                                        : f32_to_fp16(f);
    std::memcpy(p, &h, 2);
  };
  if (t == DType::F32) {
    for (size_t i = 0; i < b.size(); i += 4) { float f = scale(rng) * 20; std::memcpy(&b[i], &f, 4); }
  } else if (t == DType::F16 || t == DType::BF16) {
    for (size_t i = 0; i < b.size(); i += 2) put(&b[i], scale(rng) * 20);
  } else {
    for (size_t blk = 0; blk < b.size() / info.block_bytes; ++blk) {
      for (size_t off : half_fields(t)) put(&b[blk * info.block_bytes + off], scale(rng));
      if (t == DType::MXFP4) b[blk * info.block_bytes] = uint8_t(118 + rng() % 7);  // scales 2^-10 .. 2^-4
    }
  }
  return b;
}

// n normally distributed floats (mean 0, deviation 1) from a fixed seed: activations and queries.
inline std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline const std::vector<DType>& all_types() {
  static const std::vector<DType> types = {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1,
                                           DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q2_K, DType::Q3_K,
                                           DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL, DType::MXFP4};
  return types;
}

}  // namespace serval::test
