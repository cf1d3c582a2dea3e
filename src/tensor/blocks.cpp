#include "tensor/blocks.h"

#include <cstdlib>
#include <cstring>

#include "base/error.h"
#include "tensor/dequant.h"

namespace serval {
namespace {

float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_f32(h);
}

// IQ4_NL's levels (ggml's kvalues_iq4nl).
constexpr int8_t kIq4nlLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Six-bit scale and min number j of a Q4_K / Q5_K super-block.
void scale_min_k4(int j, const uint8_t* q, int16_t* sc, int16_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void unpack_q2_k(const uint8_t* b, BlockK& o) {  // scales[16], qs[64], d, dmin
  o.n_sub = 16, o.sub_len = 16, o.d = load_half(b + 80), o.dmin = load_half(b + 82);
  for (int s = 0; s < 16; ++s) o.scale[s] = b[s] & 0x0F, o.min[s] = b[s] >> 4;
  const uint8_t* q = b + 16;
  int i = 0;
  for (int half = 0; half < 2; ++half, q += 32)
    for (int shift = 0; shift < 8; shift += 2)
      for (int part = 0; part < 2; ++part)
        for (int l = 0; l < 16; ++l) o.q[i++] = int8_t((q[l + 16 * part] >> shift) & 3);
}

void unpack_q3_k(const uint8_t* b, BlockK& o) {  // hmask[32], qs[64], scales[12], d
  o.n_sub = 16, o.sub_len = 16, o.d = load_half(b + 108), o.dmin = 0;
  const uint8_t* hmask = b;
  const uint8_t* packed = b + 96;
  for (int s = 0; s < 16; ++s) {  // low 4 bits from packed[0..7], high 2 bits from packed[8..11]
    const int low = s < 8 ? (packed[s] & 0x0F) : (packed[s - 8] >> 4);
    const int high = (packed[8 + (s % 4)] >> (2 * (s / 4))) & 3;
    o.scale[s] = int16_t((low | (high << 4)) - 32);
    o.min[s] = 0;
  }
  const uint8_t* q = b + 32;
  int i = 0;
  uint8_t m = 1;
  for (int half = 0; half < 2; ++half, q += 32)
    for (int shift = 0; shift < 8; shift += 2, m <<= 1)
      for (int part = 0; part < 2; ++part)
        for (int l = 0; l < 16; ++l) {
          const int idx = l + 16 * part;
          o.q[i++] = int8_t(((q[idx] >> shift) & 3) - ((hmask[idx] & m) ? 0 : 4));
        }
}

void unpack_q45_k(const uint8_t* b, BlockK& o, bool five_bits) {  // d, dmin, scales[12], [qh[32]], qs[128]
  o.n_sub = 8, o.sub_len = 32, o.d = load_half(b), o.dmin = load_half(b + 2);
  for (int s = 0; s < 8; ++s) scale_min_k4(s, b + 4, &o.scale[s], &o.min[s]);
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + (five_bits ? 48 : 16);
  for (int chunk = 0; chunk < 4; ++chunk, ql += 32)
    for (int l = 0; l < 32; ++l) {
      const int hi0 = five_bits && (qh[l] >> (2 * chunk)) & 1, hi1 = five_bits && (qh[l] >> (2 * chunk + 1)) & 1;
      o.q[chunk * 64 + l] = int8_t((ql[l] & 0x0F) | (hi0 << 4));
      o.q[chunk * 64 + 32 + l] = int8_t((ql[l] >> 4) | (hi1 << 4));
    }
}

void unpack_q6_k(const uint8_t* b, BlockK& o) {  // ql[128], qh[64], scales[16] int8, d
  o.n_sub = 16, o.sub_len = 16, o.d = load_half(b + 208), o.dmin = 0;
  for (int s = 0; s < 16; ++s) o.scale[s] = int8_t(b[192 + s]), o.min[s] = 0;
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32)
    for (int l = 0; l < 32; ++l) {
      int8_t* q = o.q + half * 128;
      q[l] = int8_t(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
      q[l + 32] = int8_t(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
      q[l + 64] = int8_t(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      q[l + 96] = int8_t(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
}

void pack_q2_k(uint8_t* b, const int8_t* v) {
  uint8_t* q = b + 16;
  std::memset(q, 0, 64);
  int i = 0;
  for (int half = 0; half < 2; ++half, q += 32)
    for (int shift = 0; shift < 8; shift += 2)
      for (int part = 0; part < 2; ++part)
        for (int l = 0; l < 16; ++l) q[l + 16 * part] |= uint8_t((v[i++] & 3) << shift);
}

void pack_q3_k(uint8_t* b, const int8_t* v) {
  uint8_t* hmask = b;
  uint8_t* q = b + 32;
  std::memset(b, 0, 96);
  int i = 0;
  uint8_t m = 1;
  for (int half = 0; half < 2; ++half, q += 32)
    for (int shift = 0; shift < 8; shift += 2, m <<= 1)
      for (int part = 0; part < 2; ++part)
        for (int l = 0; l < 16; ++l) {
          const int idx = l + 16 * part, c = v[i++] + 4;
          q[idx] |= uint8_t((c & 3) << shift);
          if (c & 4) hmask[idx] |= m;
        }
}

void pack_q45_k(uint8_t* b, const int8_t* v, bool five_bits) {
  uint8_t* qh = b + 16;
  uint8_t* ql = b + (five_bits ? 48 : 16);
  std::memset(b + 16, 0, five_bits ? 160 : 128);
  for (int chunk = 0; chunk < 4; ++chunk, ql += 32)
    for (int l = 0; l < 32; ++l) {
      const int lo = v[chunk * 64 + l], hi = v[chunk * 64 + 32 + l];
      ql[l] = uint8_t((lo & 0x0F) | ((hi & 0x0F) << 4));
      if (five_bits) qh[l] |= uint8_t((((lo >> 4) & 1) << (2 * chunk)) | (((hi >> 4) & 1) << (2 * chunk + 1)));
    }
}

void pack_q6_k(uint8_t* b, const int8_t* v) {
  uint8_t* ql = b;
  uint8_t* qh = b + 128;
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32)
    for (int l = 0; l < 32; ++l) {
      const int8_t* q = v + half * 128;
      const int c0 = q[l] + 32, c1 = q[l + 32] + 32, c2 = q[l + 64] + 32, c3 = q[l + 96] + 32;
      ql[l] = uint8_t((c0 & 0x0F) | ((c2 & 0x0F) << 4));
      ql[l + 32] = uint8_t((c1 & 0x0F) | ((c3 & 0x0F) << 4));
      qh[l] = uint8_t((c0 >> 4) | ((c1 >> 4) << 2) | ((c2 >> 4) << 4) | ((c3 >> 4) << 6));
    }
}

// The index of the IQ4_NL level nearest to v (the lower one on a tie).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The MXFP4 code of value v (v one of the values; others: the nearest, the lower index on a tie).
int mxfp4_index(int v) {
  int best = 0;
  for (int k = 1; k < 16; ++k)
    if (std::abs(kMxfp4Values[k] - v) < std::abs(kMxfp4Values[best] - v)) best = k;
  return best;
}

int iq4nl_index(int v) {
  int best = 0;
  for (int k = 1; k < 16; ++k)
    if (std::abs(kIq4nlLevels[k] - v) < std::abs(kIq4nlLevels[best] - v)) best = k;
  return best;
}

}  // namespace

bool is_kquant(DType t) {
  return t == DType::Q2_K || t == DType::Q3_K || t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K;
}

void unpack_block32(DType type, const uint8_t* b, Block32& o) {
  o.m = 0;
  switch (type) {
    case DType::Q8_0:
      o.d = load_half(b);
      std::memcpy(o.q, b + 2, 32);
      return;
    case DType::Q4_0: case DType::Q4_1: {
      const bool has_min = type == DType::Q4_1;
      o.d = load_half(b);
      if (has_min) o.m = load_half(b + 2);
      const uint8_t* qs = b + (has_min ? 4 : 2);
      const int offset = has_min ? 0 : 8;
      for (int j = 0; j < 16; ++j) {
        o.q[j] = int8_t((qs[j] & 0x0F) - offset);
        o.q[j + 16] = int8_t((qs[j] >> 4) - offset);
      }
      return;
    }
    case DType::Q5_0: case DType::Q5_1: {
      const bool has_min = type == DType::Q5_1;
      o.d = load_half(b);
      if (has_min) o.m = load_half(b + 2);
      uint32_t qh;
      std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
      const uint8_t* qs = b + (has_min ? 8 : 6);
      const int offset = has_min ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        o.q[j] = int8_t(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - offset);
        o.q[j + 16] = int8_t(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - offset);
      }
      return;
    }
    case DType::IQ4_NL:  // 4-bit indices into sixteen non-uniform levels
      o.d = load_half(b);
      for (int j = 0; j < 16; ++j) {
        o.q[j] = kIq4nlLevels[b[2 + j] & 0x0F];
        o.q[j + 16] = kIq4nlLevels[b[2 + j] >> 4];
      }
      return;
    case DType::MXFP4:
      o.d = e8m0_half(b[0]);
      for (int j = 0; j < 16; ++j) {
        o.q[j] = kMxfp4Values[b[1 + j] & 0x0F];
        o.q[j + 16] = kMxfp4Values[b[1 + j] >> 4];
      }
      return;
    default: fail("internal: {} is not a 32-element quantized type", dtype_info(type).name);
  }
}

float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

const int8_t* mxfp4_values() { return kMxfp4Values; }

void unpack_block_k(DType type, const uint8_t* b, BlockK& o) {
  switch (type) {
    case DType::Q2_K: unpack_q2_k(b, o); return;
    case DType::Q3_K: unpack_q3_k(b, o); return;
    case DType::Q4_K: unpack_q45_k(b, o, false); return;
    case DType::Q5_K: unpack_q45_k(b, o, true); return;
    case DType::Q6_K: unpack_q6_k(b, o); return;
    default: fail("internal: {} is not a k-quant type", dtype_info(type).name);
  }
}

const int8_t* iq4nl_levels() { return kIq4nlLevels; }

void pack_codes32(DType type, uint8_t* b, const int8_t* q) {
  switch (type) {
    case DType::Q8_0: std::memcpy(b + 2, q, 32); return;
    case DType::Q4_0: case DType::Q4_1: {
      const bool has_min = type == DType::Q4_1;
      uint8_t* qs = b + (has_min ? 4 : 2);
      const int offset = has_min ? 0 : 8;
      for (int j = 0; j < 16; ++j) qs[j] = uint8_t(((q[j] + offset) & 0x0F) | (((q[j + 16] + offset) & 0x0F) << 4));
      return;
    }
    case DType::Q5_0: case DType::Q5_1: {
      const bool has_min = type == DType::Q5_1;
      uint8_t* qs = b + (has_min ? 8 : 6);
      const int offset = has_min ? 0 : 16;
      uint32_t qh = 0;
      for (int j = 0; j < 16; ++j) {
        const int lo = q[j] + offset, hi = q[j + 16] + offset;
        qs[j] = uint8_t((lo & 0x0F) | ((hi & 0x0F) << 4));
        qh |= uint32_t((lo >> 4) & 1) << j | uint32_t((hi >> 4) & 1) << (j + 16);
      }
      std::memcpy(b + (has_min ? 4 : 2), &qh, 4);
      return;
    }
    case DType::IQ4_NL:
      for (int j = 0; j < 16; ++j) b[2 + j] = uint8_t(iq4nl_index(q[j]) | (iq4nl_index(q[j + 16]) << 4));
      return;
    case DType::MXFP4:
      for (int j = 0; j < 16; ++j) b[1 + j] = uint8_t(mxfp4_index(q[j]) | (mxfp4_index(q[j + 16]) << 4));
      return;
    default: fail("internal: {} is not a 32-element quantized type", dtype_info(type).name);
  }
}

void pack_codes_k(DType type, uint8_t* b, const int8_t* q) {
  switch (type) {
    case DType::Q2_K: pack_q2_k(b, q); return;
    case DType::Q3_K: pack_q3_k(b, q); return;
    case DType::Q4_K: pack_q45_k(b, q, false); return;
    case DType::Q5_K: pack_q45_k(b, q, true); return;
    case DType::Q6_K: pack_q6_k(b, q); return;
    default: fail("internal: {} is not a k-quant type", dtype_info(type).name);
  }
}

CodeRange code_range(DType type) {
  switch (type) {
    case DType::Q8_0: return {-127, 127};
    case DType::Q4_0: return {-8, 7};
    case DType::Q4_1: return {0, 15};
    case DType::Q5_0: return {-16, 15};
    case DType::Q5_1: return {0, 31};
    case DType::IQ4_NL: return {-127, 113};
    case DType::MXFP4: return {-12, 12};
    case DType::Q2_K: return {0, 3};
    case DType::Q3_K: return {-4, 3};
    case DType::Q4_K: return {0, 15};
    case DType::Q5_K: return {0, 31};
    case DType::Q6_K: return {-32, 31};
    default: fail("internal: {} has no integer codes", dtype_info(type).name);
  }
}

}  // namespace serval
