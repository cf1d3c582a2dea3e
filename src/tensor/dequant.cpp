#include "tensor/dequant.h"

#include <cstring>

#include "base/error.h"

namespace serval {

float fp16_to_f32(uint16_t h) {
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

uint16_t f32_to_fp16(float f) {
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

namespace {

uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
float load_half(const uint8_t* p) { return fp16_to_f32(load_u16(p)); }

// ---- 32-element blocks ----
void dequant_q4_0(const uint8_t* b, float* y) {  // d:f16, qs[16]
  const float d = load_half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = float((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = float((qs[j] >> 4) - 8) * d;
  }
}

void dequant_q4_1(const uint8_t* b, float* y) {  // d:f16, m:f16, qs[16]
  const float d = load_half(b), m = load_half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = float(qs[j] & 0x0F) * d + m;
    y[j + 16] = float(qs[j] >> 4) * d + m;
  }
}

void dequant_q5_0(const uint8_t* b, float* y) {  // d:f16, qh[4], qs[16]
  const float d = load_half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int hi0 = (qh >> j) & 1, hi1 = (qh >> (j + 16)) & 1;
    y[j] = float(((qs[j] & 0x0F) | (hi0 << 4)) - 16) * d;
    y[j + 16] = float(((qs[j] >> 4) | (hi1 << 4)) - 16) * d;
  }
}

void dequant_q5_1(const uint8_t* b, float* y) {  // d:f16, m:f16, qh[4], qs[16]
  const float d = load_half(b), m = load_half(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int hi0 = (qh >> j) & 1, hi1 = (qh >> (j + 16)) & 1;
    y[j] = float((qs[j] & 0x0F) | (hi0 << 4)) * d + m;
    y[j + 16] = float((qs[j] >> 4) | (hi1 << 4)) * d + m;
  }
}

void dequant_q8_0(const uint8_t* b, float* y) {  // d:f16, qs[32] int8
  const float d = load_half(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = float(qs[j]) * d;
}

// ---- 256-element super-blocks (k-quants) ----
void dequant_q2_k(const uint8_t* b, float* y) {  // scales[16], qs[64], d:f16, dmin:f16
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = load_half(b + 80), dmin = load_half(b + 82);
  int is = 0;
  for (int half = 0; half < 2; ++half, q += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int part = 0; part < 2; ++part) {
        const uint8_t sc = scales[is++];
        const float dl = d * float(sc & 0x0F), ml = dmin * float(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * float((q[l + 16 * part] >> shift) & 3) - ml;
      }
    }
  }
}

void dequant_q3_k(const uint8_t* b, float* y) {  // hmask[32], qs[64], scales[12], d:f16
  const uint8_t* hmask = b;
  const uint8_t* q = b + 32;
  const uint8_t* packed = b + 96;
  const float d = load_half(b + 108);
  // 16 six-bit scales: low 4 bits from packed[0..7], high 2 bits from packed[8..11].
  int8_t scales[16];
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? (packed[i] & 0x0F) : (packed[i - 8] >> 4);
    const int high = (packed[8 + (i % 4)] >> (2 * (i / 4))) & 3;
    scales[i] = int8_t((low | (high << 4)) - 32);
  }
  int is = 0;
  uint8_t m = 1;
  for (int half = 0; half < 2; ++half, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
      for (int part = 0; part < 2; ++part) {
        const float dl = d * float(scales[is++]);
        for (int l = 0; l < 16; ++l) {
          const int idx = l + 16 * part;
          const int v = ((q[idx] >> shift) & 3) - ((hmask[idx] & m) ? 0 : 4);
          *y++ = dl * float(v);
        }
      }
    }
  }
}

// Six-bit scale and min number j of a Q4_K / Q5_K super-block.
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void dequant_q4_k(const uint8_t* b, float* y) {  // d:f16, dmin:f16, scales[12], qs[128]
  const float d = load_half(b), dmin = load_half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 8; j += 2, q += 32) {
    uint8_t sc, mn;
    scale_min_k4(j, scales, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    scale_min_k4(j + 1, scales, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l) *y++ = d1 * float(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * float(q[l] >> 4) - m2;
  }
}

void dequant_q5_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qh[32], qs[128]
  const float d = load_half(b), dmin = load_half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < 8; j += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
    uint8_t sc, mn;
    scale_min_k4(j, scales, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    scale_min_k4(j + 1, scales, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l) *y++ = d1 * float((ql[l] & 0x0F) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * float((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
  }
}

void dequant_q6_k(const uint8_t* b, float* y) {  // ql[128], qh[64], scales[16] int8, d:f16
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_half(b + 208);
  for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = int((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = int((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * float(sc[is]) * float(q1);
      y[l + 32] = d * float(sc[is + 2]) * float(q2);
      y[l + 64] = d * float(sc[is + 4]) * float(q3);
      y[l + 96] = d * float(sc[is + 6]) * float(q4);
    }
  }
}

using BlockFn = void (*)(const uint8_t*, float*);

BlockFn block_fn(DType type) {
  switch (type) {
    case DType::Q4_0: return dequant_q4_0;
    case DType::Q4_1: return dequant_q4_1;
    case DType::Q5_0: return dequant_q5_0;
    case DType::Q5_1: return dequant_q5_1;
    case DType::Q8_0: return dequant_q8_0;
    case DType::Q2_K: return dequant_q2_k;
    case DType::Q3_K: return dequant_q3_k;
    case DType::Q4_K: return dequant_q4_k;
    case DType::Q5_K: return dequant_q5_k;
    case DType::Q6_K: return dequant_q6_k;
    default: return nullptr;
  }
}

}  // namespace

void dequantize_row(DType type, const uint8_t* src, float* dst, size_t n) {
  switch (type) {
    case DType::F32: std::memcpy(dst, src, n * 4); return;
    case DType::F16: for (size_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(load_u16(src + 2 * i)); return;
    case DType::BF16: for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_u16(src + 2 * i)); return;
    default: break;
  }
  const auto& info = dtype_info(type);
  check(n % info.block_elems == 0, "dequantize: {} elements is not a multiple of the {} block", n, info.name);
  const BlockFn fn = block_fn(type);
  for (size_t i = 0; i < n / info.block_elems; ++i) fn(src + i * info.block_bytes, dst + i * info.block_elems);
}

}  // namespace serval
