#include "io/ggml_types.h"

#include <array>
#include <fmt/format.h>
#include <string>

#include "base/error.h"

namespace serval {
namespace {

constexpr std::array<DTypeInfo, 17> kTypes = {{
    {DType::F32, "F32", 1, 4},      {DType::F16, "F16", 1, 2},
    {DType::BF16, "BF16", 1, 2},    {DType::Q4_0, "Q4_0", 32, 18},
    {DType::Q4_1, "Q4_1", 32, 20},  {DType::Q5_0, "Q5_0", 32, 22},
    {DType::Q5_1, "Q5_1", 32, 24},  {DType::Q8_0, "Q8_0", 32, 34},
    {DType::Q2_K, "Q2_K", 256, 84}, {DType::Q3_K, "Q3_K", 256, 110},
    {DType::Q4_K, "Q4_K", 256, 144}, {DType::Q5_K, "Q5_K", 256, 176},
    {DType::Q6_K, "Q6_K", 256, 210}, {DType::IQ4_NL, "IQ4_NL", 32, 18},
    {DType::MXFP4, "MXFP4", 32, 17}, {DType::F8_E4M3, "F8_E4M3", 1, 1},
    {DType::U8, "U8", 1, 1},
}};

// Names of GGUF types that exist but that Serval does not implement, for clear errors.
constexpr std::array<std::string_view, 42> kAllNames = {
    "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
    "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
    "BF16", "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8", "TQ1_0", "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8",
    "IQ4_NL_8_8", "MXFP4", "", ""};

}  // namespace

std::optional<DTypeInfo> dtype_info(uint32_t type_id) {
  for (const auto& t : kTypes)
    if (static_cast<uint32_t>(t.type) == type_id && t.type != DType::F8_E4M3 && t.type != DType::U8) return t;
  return std::nullopt;
}

const DTypeInfo& dtype_info(DType type) {
  for (const auto& t : kTypes)
    if (t.type == type) return t;
  fail("internal: unknown dtype {}", static_cast<uint32_t>(type));
}

std::string dtype_name(uint32_t type_id) {
  if (type_id < kAllNames.size() && !kAllNames[type_id].empty()) return std::string(kAllNames[type_id]);
  return fmt::format("type {}", type_id);
}

double bytes_per_elem(DType type) {
  const auto& info = dtype_info(type);
  return double(info.block_bytes) / double(info.block_elems);
}

size_t row_bytes(DType type, size_t n) {
  const auto& info = dtype_info(type);
  check(n % info.block_elems == 0, "row of {} elements is not a multiple of the {} block size {}", n,
        info.name, info.block_elems);
  return n / info.block_elems * info.block_bytes;
}

}  // namespace serval
