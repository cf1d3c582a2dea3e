#include "tensor/dequant.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <immintrin.h>

#include "base/error.h"
#include "tensor/blocks.h"

namespace serval {

float fp16_to_f32_portable(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_fp16_portable(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int32_t exp = int32_t((x >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = x & 0x7FFFFF;
  if (((x >> 23) & 0xFF) == 0xFF) return uint16_t(sign | 0x7C00 | (mant ? 0x200 : 0));
  if (exp >= 31) return uint16_t(sign | 0x7C00);
  if (exp <= 0) {
    if (exp < -10) return uint16_t(sign);
    mant |= 0x800000;
    const uint32_t shift = uint32_t(14 - exp);
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = sign | (uint32_t(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return uint16_t(half);
}

#if defined(__F16C__)
float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
uint16_t f32_to_fp16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
float fp16_to_f32(uint16_t h) { return fp16_to_f32_portable(h); }
uint16_t f32_to_fp16(float f) { return f32_to_fp16_portable(f); }
#endif

void fp16_to_f32_row(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = fp16_to_f32(src[i]);
}

void f32_to_fp16_row(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = f32_to_fp16(src[i]);
}

namespace {

uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

}  // namespace

float fp8_e4m3_to_f32(uint8_t x) {
  const int e = (x >> 3) & 15, m = x & 7;
  const float sign = (x & 0x80) ? -1.0f : 1.0f;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(float(m), -9);  // subnormal: m / 8 * 2^-6
  return sign * std::ldexp(float(8 + m), e - 10);     // (1 + m / 8) * 2^(e - 7)
}

uint8_t f32_to_fp8_e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return sign | 0x7F;
  const float a = std::fabs(f);
  if (!(a < 448.0f)) return sign | 0x7E;
  // Subnormals (and the smallest normal, code 8) in steps of 2^-9; scaling by powers of 2 is exact,
  // so nearbyint (the default mode: to nearest even) is the only rounding.
  if (a < 0x1p-6f) return sign | uint8_t(std::nearbyint(a * 512.0f));
  int k = 0;
  std::frexp(a, &k);  // a = f * 2^k, f in [0.5, 1): exponent k - 1
  int e = k - 1, r = int(std::nearbyint(std::ldexp(a, 3 - e)));  // r in [8, 16]
  if (r == 16) r = 8, ++e;
  const int code = (e + 7) << 3 | (r - 8);
  return sign | uint8_t(code > 0x7E ? 0x7E : code);
}

const float* fp8_e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8_e4m3_to_f32(uint8_t(i));
    return t;
  }();
  return table.data();
}

void dequantize_row(DType type, const uint8_t* src, float* dst, size_t n) {
  switch (type) {
    case DType::F8_E4M3: {
      const float* t = fp8_e4m3_table();
      for (size_t i = 0; i < n; ++i) dst[i] = t[src[i]];
      return;
    }
    case DType::F32: std::memcpy(dst, src, n * 4); return;
    case DType::F16:
      if (reinterpret_cast<uintptr_t>(src) % alignof(uint16_t) == 0) {
        fp16_to_f32_row(reinterpret_cast<const uint16_t*>(src), dst, n);
      } else {  // a row at an odd address (a matrix view may start anywhere): read the halves bytewise
        for (size_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(load_u16(src + 2 * i));
      }
      return;
    case DType::BF16: for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_u16(src + 2 * i)); return;
    default: break;
  }
  const auto& info = dtype_info(type);
  check(n % info.block_elems == 0, "dequantize: {} elements is not a multiple of the {} block", n, info.name);
  const size_t n_blocks = n / info.block_elems;
  if (is_kquant(type)) {
    BlockK blk;
    for (size_t i = 0; i < n_blocks; ++i, dst += 256) {
      unpack_block_k(type, src + i * info.block_bytes, blk);
      for (int s = 0; s < blk.n_sub; ++s) {
        const float dl = blk.d * float(blk.scale[s]), ml = blk.dmin * float(blk.min[s]);
        for (int l = 0; l < blk.sub_len; ++l) dst[s * blk.sub_len + l] = dl * float(blk.q[s * blk.sub_len + l]) - ml;
      }
    }
    return;
  }
  Block32 blk;
  // As ggml: q * d for the symmetric types (no "+ 0", which would turn -0 into +0), q * d + m for
  // the types with a minimum.
  const bool has_min = type == DType::Q4_1 || type == DType::Q5_1;
  for (size_t i = 0; i < n_blocks; ++i, dst += 32) {
    unpack_block32(type, src + i * info.block_bytes, blk);
    if (has_min)
      for (int j = 0; j < 32; ++j) dst[j] = float(blk.q[j]) * blk.d + blk.m;
    else
      for (int j = 0; j < 32; ++j) dst[j] = float(blk.q[j]) * blk.d;
  }
}

}  // namespace serval
