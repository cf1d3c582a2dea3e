// cpu::glu (SwiGLU / GeGLU activations) at every ISA level this CPU runs, against the exact formula
// evaluated in double precision.
//
// The bound (derived in src/kernels/cpu/glu_avx2.cpp): with u = 2^-24, z = x (SiLU) or
// z = 2 sqrt(2/pi) (x + 0.044715 x^3) (GELU) and s = sigmoid(z),
//   |got - exact| <= (10 + 4 |z| (1 - s) [GELU only]) u |exact| + 2^-147 (1 + |up|)
// The first term: ~7.75u of roundings and polynomial error in the SIMD levels (about 1u at the scalar
// level, which works in double), rounded up to 10u; GELU's argument is computed in float from rounded
// constants (<= 4u |z| relative), and act moves by (1 - s) times that. The second term covers results
// (and x e^z) in the subnormal range, where relative error is meaningless.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "kernels/isa.h"
#include "kernels/ops.h"

namespace serval {
namespace {

using cpu::GluKind;
using cpu::Isa;

constexpr double kU = 1.0 / (1 << 24);
constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// The argument z of act(x) = x * sigmoid(z): 0.5 (1 + tanh(t)) = sigmoid(2t).
double exact_z(GluKind k, double x) {
  if (k == GluKind::Silu) return x;
  const double c = std::sqrt(2.0 / M_PI);
  return 2 * c * (x + 0.044715 * x * x * x);
}

// act(x) for finite x, in double: x / (1 + e^-z) never cancels (e^-z overflowing gives the -0 / +0
// limit).
double exact_act(GluKind k, double x) { return x / (1 + std::exp(-exact_z(k, x))); }

double bound(GluKind k, double x, double up, double exact) {
  double rel = 10;
  if (k == GluKind::GeluTanh) {
    const double z = exact_z(k, x);
    rel += 4 * std::abs(z) / (1 + std::exp(z));  // 4 |z| (1 - sigmoid(z))
  }
  return rel * kU * std::abs(exact) + std::ldexp(1.0, -147) * (1 + std::abs(up));
}

class GluLevel : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (int(GetParam()) > int(cpu::detected_isa()))
      GTEST_SKIP() << "ISA level " << cpu::isa_name(GetParam()) << " cannot run on this CPU (it runs at most "
                   << cpu::isa_name(cpu::detected_isa()) << ")";
    cpu::force_isa(GetParam());
  }
  void TearDown() override { cpu::force_isa(saved_); }
  const Isa saved_ = cpu::active_isa();
};

// Finite gates over a wide range: a dense sweep of [-120, 120] (where act leaves the float range on
// the negative side), magnitudes 1e-45 .. 3.4e38 of both signs, and the float extremes.
std::vector<float> finite_gates() {
  std::vector<float> g;
  for (double x = -120; x <= 120; x += 0.0137) g.push_back(float(x));
  for (double e = -45; e <= 38.5; e += 0.05) {
    const double m = std::min(std::pow(10.0, e), double(std::numeric_limits<float>::max()));
    g.push_back(float(m));
    g.push_back(-float(m));
  }
  for (float v : {std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::max(), 1.0f, 0.5f, 88.0f, 104.0f})
    g.push_back(v), g.push_back(-v);
  return g;
}

TEST_P(GluLevel, WithinBoundOfExactFormula) {
  const std::vector<float> gate = finite_gates();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> up(gate.size());
  for (size_t i = 0; i < up.size(); ++i) up[i] = i % 5 == 0 ? 1.0f : dist(rng);
  for (GluKind k : {GluKind::Silu, GluKind::GeluTanh}) {
    std::vector<float> out(gate.size());
    cpu::glu(k, gate.data(), up.data(), out.data(), int64_t(gate.size()));
    double worst = 0;  // in units of u, over results in the normal range
    int failures = 0;
    for (size_t i = 0; i < gate.size(); ++i) {
      const double exact = exact_act(k, gate[i]) * double(up[i]);
      // Past the float range the right result is an infinity of the exact value's sign.
      if (std::isinf(out[i]) && std::abs(exact) > std::numeric_limits<float>::max() &&
          std::signbit(out[i]) == std::signbit(exact))
        continue;
      const double err = std::abs(double(out[i]) - exact);
      if (!(err <= bound(k, gate[i], up[i], exact)) && ++failures <= 10)
        ADD_FAILURE() << (k == GluKind::Silu ? "silu" : "gelu") << " gate " << gate[i] << " up " << up[i] << ": got "
                      << out[i] << ", exact " << exact << ", error " << err / (kU * std::abs(exact)) << " u";
      if (std::abs(exact) >= std::numeric_limits<float>::min()) worst = std::max(worst, err / (kU * std::abs(exact)));
    }
    EXPECT_EQ(failures, 0);
    std::printf("%-7s %s: worst relative error %.2f u over %zu gates\n", cpu::isa_name(GetParam()),
                k == GluKind::Silu ? "silu" : "gelu", worst, gate.size());
  }
}

// gpt-oss's clamped SwiGLU against its formula in double, with the clamps on both sides of the limit:
// SiLU's bound, plus the two roundings of the argument and of (u + 1) / alpha (each u, moving the
// result by at most (1 + |alpha g|) u and u of it).
TEST_P(GluLevel, OpenAiSwigluWithinBoundOfFormula) {
  const float alpha = 1.702f, limit = 7.0f;
  std::vector<float> gate, up;
  for (double x = -12; x <= 12; x += 0.0173)
    for (float u : {-9.0f, -7.0f, -1.0f, -0.25f, 0.0f, 0.5f, 6.9f, 8.0f}) gate.push_back(float(x)), up.push_back(u);
  std::vector<float> out(gate.size());
  cpu::glu_oai(gate.data(), up.data(), out.data(), int64_t(gate.size()), alpha, limit);
  int failures = 0;
  for (size_t i = 0; i < gate.size(); ++i) {
    const double g = std::min(double(gate[i]), double(limit)), u = std::clamp(double(up[i]), -double(limit), double(limit));
    const double exact = (u + 1) * g / (1 + std::exp(-double(alpha) * g));
    const double tol = (14 + std::abs(double(alpha) * g)) * kU * std::abs(exact) + 1e-30;
    if (!(std::abs(double(out[i]) - exact) <= tol) && ++failures <= 10)
      ADD_FAILURE() << "gate " << gate[i] << " up " << up[i] << ": got " << out[i] << ", exact " << exact;
  }
  EXPECT_EQ(failures, 0);
  // In place, as the expert FFN calls it.
  std::vector<float> in_place = gate;
  cpu::glu_oai(in_place.data(), up.data(), in_place.data(), int64_t(gate.size()), alpha, limit);
  EXPECT_EQ(in_place, out);
}

// Signed zeros, infinities and NaN: act(+-0) = +-0, act(+inf) = +inf, act(-inf) = -0 (the limit),
// act(NaN) = NaN; the product with up is IEEE's (so inf * 0 is NaN).
TEST_P(GluLevel, SpecialValues) {
  struct Case {
    float gate, up, want;
  };
  const Case cases[] = {{0.0f, 1.5f, 0.0f},  {-0.0f, 1.5f, -0.0f}, {0.0f, -1.5f, -0.0f}, {kInf, 2.0f, kInf},
                        {kInf, -2.0f, -kInf}, {-kInf, 2.0f, -0.0f}, {-kInf, -2.0f, 0.0f}, {kNaN, 1.0f, kNaN},
                        {1.0f, kNaN, kNaN},  {kInf, 0.0f, kNaN},   {2.0f, kInf, kInf},   {-kInf, kInf, kNaN}};
  for (GluKind k : {GluKind::Silu, GluKind::GeluTanh}) {
    // Each case alone (the tail path) and all together followed by a full vector's worth (the body).
    std::vector<float> g, u;
    for (const Case& c : cases) g.push_back(c.gate), u.push_back(c.up);
    for (int i = 0; i < 32; ++i) g.push_back(cases[i % 12].gate), u.push_back(cases[i % 12].up);
    std::vector<float> all(g.size());
    cpu::glu(k, g.data(), u.data(), all.data(), int64_t(g.size()));
    for (size_t i = 0; i < g.size(); ++i) {
      const Case& c = cases[i < 12 ? i : (i - 12) % 12];
      float one;
      cpu::glu(k, &g[i], &u[i], &one, 1);
      for (float got : {one, all[i]}) {
        SCOPED_TRACE(::testing::Message() << (k == GluKind::Silu ? "silu" : "gelu") << " gate " << c.gate << " up "
                                          << c.up << " at " << i);
        if (std::isnan(c.want)) {
          EXPECT_TRUE(std::isnan(got)) << got;
        } else {
          EXPECT_EQ(got, c.want);
          EXPECT_EQ(std::signbit(got), std::signbit(c.want)) << got;
        }
      }
    }
  }
}

// Odd lengths (every tail size), in place (out = gate, out = up): a lane's result is the same
// whatever n and its position, and the same as out of place.
TEST_P(GluLevel, TailsAndInPlace) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-12.0f, 12.0f);
  for (int64_t n : {1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1001}) {
    std::vector<float> gate(n), up(n);
    for (auto& v : gate) v = dist(rng);
    for (auto& v : up) v = dist(rng) / 4;
    for (GluKind k : {GluKind::Silu, GluKind::GeluTanh}) {
      std::vector<float> out(n + 1, 42.0f);  // one past the end must stay untouched
      cpu::glu(k, gate.data(), up.data(), out.data(), n);
      EXPECT_EQ(out[n], 42.0f) << "wrote past n = " << n;
      std::vector<float> in_gate = gate, in_up = up;
      cpu::glu(k, in_gate.data(), up.data(), in_gate.data(), n);
      cpu::glu(k, gate.data(), in_up.data(), in_up.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        float alone;
        cpu::glu(k, &gate[i], &up[i], &alone, 1);
        ASSERT_EQ(out[i], alone) << "n " << n << " i " << i;
        ASSERT_EQ(in_gate[i], out[i]) << "n " << n << " i " << i;
        ASSERT_EQ(in_up[i], out[i]) << "n " << n << " i " << i;
        // and the value itself is right (the bound of the first test)
        const double exact = exact_act(k, gate[i]) * double(up[i]);
        ASSERT_LE(std::abs(double(out[i]) - exact), bound(k, gate[i], up[i], exact)) << "n " << n << " i " << i;
      }
    }
  }
}

// GELU's erf form (BERT): at the scalar level std::erf (a float rounding of the exact value); the SIMD
// levels use Abramowitz & Stegun 7.1.26, |erf error| <= 1.5e-7, so |got - exact| <= 0.5 |x| 1.5e-7
// plus a few float roundings of the result (8u |exact| + 2^-140 here).
TEST_P(GluLevel, GeluErfWithinBound) {
  std::vector<float> x;
  for (double v = -12; v <= 12; v += 0.00731) x.push_back(float(v));
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 30.0f, -30.0f, 1e6f, -1e6f}) x.push_back(v);
  std::vector<float> got = x;
  cpu::gelu_erf_inplace(got.data(), int64_t(got.size()));
  const bool scalar = GetParam() == Isa::Scalar;
  int failures = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double exact = 0.5 * double(x[i]) * std::erfc(-double(x[i]) / std::sqrt(2.0));
    const double bound = (scalar ? 0.0 : 0.5 * std::abs(double(x[i])) * 1.5e-7) + 8 * kU * std::abs(exact) + 0x1p-140;
    if (!(std::abs(double(got[i]) - exact) <= bound) && ++failures <= 10)
      ADD_FAILURE() << "x " << x[i] << ": got " << got[i] << ", exact " << exact;
  }
  EXPECT_EQ(failures, 0);
  // A lane's result does not depend on the length or its position (tails are masked), and nothing
  // outside the range is written (guards on both sides).
  std::vector<float> tail(x.begin() + 2, x.begin() + 15);
  const float before = tail.front(), after = tail.back();
  cpu::gelu_erf_inplace(tail.data() + 1, int64_t(tail.size()) - 2);
  EXPECT_EQ(tail.front(), before);
  EXPECT_EQ(tail.back(), after);
  for (size_t i = 1; i + 1 < tail.size(); ++i) EXPECT_EQ(tail[i], got[i + 2]);
  // With a bias: GELU of the float sum, the same bits as adding it first (a tail of 13 lanes too).
  for (const size_t n : {x.size(), size_t(13)}) {
    std::vector<float> b(n), with(x.begin(), x.begin() + long(n)), added(n);
    for (size_t i = 0; i < n; ++i) b[i] = float(0.37 * std::sin(double(i))), added[i] = with[i] + b[i];
    cpu::gelu_erf_inplace(with.data(), int64_t(n), b.data());
    cpu::gelu_erf_inplace(added.data(), int64_t(n));
    EXPECT_EQ(with, added) << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, GluLevel, ::testing::Values(Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx),
                         [](const ::testing::TestParamInfo<Isa>& info) { return cpu::isa_name(info.param); });

}  // namespace
}  // namespace serval
