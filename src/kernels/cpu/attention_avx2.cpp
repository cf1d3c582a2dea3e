// The attention tile kernel (attention_tile_impl.h) with AVX2 vectors: 8 rows per vector, masks as
// all-ones lanes (blends for masked keys), F16 keys and values converted with F16C.
// Compiled with SERVAL_AVX2_FLAGS (-mavx2 -mfma -mf16c) and -ffp-contract=off (CMakeLists.txt); only
// called when active_isa() >= Isa::Avx2.
#include "kernels/cpu/attention_tile.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#include "tensor/dequant.h"

#include "kernels/cpu/attention_dense_impl.h"
#include "kernels/cpu/attention_tile_impl.h"

namespace serval::cpu::attn {
namespace {

struct V256 {
  using T = __m256;
  using M = __m256;  // all-ones lanes where true
  static constexpr int W = kLanesAvx2;
  static constexpr int kRowVectors = 1;  // 16 registers: one row vector x 8 accumulators
  static constexpr int kPvRows = 2, kPvDims = 4;  // pv_single: 8 accumulators, 4 values, a weight
  static constexpr int kQkRows = 4;                // qk_single: 4 rows x 2 vectors of keys
  static constexpr bool kKeysInRegisters = false;  // single-query scores read transpose_keys' rows
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }  // a > b ? a : b
  static T min(T a, T b) { return _mm256_min_ps(a, b); }  // a < b ? a : b
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static M le(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  static M lt(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M mand(M a, M b) { return _mm256_and_ps(a, b); }
  static T select(M m, T t, T f) { return _mm256_blendv_ps(f, t, m); }
  static T mask_fma(M m, T a, T b, T c) { return _mm256_blendv_ps(c, _mm256_fmadd_ps(a, b, c), m); }
  static T pow2i(T n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  // Lane j of the result holds lane j + k of x (j < k; k = 4, 2, 1); the others are unspecified.
  static T fold(T x, int k) {
    switch (k) {
      case 4: return _mm256_permute2f128_ps(x, x, 0x11);
      case 2: return _mm256_permute_ps(x, _MM_SHUFFLE(3, 2, 3, 2));
      default: return _mm256_permute_ps(x, _MM_SHUFFLE(1, 1, 1, 1));
    }
  }
  static float lane0(T x) { return _mm256_cvtss_f32(x); }
  // out[d * 16 + j] = rows[j][d] for the 16 rows of a key tile and d < D (D a multiple of 8): 8 x 8
  // blocks transposed in registers.
  // load(j, d0): dimensions d0 .. d0 + 7 of row j.
  template <class Load>
  static void transpose_keys(Load load, int D, float* out) {
    for (int j0 = 0; j0 < 16; j0 += 8)
      for (int d0 = 0; d0 < D; d0 += 8) {
        __m256 r[8], t[8];
        for (int j = 0; j < 8; ++j) r[j] = load(j0 + j, d0);
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // s[g][c]: 128-bit half k holds dimension 4k + c of rows 4g .. 4g + 3.
        __m256 s[2][4];
        for (int g = 0; g < 2; ++g) {
          const __m256d a = _mm256_castps_pd(t[4 * g]), b = _mm256_castps_pd(t[4 * g + 1]);
          const __m256d c = _mm256_castps_pd(t[4 * g + 2]), e = _mm256_castps_pd(t[4 * g + 3]);
          s[g][0] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
          s[g][1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
          s[g][2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, e));
          s[g][3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, e));
        }
        for (int c = 0; c < 4; ++c) {
          _mm256_storeu_ps(out + int64_t(d0 + c) * 16 + j0, _mm256_permute2f128_ps(s[0][c], s[1][c], 0x20));
          _mm256_storeu_ps(out + int64_t(d0 + 4 + c) * 16 + j0, _mm256_permute2f128_ps(s[0][c], s[1][c], 0x31));
        }
      }
  }
  static void transpose_keys(const float* const* rows, int D, float* out) {
    transpose_keys([&](int j, int d0) { return _mm256_loadu_ps(rows[j] + d0); }, D, out);
  }
  static void transpose_keys(const uint16_t* const* rows, int D, float* out) {  // F16 rows, converted
    transpose_keys(
        [&](int j, int d0) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + d0))); },
        D, out);
  }
  static T f16_round(T x) { return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }  // into L2
  static void cvt_f16_row(const uint16_t* src, float* dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
  }
  // E4M3's bits (s eeee mmm) placed as an F16's (s 0eeee mmm0000000) are the value times 2^-8, normal
  // and subnormal alike; NaN codes (eeee mmm all ones) get an F16 NaN.
  static void cvt_fp8_row(const uint8_t* src, float* dst, int n, float scale) {
    const __m256 mul = _mm256_set1_ps(256.0f * scale);
    const __m128i sign = _mm_set1_epi16(0x80), mag_mask = _mm_set1_epi16(0x7F), nan = _mm_set1_epi16(0x7E00);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      const __m128i mag = _mm_and_si128(b, mag_mask);
      __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign), 8), _mm_slli_epi16(mag, 7));
      h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(mag, mag_mask), nan));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), mul));
    }
    const float* t = fp8_e4m3_table();
    for (; i < n; ++i) dst[i] = t[src[i]] * scale;
  }
};

}  // namespace

void dense_head_avx2(const DenseArgs& a) { dense_head_any(a); }
void tile_avx2(const TileArgs& a) { run_tile<V256>(a); }
void fp8_row_avx2(const uint8_t* src, float* dst, int n, float scale) { V256::cvt_fp8_row(src, dst, n, scale); }

}  // namespace serval::cpu::attn

#else
#include <cstdlib>
namespace serval::cpu::attn {
void tile_avx2(const TileArgs&) { std::abort(); }  // not built for this target; never dispatched
void dense_head_avx2(const DenseArgs&) { std::abort(); }
void fp8_row_avx2(const uint8_t*, float*, int, float) { std::abort(); }
}  // namespace serval::cpu::attn
#endif
