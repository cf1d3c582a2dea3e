// Row dot products for types the packed GEMM does not cover, and for tests of the GGUF-layout kernels.
// Quantized dot products with AVX-512 VNNI (256-bit lanes): unsigned weight values times signed
// activation bytes with VPDPBUSD, integer sums per block, scales applied in float lanes. Types
// without a SIMD version here use the scalar reference.
//
// Each kernel takes up to kMaxRows activation rows at once: a weight block is unpacked once and
// used for every row. Per row the operations and their order are exactly those of a one-row call,
// so results do not depend on how many rows share the call (batch invariance).
#include <immintrin.h>

#include <cstring>

#include "kernels/act_quant.h"
#include "kernels/cpu/vec_dot_isa.h"
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

inline __m256i dpbusd(__m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u8, s8); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
float half(uint16_t h) { return _cvtsh_ss(h); }
uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// 32 unsigned 4-bit values of a Q4_0 / Q4_1 style nibble array: low nibbles first, then high.
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

template <int N>
void dot_q8_0(const uint8_t* w, const BlockQ8_0* const* x, int64_t nb, float* out) {
  __m256 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += 34) {
    const float wd = half(load_u16(w));
    const __m256i q = load256(w + 2);
    const __m256i aq = _mm256_sign_epi8(q, q);
    for (int r = 0; r < N; ++r) {
      const __m256i dot = dpbusd(aq, _mm256_sign_epi8(load256(x[r][b].qs), q));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * half(x[r][b].d)), _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int r = 0; r < N; ++r) out[r] = hsum(acc[r]);
}

// Q4_0 (offset 8) and Q5_0 (offset 16): sum(q * x) - offset * sum(x), all in integers per block.
template <bool kFiveBits, int N>
void dot_q45_0(const uint8_t* w, const BlockQ8_0* const* x, int64_t nb, float* out) {
  constexpr int kBlockBytes = kFiveBits ? 22 : 18;
  constexpr int kOffsetShift = kFiveBits ? 4 : 3;
  const __m256i ones = _mm256_set1_epi8(1);
  __m256 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes) {
    const float wd = half(load_u16(w));
    __m256i q;
    if constexpr (kFiveBits) {
      uint32_t qh;
      std::memcpy(&qh, w + 2, 4);
      q = _mm256_or_si256(nibbles32(w + 6), _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(0x10)));
    } else {
      q = nibbles32(w + 2);
    }
    for (int r = 0; r < N; ++r) {
      const __m256i xv = load256(x[r][b].qs);
      const __m256i dot = _mm256_sub_epi32(dpbusd(q, xv), _mm256_slli_epi32(dpbusd(ones, xv), kOffsetShift));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * half(x[r][b].d)), _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int r = 0; r < N; ++r) out[r] = hsum(acc[r]);
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
template <bool kFiveBits, int N>
void dot_q45_k(const uint8_t* w, const BlockQ8_K* const* x, int64_t nb, float* out) {
  constexpr int kBlockBytes = kFiveBits ? 176 : 144;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256 acc[N];
  float acc_min[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm256_setzero_ps(), acc_min[r] = 0;
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes) {
    const float d = half(load_u16(w)), dmin = half(load_u16(w + 2));
    int32_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(j, w + 4, &sc[j], &mn[j]);
    const uint8_t* ql = w + (kFiveBits ? 48 : 16);
    const __m256i qh = kFiveBits ? load256(w + 16) : _mm256_setzero_si256();
    __m256i sumi[N];
    for (int r = 0; r < N; ++r) sumi[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = load256(ql + 32 * c);
      __m256i lo = _mm256_and_si256(raw, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      if constexpr (kFiveBits) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
      const __m256i s_lo = _mm256_set1_epi32(sc[2 * c]), s_hi = _mm256_set1_epi32(sc[2 * c + 1]);
      for (int r = 0; r < N; ++r) {
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(dpbusd(lo, load256(x[r][b].qs + 64 * c)), s_lo));
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(dpbusd(hi, load256(x[r][b].qs + 64 * c + 32)), s_hi));
      }
    }
    for (int r = 0; r < N; ++r) {
      int32_t summ = 0;
      for (int j = 0; j < 8; ++j) summ += mn[j] * (x[r][b].bsums[2 * j] + x[r][b].bsums[2 * j + 1]);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r][b].d * d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
      acc_min[r] += x[r][b].d * dmin * float(summ);
    }
  }
  for (int r = 0; r < N; ++r) out[r] = hsum(acc[r]) - acc_min[r];
}

// Q6_K: 16 sub-blocks of 16 with int8 scales; values are 6-bit minus 32.
template <int N>
void dot_q6_k(const uint8_t* w, const BlockQ8_K* const* x, int64_t nb, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  __m256 acc[N];
  float acc_offset[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm256_setzero_ps(), acc_offset[r] = 0;
  for (int64_t b = 0; b < nb; ++b, w += 210) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    const float d16 = half(load_u16(w + 208));
    __m256i sumi[N];
    for (int r = 0; r < N; ++r) sumi[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load256(w + 64 * h), ql1 = load256(w + 64 * h + 32), qhv = load256(w + 128 + 32 * h);
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
        const __m256i scales = _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1);
        for (int r = 0; r < N; ++r)
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(dpbusd(g[k], load256(x[r][b].qs + 128 * h + 32 * k)), scales));
      }
    }
    for (int r = 0; r < N; ++r) {
      int32_t offset = 0;
      for (int s = 0; s < 16; ++s) offset += int32_t(sc[s]) * x[r][b].bsums[s];
      const float d = x[r][b].d * d16;
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
      acc_offset[r] += d * float(32 * offset);
    }
  }
  for (int r = 0; r < N; ++r) out[r] = hsum(acc[r]) - acc_offset[r];
}

template <int N>
bool dot_rows(DType t, const uint8_t* w, const uint8_t* const* acts, int64_t n, float* out) {
  const auto* q8_0 = reinterpret_cast<const BlockQ8_0* const*>(acts);
  const auto* q8_k = reinterpret_cast<const BlockQ8_K* const*>(acts);
  switch (t) {
    case DType::Q8_0: dot_q8_0<N>(w, q8_0, n / 32, out); return true;
    case DType::Q4_0: dot_q45_0<false, N>(w, q8_0, n / 32, out); return true;
    case DType::Q5_0: dot_q45_0<true, N>(w, q8_0, n / 32, out); return true;
    case DType::Q4_K: dot_q45_k<false, N>(w, q8_k, n / 256, out); return true;
    case DType::Q5_K: dot_q45_k<true, N>(w, q8_k, n / 256, out); return true;
    case DType::Q6_K: dot_q6_k<N>(w, q8_k, n / 256, out); return true;
    default: return false;
  }
}

#endif

}  // namespace

bool vec_dot_rows_avx512(DType t, const uint8_t* w, const uint8_t* const* acts, int n_rows, int64_t n, float* out) {
#ifdef SERVAL_HAVE_VNNI
  switch (n_rows) {
    case 1: return dot_rows<1>(t, w, acts, n, out);
    case 2: return dot_rows<2>(t, w, acts, n, out);
    case 3: return dot_rows<3>(t, w, acts, n, out);
    case 4: return dot_rows<4>(t, w, acts, n, out);
    default: return false;
  }
#else
  return false;
#endif
}

}  // namespace serval::cpu
