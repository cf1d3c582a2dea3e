// The attention tile kernel (attention_tile_impl.h) with AVX-512 vectors: 16 rows per vector, masks
// in mask registers (masked FMAs for masked keys), F16 keys and values converted with VCVTPH2PS.
// Compiled with SERVAL_AVX512_FLAGS (AVX2, FMA, F16C, AVX-512 F/BW/VL/DQ/VNNI) and -ffp-contract=off
// (CMakeLists.txt); only called when active_isa() >= Isa::Avx512.
#include "kernels/cpu/attention_tile.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>

// GCC 12 reports the deliberately undefined operand of its AVX-512 intrinsics (_mm512_undefined_ps)
// as maybe uninitialized once they are inlined; nothing here is.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "kernels/cpu/attention_dense_impl.h"
#include "kernels/cpu/attention_tile_impl.h"

namespace serval::cpu::attn {
namespace {

struct V512 {
  using T = __m512;
  using M = __mmask16;
  static constexpr int W = kLanesAvx512;
  static constexpr int kRowVectors = 2;  // row vectors per micro-kernel call (2 x 8 accumulators)
  static constexpr int kPvRows = 4, kPvDims = 4;  // pv_single: 16 accumulators, 4 values, a weight
  static constexpr int kQkRows = 8;                // qk_single: 8 rows x 1 vector of keys
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }  // a > b ? a : b
  static T min(T a, T b) { return _mm512_min_ps(a, b); }  // a < b ? a : b
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static M le(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static M lt(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M mand(M a, M b) { return M(a & b); }
  static T select(M m, T t, T f) { return _mm512_mask_blend_ps(m, f, t); }
  static T mask_fma(M m, T a, T b, T c) { return _mm512_mask3_fmadd_ps(a, b, c, m); }
  static T pow2i(T n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  // Lane j of the result holds lane j + k of x (j < k; k = 8, 4, 2, 1); the others are unspecified.
  static T fold(T x, int k) {
    switch (k) {
      case 8: return _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(3, 2, 3, 2));
      case 4: return _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 1, 1, 1));
      case 2: return _mm512_permute_ps(x, _MM_SHUFFLE(3, 2, 3, 2));
      default: return _mm512_permute_ps(x, _MM_SHUFFLE(1, 1, 1, 1));
    }
  }
  static float lane0(T x) { return _mm512_cvtss_f32(x); }
  // k[i] = dimension d0 + i of the 16 rows of a key tile (i < 16): a 16 x 16 block transposed in
  // registers (pairs of floats, then pairs of pairs, then 128-bit blocks). load(j, d0): dimensions
  // d0 .. d0 + 15 of row j.
  template <class Load>
  static void transpose16(Load load, int d0, __m512* k) {
    __m512 r[16], t[16];
    for (int j = 0; j < 16; ++j) r[j] = load(j, d0);
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // s[g][c]: 128-bit block q holds dimension 4q + c of rows 4g .. 4g + 3.
    __m512 s[4][4];
    for (int g = 0; g < 4; ++g) {
      const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
      const __m512d c = _mm512_castps_pd(t[4 * g + 2]), e = _mm512_castps_pd(t[4 * g + 3]);
      s[g][0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      s[g][1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      s[g][2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
      s[g][3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 lo01 = _mm512_shuffle_f32x4(s[0][c], s[1][c], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 hi01 = _mm512_shuffle_f32x4(s[0][c], s[1][c], _MM_SHUFFLE(3, 2, 3, 2));
      const __m512 lo23 = _mm512_shuffle_f32x4(s[2][c], s[3][c], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 hi23 = _mm512_shuffle_f32x4(s[2][c], s[3][c], _MM_SHUFFLE(3, 2, 3, 2));
      k[c] = _mm512_shuffle_f32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
      k[c + 4] = _mm512_shuffle_f32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
      k[c + 8] = _mm512_shuffle_f32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
      k[c + 12] = _mm512_shuffle_f32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
    }
  }
  // Single-query scores take the transposed keys from registers (scores_rows_in_registers), 16
  // dimensions at a time: key_block(rows, d0, k) as transpose16, F16 rows converted as they are loaded.
  static constexpr bool kKeysInRegisters = true;
  static void key_block(const float* const* rows, int d0, T* k) {
    transpose16([&](int j, int d) { return _mm512_loadu_ps(rows[j] + d); }, d0, k);
  }
  static void key_block(const uint16_t* const* rows, int d0, T* k) {
    transpose16([&](int j, int d) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + d))); },
                d0, k);
  }
  // out[d * 16 + j] = rows[j][d] for the 16 rows of a key tile and d < D (D a multiple of 16).
  template <class Row>
  static void transpose_keys(const Row* const* rows, int D, float* out) {
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 k[16];
      key_block(rows, d0, k);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + int64_t(d0 + i) * 16, k[i]);
    }
  }
  static T f16_round(T x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }  // into L2
  static void cvt_f16_row(const uint16_t* src, float* dst, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    if (i < n) {
      const __mmask16 m = __mmask16((1u << (n - i)) - 1);
      _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
    }
  }
  // E4M3's bits (s eeee mmm) placed as an F16's (s 0eeee mmm0000000) are the value times 2^-8, normal
  // and subnormal alike; NaN codes (eeee mmm all ones) get an F16 NaN.
  static __m512 fp8_times(__m128i codes, __m512 mul) {
    const __m256i b = _mm256_cvtepu8_epi16(codes);
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(mag, 7));
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7E00)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), mul);
  }
  static void cvt_fp8_row(const uint8_t* src, float* dst, int n, float scale) {
    const __m512 mul = _mm512_set1_ps(256.0f * scale);
    int i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, fp8_times(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)), mul));
    if (i < n) {
      const __mmask16 m = __mmask16((1u << (n - i)) - 1);
      _mm512_mask_storeu_ps(dst + i, m, fp8_times(_mm_maskz_loadu_epi8(m, src + i), mul));
    }
  }
};

}  // namespace

void dense_head_avx512(const DenseArgs& a) { dense_head_any(a); }
void tile_avx512(const TileArgs& a) { run_tile<V512>(a); }
void fp8_row_avx512(const uint8_t* src, float* dst, int n, float scale) { V512::cvt_fp8_row(src, dst, n, scale); }

}  // namespace serval::cpu::attn

#else
#include <cstdlib>
namespace serval::cpu::attn {
void tile_avx512(const TileArgs&) { std::abort(); }  // not built for this target; never dispatched
void dense_head_avx512(const DenseArgs&) { std::abort(); }
void fp8_row_avx512(const uint8_t*, float*, int, float) { std::abort(); }
}  // namespace serval::cpu::attn
#endif
