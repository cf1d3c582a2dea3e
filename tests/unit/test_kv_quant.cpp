// Quantized KV cache types: FP8 E4M3FN conversions (exhaustive), Q8_0 / FP8 / BF16 rows written by
// KvCache and read back by KvLayerView::load, per-token quantization (the bytes of a token do not
// depend on its neighbours), the --cache-type names and the capacity they give.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "base/error.h"
#include "engine/capacity.h"
#include "model/model.h"
#include "tensor/dequant.h"
#include "random_blocks.h"
#include "test_support.h"

namespace serval {
namespace {

TEST(Fp8E4m3, DecodesTheFormat) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_f32(0x80)));
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);                     // exponent 7 = bias
  EXPECT_EQ(fp8_e4m3_to_f32(0x7E), 448.0f);                   // the largest
  EXPECT_EQ(fp8_e4m3_to_f32(0xFE), -448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));     // the smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), std::ldexp(1.0f, -6));     // the smallest normal
  EXPECT_EQ(fp8_e4m3_to_f32(0x3F), 1.875f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xFF)));
  int nans = 0;
  for (int c = 0; c < 256; ++c) nans += std::isnan(fp8_e4m3_to_f32(uint8_t(c)));
  EXPECT_EQ(nans, 2) << "no infinities, two NaNs";
}

// Every code but NaN survives decode -> encode; values are strictly increasing over 0x00..0x7E.
TEST(Fp8E4m3, RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float x = fp8_e4m3_to_f32(uint8_t(c));
    if (std::isnan(x)) continue;
    EXPECT_EQ(f32_to_fp8_e4m3(x), c) << "code " << c;
    if (c > 0 && c <= 0x7E) {
      EXPECT_GT(x, fp8_e4m3_to_f32(uint8_t(c - 1)));
    }
    EXPECT_EQ(fp8_e4m3_table()[c], x);
  }
}

// Midpoints between neighbours go to the even code; just off a midpoint goes to the nearer one.
TEST(Fp8E4m3, RoundsToNearestEven) {
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = fp8_e4m3_to_f32(uint8_t(c)), hi = fp8_e4m3_to_f32(uint8_t(c + 1));
    const float mid = (lo + hi) / 2;  // exact: neighbours differ in the last of few bits
    const int even = c % 2 == 0 ? c : c + 1;
    EXPECT_EQ(f32_to_fp8_e4m3(mid), even) << "between " << lo << " and " << hi;
    EXPECT_EQ(f32_to_fp8_e4m3(-mid), even | 0x80);
    EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(mid, 1000.0f)), c + 1);
  }
}

TEST(Fp8E4m3, SaturatesAndKeepsNan) {
  for (float x : {448.0f, 449.0f, 464.0f, 480.0f, 1e6f, INFINITY}) {
    EXPECT_EQ(f32_to_fp8_e4m3(x), 0x7E) << x;
    EXPECT_EQ(f32_to_fp8_e4m3(-x), 0xFE) << x;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(NAN) & 0x7F, 0x7F);
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(1.0f, -11)), 0x00) << "below half the smallest subnormal";
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(1.0f, -10)), 0x00) << "half the smallest subnormal: to even (0)";
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(3.0f, -11)), 0x01);
}

// Slots 0 .. n - 1: a sequence written in order.
std::vector<int32_t> first_slots(int32_t n) {
  std::vector<int32_t> slots(static_cast<size_t>(n));
  std::iota(slots.begin(), slots.end(), 0);
  return slots;
}

ModelConfig toy_config(int64_t n_kv_heads, int64_t d_head) {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = n_kv_heads;
  c.n_head_kv = n_kv_heads;
  c.d_head = d_head;
  c.n_embd = n_kv_heads * d_head;
  return c;
}

// A row written by KvCache and read by the view, against the format computed here from the math.
TEST(KvCacheTypes, Q8_0RowsRoundTripPerBlock) {
  const ModelConfig c = toy_config(2, 64);
  KvCache kv(c, 4, DType::Q8_0);
  EXPECT_EQ(kv.bytes_per_slot_per_layer(), 2u * 128 / 32 * 34);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0, 2);
  std::vector<float> k(128), v(128), back(64);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  k[5] = 0;  // a zero
  for (int i = 64; i < 96; ++i) v[i] = 0;  // an all-zero block
  kv.write(1, 3, k.data(), v.data());
  const KvLayerView view = kv.view(1);
  for (const auto& [pool, src] : {std::pair{view.k, &k}, std::pair{view.v, &v}})
    for (int h = 0; h < 2; ++h) {
      view.load(pool, 3, h * 64, 64, back.data());
      for (int b = 0; b < 2; ++b) {
        const float* x = src->data() + h * 64 + b * 32;
        float amax = 0;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(x[i]));
        // ggml's block: q = round(x / d) with d = amax / 127, stored with d rounded to F16.
        const float d = amax / 127, id = d != 0 ? 1 / d : 0, d16 = fp16_to_f32(f32_to_fp16(d));
        for (int i = 0; i < 32; ++i) {
          const float got = back[size_t(b * 32 + i)];
          EXPECT_EQ(got, d16 * std::round(x[i] * id)) << "head " << h << " element " << b * 32 + i;
          EXPECT_LE(std::abs(got - x[i]), 0.5f * d + 127 * std::abs(d16 - d) + 1e-6f);
        }
      }
    }
}

TEST(KvCacheTypes, Fp8RowsUseTheHeadScale) {
  const ModelConfig c = toy_config(2, 32);
  KvCache kv(c, 2, DType::F8_E4M3);
  EXPECT_EQ(kv.bytes_per_slot_per_layer(), 2u * 64);
  kv.set_head_scale(0, 1, 0.25f);
  std::vector<float> k(64), v(64), back(32);
  for (int i = 0; i < 64; ++i) k[size_t(i)] = float(i) * 0.37f - 11, v[size_t(i)] = 200.0f - float(i) * 9;
  kv.write(0, 1, k.data(), v.data());
  const KvLayerView view = kv.view(0);
  EXPECT_TRUE(view.v_rotated);
  std::vector<float> v_stored = v;  // V is stored rotated per head (KvLayerView::v_rotated)
  for (int h = 0; h < 2; ++h) hadamard_rotate(v_stored.data() + h * 32, 32);
  for (const auto& [pool, src] : {std::pair{view.k, &k}, std::pair{view.v, &v_stored}})
    for (int h = 0; h < 2; ++h) {
      const float s = h == 1 ? 0.25f : 1.0f;
      view.load(pool, 1, h * 32, 32, back.data());
      for (int i = 0; i < 32; ++i)
        EXPECT_EQ(back[size_t(i)], fp8_e4m3_to_f32(f32_to_fp8_e4m3((*src)[size_t(h * 32 + i)] / s)) * s)
            << "head " << h << " element " << i;
    }
}

TEST(Hadamard, IsOrthonormalAndItsOwnInverse) {
  for (int64_t n : {1, 2, 32, 64, 128, 256}) {
    const auto x = test::random_floats(size_t(n), uint32_t(n));
    std::vector<float> y = x;
    hadamard_rotate(y.data(), n);
    double nx = 0, ny = 0;
    for (int64_t i = 0; i < n; ++i) nx += double(x[size_t(i)]) * x[size_t(i)], ny += double(y[size_t(i)]) * y[size_t(i)];
    EXPECT_NEAR(ny, nx, 1e-5 * nx) << n;
    hadamard_rotate(y.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(y[size_t(i)], x[size_t(i)], 1e-5f) << n << " element " << i;
  }
  std::vector<float> e(64, 0.0f);
  e[0] = 1;
  hadamard_rotate(e.data(), 64);
  for (float x : e) EXPECT_FLOAT_EQ(x, 0.125f);  // the first basis vector spreads evenly
  e.assign(4, 0.0f), e[1] = 1;
  hadamard_rotate(e.data(), 4);
  EXPECT_EQ(e, (std::vector<float>{0.5f, -0.5f, 0.5f, -0.5f}));
}

// FP8 stores V rotated; attention (both the reference and the kernels) rotates its output back, so it
// approximates the F32 cache's attention to E4M3's precision, and reading the rotated V as if it were
// not (the view's flag cleared) gives a different answer.
TEST(KvCacheTypes, Fp8AttentionUndoesTheVRotation) {
  const int64_t d = 64, n_pos = 24;
  const ModelConfig c = toy_config(2, d);
  KvCache f32(c, n_pos, DType::F32), fp8(c, n_pos, DType::F8_E4M3);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> k(2 * d), v(2 * d);
  for (int32_t p = 0; p < n_pos; ++p) {
    for (auto& x : k) x = nd(rng);
    for (size_t i = 0; i < v.size(); ++i) v[i] = nd(rng) * (i % 8 == 0 ? 4.0f : 0.01f);  // small values and a few large
    f32.write(0, p, k.data(), v.data());
    fp8.write(0, p, k.data(), v.data());
  }
  const auto q = test::random_floats(size_t(2 * d), 9);
  const std::vector<int32_t> slots = first_slots(int32_t(n_pos));
  const AttentionShape s{2, 2, int(d), 1.0f / 8};
  std::vector<float> want(2 * d), got(2 * d), ref_got(2 * d), unrotated(2 * d);
  cpu::attention(s, q.data(), f32.view(0), slots, want.data());
  cpu::attention(s, q.data(), fp8.view(0), slots, got.data());
  ref::attention(s, q.data(), fp8.view(0), slots, ref_got.data());
  KvLayerView wrong = fp8.view(0);
  wrong.v_rotated = false;
  cpu::attention(s, q.data(), wrong, slots, unrotated.data());
  double err = 0, err_unrotated = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], ref_got[i], 1e-3f + 1e-3f * std::fabs(ref_got[i])) << i;
    err = std::max(err, double(std::fabs(got[i] - want[i])));
    err_unrotated = std::max(err_unrotated, double(std::fabs(unrotated[i] - want[i])));
  }
  // E4M3 keeps 4 significant bits: K's rounding moves the weights, V's the values (the large ones
  // are about 4, the output's elements about 1).
  EXPECT_LT(err, 0.25) << "FP8 attention against F32";
  EXPECT_GT(err_unrotated, 4 * err) << "the rotation must be undone";
}

// Model::KCentring subtracts one fixed vector from every key a quantized cache stores: each query's
// scores all move by the same amount, which softmax ignores. Checked on the kernel and the reference
// with Qwen-like outliers (keys and queries with a bias of 100-150 on two channels of each head, scores
// in the hundreds): the shifted cache gives the same output to F32 rounding.
TEST(KvCacheTypes, ShiftedKeysLeaveAttentionUnchanged) {
  const int64_t d = 64, n_pos = 40;
  const ModelConfig c = toy_config(2, d);
  KvCache plain(c, n_pos, DType::F32), shifted(c, n_pos, DType::F32);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> centre(2 * d), k(2 * d), ks(2 * d), v(2 * d);
  for (auto& x : centre) x = nd(rng);
  centre[31] = 135, centre[63] = 72.5, centre[64 + 62] = 91.5, centre[64 + 63] = -158;
  for (int32_t p = 0; p < n_pos; ++p) {
    for (size_t i = 0; i < k.size(); ++i) k[i] = centre[i] + 2 * nd(rng), ks[i] = k[i] - centre[i];
    for (auto& x : v) x = nd(rng);
    plain.write(0, p, k.data(), v.data());
    shifted.write(0, p, ks.data(), v.data());
  }
  auto q = test::random_floats(size_t(4 * d), 11);
  for (int64_t h = 0; h < 4; ++h) q[size_t(h * d + 31)] += 40, q[size_t(h * d + 63)] -= 30;
  const std::vector<int32_t> slots = first_slots(int32_t(n_pos));
  const AttentionShape s{4, 2, int(d), 1.0f / 8};
  std::vector<float> want(4 * d), got(4 * d), ref_want(4 * d), ref_got(4 * d);
  cpu::attention(s, q.data(), plain.view(0), slots, want.data());
  cpu::attention(s, q.data(), shifted.view(0), slots, got.data());
  ref::attention(s, q.data(), plain.view(0), slots, ref_want.data());
  ref::attention(s, q.data(), shifted.view(0), slots, ref_got.data());
  double spread = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 2e-4f) << i;
    EXPECT_NEAR(ref_got[i], ref_want[i], 2e-4f) << i;
    // Query head i / d reads KV head (i / d) / 2; `v` holds the last position's values.
    spread = std::max(spread, double(std::fabs(want[i] - v[(i / d) / 2 * d + i % d])));
  }
  EXPECT_GT(spread, 0.1) << "the weights must not be one-hot (else any shift would pass)";
}

// A token's bytes depend on that token's K and V only: written alone or among others, in any slot.
TEST(KvCacheTypes, TokensAreQuantizedAlone) {
  const ModelConfig c = toy_config(2, 64);
  for (DType t : {DType::Q8_0, DType::F8_E4M3, DType::BF16}) {
    KvCache a(c, 8, t), b(c, 8, t);
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0, 1);
    std::vector<float> rows(8 * 128);
    for (auto& x : rows) x = nd(rng) * float(1 + (&x - rows.data()) / 128);  // different magnitudes
    for (int s = 0; s < 8; ++s) a.write(0, s, rows.data() + s * 128, rows.data() + s * 128);
    b.write(0, 5, rows.data() + 2 * 128, rows.data() + 2 * 128);
    const size_t row = a.bytes_per_slot_per_layer() / 2;
    EXPECT_EQ(std::memcmp(a.view(0).k + 2 * row, b.view(0).k + 5 * row, row), 0) << dtype_info(t).name;
  }
}

TEST(KvCacheTypes, NamesAndErrors) {
  EXPECT_EQ(parse_kv_cache_type("f16"), DType::F16);
  EXPECT_EQ(parse_kv_cache_type("f32"), DType::F32);
  EXPECT_EQ(parse_kv_cache_type("bf16"), DType::BF16);
  EXPECT_EQ(parse_kv_cache_type("q8_0"), DType::Q8_0);
  EXPECT_EQ(parse_kv_cache_type("fp8_e4m3"), DType::F8_E4M3);
  EXPECT_EQ(parse_kv_cache_type("fp8"), DType::F8_E4M3);
  EXPECT_EQ(kv_cache_type_name(DType::F8_E4M3), "fp8_e4m3");
  EXPECT_NE(test::error_message([] { parse_kv_cache_type("q4_0"); }).find("f32, f16, bf16, q8_0, fp8_e4m3"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(kv_dtype_bytes("q8_0") / kv_dtype_bytes("f16"), 34.0 / 64);
  EXPECT_DOUBLE_EQ(kv_dtype_bytes("fp8_e4m3"), 1.0);
  EXPECT_FALSE(dtype_info(1000u).has_value()) << "FP8 is not a GGUF type";
  // Q8_0 blocks must not straddle heads.
  EXPECT_NE(test::error_message([] { KvCache(toy_config(4, 8), 4, DType::Q8_0); }).find("multiple of 32"),
            std::string::npos);
}

}  // namespace
}  // namespace serval
