// Dequantization: half/bfloat conversion against the CPU's own F16C instructions (exhaustive), and
// hand-computed blocks per type from the block definitions. tests/py/test_dequant.py compares every
// type against the gguf Python package's independent implementation on random blocks.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels/isa.h"
#include "tensor/dequant.h"

namespace serval {
namespace {

// The hardware conversions, compiled for F16C whatever the baseline (tests skip without it).
__attribute__((target("f16c"))) float hw_half_to_float(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) uint16_t hw_float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
bool have_f16c() { return cpu::detected_isa() >= cpu::Isa::Avx2; }  // the AVX2 level requires F16C

TEST(Dequant, HalfToFloatExhaustiveAgainstF16C) {
  if (!have_f16c()) GTEST_SKIP() << "not run: this CPU has no F16C";
  for (uint32_t h = 0; h < 65536; ++h) {
    const float ours = fp16_to_f32_portable(uint16_t(h));
    const float hw = hw_half_to_float(uint16_t(h));
    if (std::isnan(hw)) {
      EXPECT_TRUE(std::isnan(ours)) << h;
    } else {
      EXPECT_EQ(std::memcmp(&ours, &hw, 4), 0) << "half 0x" << std::hex << h;
    }
  }
}

TEST(Dequant, FloatToHalfRoundsLikeF16C) {
  if (!have_f16c()) GTEST_SKIP() << "not run: this CPU has no F16C";
  uint32_t state = 12345;
  for (int i = 0; i < 200000; ++i) {
    state = state * 1664525u + 1013904223u;
    float f;
    uint32_t bits = state;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_fp16_portable(f), hw_float_to_half(f)) << f;
  }
}

TEST(Dequant, RowConversionsMatchScalar) {
  std::vector<uint16_t> h(1003);
  for (size_t i = 0; i < h.size(); ++i) h[i] = uint16_t(i * 65 + 7);
  std::vector<float> f(h.size());
  fp16_to_f32_row(h.data(), f.data(), h.size());
  for (size_t i = 0; i < h.size(); ++i) {
    const float want = fp16_to_f32_portable(h[i]);
    if (!std::isnan(want)) {
      EXPECT_EQ(f[i], want) << i;
    }
  }
  std::vector<float> x(1003);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(float(i)) * float(i);
  std::vector<uint16_t> back(x.size());
  f32_to_fp16_row(x.data(), back.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], f32_to_fp16_portable(x[i])) << i;
}

TEST(Dequant, Bf16IsTopHalfOfFloat) {
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xC040), -3.0f);
}

void put_half(uint8_t* p, float f) {
  const uint16_t h = f32_to_fp16(f);
  std::memcpy(p, &h, 2);
}

TEST(Dequant, Q8_0Block) {
  uint8_t b[34];
  put_half(b, 0.25f);
  for (int j = 0; j < 32; ++j) b[2 + j] = uint8_t(int8_t(j - 16));
  float y[32];
  dequantize_row(DType::Q8_0, b, y, 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], 0.25f * (j - 16));
}

TEST(Dequant, Q4_0AndQ4_1Blocks) {
  uint8_t b[20];
  put_half(b, 0.5f);
  for (int j = 0; j < 16; ++j) b[2 + j] = uint8_t(j | ((15 - j) << 4));
  float y[32];
  dequantize_row(DType::Q4_0, b, y, 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.5f * (j - 8));            // low nibbles are the first 16 values
    EXPECT_EQ(y[j + 16], 0.5f * (15 - j - 8));  // high nibbles the next 16
  }
  put_half(b, 2.0f);
  put_half(b + 2, -1.0f);
  for (int j = 0; j < 16; ++j) b[4 + j] = uint8_t(j | ((15 - j) << 4));
  dequantize_row(DType::Q4_1, b, y, 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 2.0f * j - 1.0f);
    EXPECT_EQ(y[j + 16], 2.0f * (15 - j) - 1.0f);
  }
}

TEST(Dequant, Q5_0UsesTheFifthBit) {
  uint8_t b[22] = {};
  put_half(b, 1.0f);
  const uint32_t qh = 0x80000001u;  // bit 0: element 0; bit 31: element 31
  std::memcpy(b + 2, &qh, 4);
  for (int j = 0; j < 16; ++j) b[6 + j] = 0x33;
  float y[32];
  dequantize_row(DType::Q5_0, b, y, 32);
  EXPECT_EQ(y[0], float((3 | 16) - 16));
  EXPECT_EQ(y[1], float(3 - 16));
  EXPECT_EQ(y[31], float((3 | 16) - 16));
  EXPECT_EQ(y[30], float(3 - 16));
}

TEST(Dequant, Q4_KWithUnitScales) {
  uint8_t b[144] = {};
  put_half(b, 1.0f);
  put_half(b + 2, 0.5f);
  uint8_t* scales = b + 4;
  for (int j = 0; j < 4; ++j) scales[j] = 2;         // scale of sub-blocks 0..3
  for (int j = 4; j < 8; ++j) scales[j] = 1;         // min of sub-blocks 0..3
  for (int j = 8; j < 12; ++j) scales[j] = 0x12;     // sub-blocks 4..7: scale 2, min 1
  for (int l = 0; l < 128; ++l) b[16 + l] = uint8_t((l % 16) | ((15 - l % 16) << 4));
  float y[256];
  dequantize_row(DType::Q4_K, b, y, 256);
  for (int chunk = 0; chunk < 4; ++chunk)
    for (int l = 0; l < 32; ++l) {
      EXPECT_EQ(y[chunk * 64 + l], 2.0f * (l % 16) - 0.5f);
      EXPECT_EQ(y[chunk * 64 + 32 + l], 2.0f * (15 - l % 16) - 0.5f);
    }
}

TEST(Dequant, Q6_KSignedSixBitValues) {
  uint8_t b[210] = {};
  for (int i = 0; i < 16; ++i) b[192 + i] = uint8_t(int8_t(i % 2 ? -1 : 1));
  put_half(b + 208, 0.5f);
  // All low nibbles 0 and high bits 0: every value is (0 - 32) * d * scale.
  float y[256];
  dequantize_row(DType::Q6_K, b, y, 256);
  for (int i = 0; i < 256; ++i) {
    const int sub = i / 16;  // 16 sub-blocks of 16 elements, in order
    EXPECT_EQ(y[i], 0.5f * (sub % 2 ? -1.0f : 1.0f) * -32.0f) << i;
  }
}

}  // namespace
}  // namespace serval
