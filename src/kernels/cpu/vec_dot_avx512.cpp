// Quantized dot products with AVX-512 VNNI (256-bit lanes): unsigned weight values times signed
// activation bytes with VPDPBUSD, integer sums per block, scales applied in float lanes. Types
// without a SIMD version here use the scalar reference.
#include <immintrin.h>

#include <cstring>

#include "kernels/act_quant.h"
#include "tensor/dequant.h"

namespace serval::cpu {
namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define SERVAL_HAVE_VNNI 1

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }

float half(uint16_t h) { return _cvtsh_ss(h); }

// 32 unsigned 4-bit values of a Q4_0 / Q4_1 style nibble array: low nibbles first, then high.
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

float dot_q8_0(const uint8_t* w, const BlockQ8_0* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += 34) {
    uint16_t wd;
    std::memcpy(&wd, w, 2);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs));
    const __m256i dot = dpbusd(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half(wd) * half(x[b].d)), _mm256_cvtepi32_ps(dot), acc);
  }
  return hsum(acc);
}

// Q4_0 (offset 8) and Q5_0 (offset 16): sum(q * x) - offset * sum(x), all in integers per block.
template <bool kFiveBits>
float dot_q45_0(const uint8_t* w, const BlockQ8_0* x, int64_t nb) {
  constexpr int kBlockBytes = kFiveBits ? 22 : 18;
  constexpr int kOffsetShift = kFiveBits ? 4 : 3;
  const __m256i ones = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes) {
    uint16_t wd;
    std::memcpy(&wd, w, 2);
    __m256i q;
    if constexpr (kFiveBits) {
      uint32_t qh;
      std::memcpy(&qh, w + 2, 4);
      q = _mm256_or_si256(nibbles32(w + 6), _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(0x10)));
    } else {
      q = nibbles32(w + 2);
    }
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs));
    const __m256i qx = dpbusd(_mm256_setzero_si256(), q, xv);
    const __m256i sx = dpbusd(_mm256_setzero_si256(), ones, xv);
    const __m256i dot = _mm256_sub_epi32(qx, _mm256_slli_epi32(sx, kOffsetShift));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half(wd) * half(x[b].d)), _mm256_cvtepi32_ps(dot), acc);
  }
  return hsum(acc);
}

void scale_min_k4(int j, const uint8_t* q, int32_t* sc, int32_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins.
template <bool kFiveBits>
float dot_q45_k(const uint8_t* w, const BlockQ8_K* x, int64_t nb) {
  constexpr int kBlockBytes = kFiveBits ? 176 : 144;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  float acc_min = 0;
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes) {
    uint16_t d16, dmin16;
    std::memcpy(&d16, w, 2);
    std::memcpy(&dmin16, w + 2, 2);
    int32_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(j, w + 4, &sc[j], &mn[j]);
    const uint8_t* ql = w + (kFiveBits ? 48 : 16);
    const __m256i qh = kFiveBits ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : _mm256_setzero_si256();
    __m256i sumi = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * c));
      __m256i lo = _mm256_and_si256(raw, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      if constexpr (kFiveBits) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs + 64 * c));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs + 64 * c + 32));
      const __m256i d0 = dpbusd(_mm256_setzero_si256(), lo, x0);
      const __m256i d1 = dpbusd(_mm256_setzero_si256(), hi, x1);
      sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(d0, _mm256_set1_epi32(sc[2 * c])));
      sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(d1, _mm256_set1_epi32(sc[2 * c + 1])));
    }
    int32_t summ = 0;
    for (int j = 0; j < 8; ++j) summ += mn[j] * (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(x[b].d * half(d16)), _mm256_cvtepi32_ps(sumi), acc);
    acc_min += x[b].d * half(dmin16) * float(summ);
  }
  return hsum(acc) - acc_min;
}

// Q6_K: 16 sub-blocks of 16 with int8 scales; values are 6-bit minus 32.
float dot_q6_k(const uint8_t* w, const BlockQ8_K* x, int64_t nb) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  float acc_offset = 0;
  for (int64_t b = 0; b < nb; ++b, w += 210) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    uint16_t d16;
    std::memcpy(&d16, w + 208, 2);
    __m256i sumi = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = w + 64 * h;
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i qhv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
      const __m256i g[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qhv, three), 4)),
          _mm256_or_si256(_mm256_and_si256(ql1, low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qhv, 2), three), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qhv, 4), three), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qhv, 6), three), 4)),
      };
      for (int k = 0; k < 4; ++k) {
        const int s0 = sc[8 * h + 2 * k], s1 = sc[8 * h + 2 * k + 1];
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs + 128 * h + 32 * k));
        const __m256i dot = dpbusd(_mm256_setzero_si256(), g[k], xv);
        sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(dot, _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1)));
      }
    }
    int32_t offset = 0;
    for (int s = 0; s < 16; ++s) offset += int32_t(sc[s]) * x[b].bsums[s];
    const float d = x[b].d * half(d16);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    acc_offset += d * float(32 * offset);
  }
  return hsum(acc) - acc_offset;
}

#endif

}  // namespace

float vec_dot(DType t, const uint8_t* w, const uint8_t* act, int64_t n) {
#ifdef SERVAL_HAVE_VNNI
  const auto* q8_0 = reinterpret_cast<const BlockQ8_0*>(act);
  const auto* q8_k = reinterpret_cast<const BlockQ8_K*>(act);
  switch (t) {
    case DType::Q8_0: return dot_q8_0(w, q8_0, n / 32);
    case DType::Q4_0: return dot_q45_0<false>(w, q8_0, n / 32);
    case DType::Q5_0: return dot_q45_0<true>(w, q8_0, n / 32);
    case DType::Q4_K: return dot_q45_k<false>(w, q8_k, n / 256);
    case DType::Q5_K: return dot_q45_k<true>(w, q8_k, n / 256);
    case DType::Q6_K: return dot_q6_k(w, q8_k, n / 256);
    default: break;
  }
#endif
  return ref::vec_dot(t, w, act, n);
}

}  // namespace serval::cpu
