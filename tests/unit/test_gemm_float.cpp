// The F16 / BF16 GEMM (kernels/cpu/gemm_float.h): every ISA level and kernel variant this machine runs
// against a plain double-precision reference within a bound derived from the summation order, bitwise
// against the scalar level, batch invariance, and VDPBF16PS's rounding, order and flushes reproduced
// exactly by the emulating kernels. A level or variant the CPU lacks is skipped with its reason.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <unistd.h>

#include "base/cpu.h"
#include "kernels/act_quant.h"
#include "kernels/cpu/gemm_float.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "model/session.h"
#include "random_blocks.h"
#include "sampling/sampler.h"
#include "tensor/dequant.h"
#include "test_support.h"

namespace serval {
namespace {

using test::IsaGuard;

// Rows `pad` bytes apart beyond their length (a misaligned stride), the first `offset` bytes past an
// aligned address. The gaps hold 0xAB bytes, which would show in the results if a kernel read them.
struct FloatMatrix {
  std::vector<uint8_t> storage;
  WeightMatrix w;
  FloatMatrix(DType t, int64_t rows, int64_t cols, const std::vector<uint8_t>& bytes, size_t pad = 6, size_t offset = 1) {
    const size_t rb = row_bytes(t, cols), stride = rb + pad;
    storage.assign(offset + rows * stride, 0xAB);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(storage.data() + offset + r * stride, bytes.data() + r * rb, rb);
    w = WeightMatrix{t, rows, cols, storage.data() + offset, stride};
    cpu::prepare_weights(w);
  }
  FloatMatrix(DType t, int64_t rows, int64_t cols, uint32_t seed)
      : FloatMatrix(t, rows, cols, test::random_rows(t, rows, cols, seed), 6, 1) {}
};

// The activations as the kernels multiply them: rounded to the weight type's activation format.
std::vector<float> rounded_acts(DType t, const float* x, int64_t cols, int64_t n_tok) {
  std::vector<float> out(n_tok * cols);
  std::vector<uint8_t> buf(act_row_bytes(act_type_for(t), cols));
  for (int64_t i = 0; i < n_tok; ++i) {
    quantize_act_row(act_type_for(t), x + i * cols, cols, buf.data());
    dequantize_row(t, buf.data(), out.data() + i * cols, cols);
  }
  return out;
}

// The plain reference: the sums in double of the rounded weights times the rounded activations, and
// the bound on a kernel's error. Each output is two chains of at most m = kpad / 2 additions of exact
// products plus one final addition, so |error| <= gamma(m + 1) * sum |w x| (gamma(n) = n u / (1 - n u),
// u = 2^-24), plus the reference's own double rounding, plus what flushing BF16 denormals (inputs
// below 2^-126, partial sums below FLT_MIN) can change: at most 2 * FLT_MIN per step.
struct Reference {
  std::vector<double> y, bound;
  Reference(const WeightMatrix& w, const float* x, int64_t n_tok) {
    const auto xr = rounded_acts(w.type, x, w.cols, n_tok);
    std::vector<float> row(w.cols);
    const int64_t kpad = (std::max<int64_t>(w.cols, 1) + 31) / 32 * 32;
    const double u = std::ldexp(1.0, -24), m = double(kpad / 2 + 1);
    const double gamma = m * u / (1 - m * u) + double(kpad) * std::ldexp(1.0, -52);
    y.resize(n_tok * w.rows);
    bound.resize(y.size());
    for (int64_t r = 0; r < w.rows; ++r) {
      get_row(w, r, row.data());
      for (int64_t t = 0; t < n_tok; ++t) {
        double s = 0, mag = 0;
        for (int64_t k = 0; k < w.cols; ++k) {
          const double p = double(row[k]) * xr[t * w.cols + k];
          s += p, mag += std::abs(p);
        }
        y[t * w.rows + r] = s;
        bound[t * w.rows + r] = gamma * mag + 2.0 * double(kpad) * FLT_MIN;
      }
    }
  }
};

struct Shape {
  int64_t rows, cols, n_tok;
};
// Rows across the 16-row groups, cols across the 32-padding and odd (a BF16 pair half empty), token
// counts across every tile width (1, 2: decode tiles; 3, 8, 9, ...: prompt tiles and their tails).
const std::vector<Shape> kShapes = {{1, 1, 1},    {15, 31, 3},  {16, 32, 8},  {17, 33, 9},  {37, 100, 17},
                                    {100, 64, 40}, {33, 257, 2}, {5, 1000, 1}, {48, 95, 25}, {64, 128, 11}};
const std::vector<DType> kFloatTypes = {DType::F16, DType::BF16};
const std::vector<cpu::Isa> kLevels = {cpu::Isa::Scalar, cpu::Isa::Avx2, cpu::Isa::Avx512, cpu::Isa::Amx};

std::string type_name(DType t) { return std::string(dtype_info(t).name); }

// ---- every level through cpu::matmul ------------------------------------------------------------

class FloatGemmLevel : public ::testing::TestWithParam<std::tuple<DType, cpu::Isa>> {
 protected:
  void SetUp() override {
    const cpu::Isa level = std::get<1>(GetParam());
    if (int(level) > int(cpu::detected_isa()))
      GTEST_SKIP() << cpu::isa_name(level) << " not run: this CPU runs at most " << cpu::isa_name(cpu::detected_isa());
  }
  IsaGuard guard;
};

TEST_P(FloatGemmLevel, MatchesTheDoubleReferenceAndTheScalarLevelBitwise) {
  const auto [t, level] = GetParam();
  for (const Shape& s : kShapes) {
    FloatMatrix m(t, s.rows, s.cols, uint32_t(s.rows * 131 + s.cols));
    ASSERT_TRUE(m.w.packed_float) << "F16 / BF16 matrices must be prepared for the float GEMM";
    const auto xs = test::random_floats(s.n_tok * s.cols + 1, uint32_t(s.n_tok + 7));
    const float* x = xs.data() + 1;  // misaligned activations
    const Reference want(m.w, x, s.n_tok);
    std::vector<float> got(s.n_tok * s.rows, NAN), scalar(got.size(), NAN), oracle(got.size());
    cpu::force_isa(cpu::Isa::Scalar);
    cpu::matmul(m.w, x, scalar.data(), s.n_tok);
    cpu::force_isa(level);
    cpu::matmul(m.w, x, got.data(), s.n_tok);
    ref::matmul(WeightMatrix{t, s.rows, s.cols, m.w.data, m.w.row_stride}, x, oracle.data(), s.n_tok);
    const std::string where = type_name(t) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + ", " +
                              std::to_string(s.n_tok) + " tokens at " + cpu::isa_name(level);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_LE(std::abs(got[i] - want.y[i]), want.bound[i]) << where << ", output " << i;
      ASSERT_LE(std::abs(double(oracle[i]) - want.y[i]), want.bound[i]) << "ref::matmul, " << where;
    }
    ASSERT_EQ(0, std::memcmp(got.data(), scalar.data(), got.size() * 4)) << where << ": differs from the scalar level";
  }
}

TEST_P(FloatGemmLevel, TokenResultsDoNotDependOnTheBatchOrThreads) {
  const auto [t, level] = GetParam();
  cpu::force_isa(level);
  const int64_t rows = 45, cols = 300, n_tok = 37;
  FloatMatrix m(t, rows, cols, 11);
  const auto x = test::random_floats(n_tok * cols, 3);
  std::vector<float> all(n_tok * rows), one(rows), part(5 * rows), single_thread(n_tok * rows);
  cpu::matmul(m.w, x.data(), all.data(), n_tok);
  for (int64_t tok = 0; tok < n_tok; ++tok) {
    cpu::matmul(m.w, x.data() + tok * cols, one.data(), 1);
    ASSERT_EQ(0, std::memcmp(one.data(), all.data() + tok * rows, rows * 4)) << "token " << tok << " alone";
  }
  for (int64_t tok = 0; tok + 5 <= n_tok; tok += 4) {  // and in batches of 5 (other tile widths)
    cpu::matmul(m.w, x.data() + tok * cols, part.data(), 5);
    ASSERT_EQ(0, std::memcmp(part.data(), all.data() + tok * rows, part.size() * 4)) << "tokens from " << tok;
  }
  const int threads = compute_threads();
  set_compute_threads(1);
  cpu::matmul(m.w, x.data(), single_thread.data(), n_tok);
  set_compute_threads(threads);
  EXPECT_EQ(0, std::memcmp(single_thread.data(), all.data(), all.size() * 4)) << "1 thread";
}

INSTANTIATE_TEST_SUITE_P(TypesAndLevels, FloatGemmLevel,
                         ::testing::Combine(::testing::ValuesIn(kFloatTypes), ::testing::ValuesIn(kLevels)),
                         [](const auto& info) {
                           return type_name(std::get<0>(info.param)) + "_" + cpu::isa_name(std::get<1>(info.param));
                         });

// ---- every kernel variant, called directly on sub-ranges -----------------------------------------

struct Variant {
  const char* name;
  cpu::FloatGemmFn fn;
  bool (*runs)();
  const char* lacks;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
#if defined(__x86_64__)
      {"avx2", cpu::float_gemm_avx2, [] { return int(cpu::detected_isa()) >= int(cpu::Isa::Avx2); }, "AVX2+FMA+F16C"},
      {"avx512", cpu::float_gemm_avx512, [] { return int(cpu::detected_isa()) >= int(cpu::Isa::Avx512); },
       "AVX-512 F/BW/VL/DQ/VNNI"},
      {"avx512_bf16", cpu::float_gemm_avx512_bf16, [] { return cpu::has_avx512_bf16(); }, "AVX512_BF16"},
#endif
      {"scalar", cpu::float_gemm_scalar, [] { return true; }, ""},
  };
  return v;
}

// Runs `fn` over the whole matrix in pieces: groups one by one or in runs of 3, tokens in chunks of
// `tchunk`, so every tile shape the kernel picks for a sub-range is exercised.
std::vector<float> run_pieces(cpu::FloatGemmFn fn, const cpu::PackedFloatWeights& p, const cpu::FloatActs& a,
                              int64_t gstep, int64_t tchunk) {
  std::vector<float> y(a.n_tok * p.rows, NAN);
  for (int64_t g = 0; g < p.n_groups; g += gstep)
    for (int64_t t = 0; t < a.n_tok; t += tchunk)
      fn(p, a, g, std::min(p.n_groups, g + gstep), t, std::min(a.n_tok, t + tchunk), y.data());
  return y;
}

class FloatGemmVariant : public ::testing::TestWithParam<std::tuple<DType, size_t>> {
 protected:
  void SetUp() override {
    const Variant& v = variants()[std::get<1>(GetParam())];
    if (!v.runs()) GTEST_SKIP() << v.name << " not run: this CPU lacks " << v.lacks;
  }
};

TEST_P(FloatGemmVariant, EqualsTheScalarKernelBitwiseOnEverySubRange) {
  const auto [t, index] = GetParam();
  const Variant& v = variants()[index];
  for (const Shape& s : kShapes) {
    FloatMatrix m(t, s.rows, s.cols, uint32_t(s.rows + 3 * s.cols));
    const auto x = test::random_floats(s.n_tok * s.cols, 21);
    cpu::FloatActs acts;
    cpu::prepare_float_acts(t, x.data(), s.cols, s.n_tok, acts);
    const auto& p = *m.w.packed_float;
    const auto want = run_pieces(cpu::float_gemm_scalar, p, acts, p.n_groups, s.n_tok);
    const std::vector<std::pair<int64_t, int64_t>> pieces = {{p.n_groups, s.n_tok}, {1, 1}, {3, 2}, {1, 5}, {5, 9}};
    for (auto [gstep, tchunk] : pieces) {
      const auto got = run_pieces(v.fn, p, acts, gstep, tchunk);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
          << v.name << " " << type_name(t) << " " << s.rows << "x" << s.cols << ", " << s.n_tok << " tokens, groups by "
          << gstep << ", tokens by " << tchunk;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TypesAndVariants, FloatGemmVariant,
                         ::testing::Combine(::testing::ValuesIn(kFloatTypes),
                                            ::testing::Range(size_t(0), variants().size())),
                         [](const auto& info) {
                           return type_name(std::get<0>(info.param)) + "_" + variants()[std::get<1>(info.param)].name;
                         });

class FloatGemmBf16 : public ::testing::TestWithParam<size_t> {
 protected:
  void SetUp() override {
    const Variant& v = variants()[GetParam()];
    if (!v.runs()) GTEST_SKIP() << v.name << " not run: this CPU lacks " << v.lacks;
  }
};

// BF16 values near the bottom of the float range: products and partial sums cross FLT_MIN, where the
// flush to zero and the rounding of VDPBF16PS decide the bits.
TEST_P(FloatGemmBf16, UnderflowIsFlushedAsVdpbf16psDoes) {
  const DType t = DType::BF16;
  const Variant& v = variants()[GetParam()];
  std::mt19937 rng(5);
  const auto tiny_bf16 = [&] {  // sign, exponent 2^-75 .. 2^-61, 7 random mantissa bits
    return uint16_t((rng() & 1) << 15 | (127 - 75 + rng() % 15) << 7 | (rng() & 0x7f));
  };
  const int64_t rows = 37, cols = 100, n_tok = 9;
  std::vector<uint8_t> bytes(rows * cols * 2);
  for (size_t i = 0; i < bytes.size(); i += 2) {
    const uint16_t h = tiny_bf16();
    std::memcpy(&bytes[i], &h, 2);
  }
  FloatMatrix m(t, rows, cols, bytes);
  std::vector<float> x(n_tok * cols);
  for (auto& f : x) {
    const uint32_t u = uint32_t(tiny_bf16()) << 16;
    std::memcpy(&f, &u, 4);
  }
  cpu::FloatActs acts;
  cpu::prepare_float_acts(t, x.data(), cols, n_tok, acts);
  const auto& p = *m.w.packed_float;
  const auto want = run_pieces(cpu::float_gemm_scalar, p, acts, p.n_groups, n_tok);
  int flushed = 0;
  for (float f : want) flushed += f == 0.0f;
  const auto got = run_pieces(v.fn, p, acts, 1, 3);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << v.name;
  EXPECT_GT(flushed, 0) << "the data should reach the flush";
  std::cout << "[   INFO   ] " << v.name << ": " << flushed << " of " << want.size() << " outputs are zeros\n";
}

// Three rows whose results show VDPBF16PS's semantics (x = 1 everywhere except x[5] for token 1):
//   row 0: 1, then the pair (-2^-24, +2^-24): the odd value first gives 1 (a tie, to even), then
//          1 - 2^-24; the even one first would give 1;
//   row 1: 1.5 * 2^-126 then -2^-126: 2^-127 is a denormal, flushed to +0;
//   row 2 (token 1, x[5] = 2^-25): 2^-126 then -2^-151: FLT_MIN - 2^-151 rounds to FLT_MIN with
//          an unbounded exponent, so it is not flushed (tininess after rounding, as x86 detects it).
TEST_P(FloatGemmBf16, PairOrderAndFlushesAreThoseOfVdpbf16ps) {
  const DType t = DType::BF16;
  const Variant& v = variants()[GetParam()];
  const int64_t rows = 3, cols = 8, n_tok = 2;
  std::vector<float> w(rows * cols, 0.0f);
  w[0 * cols + 0] = 1.0f, w[0 * cols + 4] = -std::ldexp(1.0f, -24), w[0 * cols + 5] = std::ldexp(1.0f, -24);
  w[1 * cols + 0] = 1.5f * std::ldexp(1.0f, -126), w[1 * cols + 5] = -std::ldexp(1.0f, -126);
  w[2 * cols + 1] = std::ldexp(1.0f, -126), w[2 * cols + 5] = -std::ldexp(1.0f, -126);
  std::vector<uint8_t> bytes(rows * cols * 2);
  for (size_t i = 0; i < w.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &w[i], 4);
    const uint16_t h = uint16_t(u >> 16);  // every value above is exact in BF16
    std::memcpy(&bytes[2 * i], &h, 2);
  }
  FloatMatrix m(t, rows, cols, bytes);
  std::vector<float> x(n_tok * cols, 1.0f);
  x[cols + 5] = std::ldexp(1.0f, -25);
  cpu::FloatActs acts;
  cpu::prepare_float_acts(t, x.data(), cols, n_tok, acts);
  const auto y = run_pieces(v.fn, *m.w.packed_float, acts, 1, 1);
  EXPECT_EQ(y[0 * rows + 0], 1.0f - std::ldexp(1.0f, -24)) << v.name << ": the odd value of a pair comes first";
  EXPECT_EQ(y[0 * rows + 1], 0.0f) << v.name << ": a denormal partial sum is flushed";
  EXPECT_FALSE(std::signbit(y[0 * rows + 1])) << v.name;
  EXPECT_EQ(y[1 * rows + 2], FLT_MIN) << v.name << ": tininess is detected after rounding";
}

INSTANTIATE_TEST_SUITE_P(Variants, FloatGemmBf16, ::testing::Range(size_t(0), variants().size()),
                         [](const auto& info) { return std::string(variants()[info.param].name); });

// ---- preparation and dispatch -------------------------------------------------------------------

TEST(FloatGemm, OnlyF16AndBf16ArePreparedForIt) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0}) {
    const int64_t cols = 64;
    FloatMatrix m(t, 3, cols, test::random_rows(t, 3, cols, 1));
    EXPECT_EQ(bool(m.w.packed_float), t == DType::F16 || t == DType::BF16) << type_name(t);
    if (m.w.packed_float) {
      EXPECT_EQ(m.w.packed_float->n_groups, 1);
      EXPECT_EQ(m.w.packed_float->kpad, 64);
    }
  }
}

TEST(FloatGemm, EachLevelRunsItsOwnKernel) {
  EXPECT_EQ(cpu::float_gemm_for(cpu::Isa::Scalar), &cpu::float_gemm_scalar);
#if defined(__x86_64__)
  EXPECT_EQ(cpu::float_gemm_for(cpu::Isa::Avx2), &cpu::float_gemm_avx2);
  const cpu::FloatGemmFn avx512 = cpu::has_avx512_bf16() ? &cpu::float_gemm_avx512_bf16 : &cpu::float_gemm_avx512;
  EXPECT_EQ(cpu::float_gemm_for(cpu::Isa::Avx512), avx512);
  EXPECT_EQ(cpu::float_gemm_for(cpu::Isa::Amx), avx512);
#endif
  std::cout << "[   INFO   ] detected " << cpu::isa_name(cpu::detected_isa()) << ", AVX512_BF16 "
            << (cpu::has_avx512_bf16() ? "yes" : "no") << "\n";
}

// ---- end to end: the tiny safetensors model with F16 / BF16 matrices -----------------------------

// TinyStories-656K (F32 safetensors) with every 2-D tensor rounded to `t` (to nearest even), written
// with the model's other files into a directory of its own.
std::string converted_model(DType t) {
  namespace fs = std::filesystem;
  const fs::path src = test::shared_path("models/TinyStories-656K");
  const fs::path dst = fs::temp_directory_path() / ("serval_gemm_float_" + type_name(t) + "_" + std::to_string(getpid()));
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(src))
    if (e.path().filename() != "model.safetensors")
      fs::copy_file(e.path(), dst / e.path().filename(), fs::copy_options::overwrite_existing);
  const std::string bytes = test::read_file((src / "model.safetensors").string());
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  const char* data = bytes.data() + 8 + n;
  nlohmann::json out = nlohmann::json::object();
  std::string out_data;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") {
      out[name] = e;
      continue;
    }
    const uint64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
    nlohmann::json ne = e;
    const size_t start = out_data.size();
    if (e["dtype"] == "F32" && e["shape"].size() == 2) {
      ne["dtype"] = t == DType::F16 ? "F16" : "BF16";
      for (uint64_t i = begin; i < end; i += 4) {
        float f;
        uint32_t u;
        std::memcpy(&f, data + i, 4);
        std::memcpy(&u, &f, 4);
        const uint16_t h = t == DType::F16 ? f32_to_fp16(f) : uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        out_data.append(reinterpret_cast<const char*>(&h), 2);
      }
    } else {
      out_data.append(data + begin, end - begin);
    }
    ne["data_offsets"] = {start, out_data.size()};
    while (out_data.size() % 8) out_data.push_back(0);  // every tensor starts 8-byte aligned
    out[name] = ne;
  }
  std::string text = out.dump();
  while ((8 + text.size()) % 8) text.push_back(' ');
  const uint64_t m = text.size();
  std::ofstream f(dst / "model.safetensors", std::ios::binary);
  f.write(reinterpret_cast<const char*>(&m), 8);
  f.write(text.data(), std::streamsize(text.size()));
  f.write(out_data.data(), std::streamsize(out_data.size()));
  return dst.string();
}

// Logits of every position of `tokens` evaluated in one sequence, in chunks of n_batch tokens.
std::vector<float> all_logits(const Model& m, const std::vector<int32_t>& tokens, int64_t n_batch) {
  SingleSequence seq(m, int64_t(tokens.size()));
  return seq.eval(tokens, true, n_batch);
}

TEST(FloatGemmModel, F16AndBf16TinyStoriesAgreeWithF32AndAreBatchInvariant) {
  const std::string dir = test::shared_path("models/TinyStories-656K");
  auto f32 = Model::load(dir);
  auto tokens = f32->tokenizer().encode(test::read_file(std::string(SERVAL_SOURCE_DIR) + "/tests/data/tinystory.txt"), true);
  ASSERT_GE(tokens.size(), 200u);
  tokens.resize(200);
  const auto a = all_logits(*f32, tokens, 512);
  const int64_t n_vocab = f32->config().n_vocab;
  for (DType t : kFloatTypes) {
    const std::string conv = converted_model(t);
    auto m = Model::load(conv);
    std::filesystem::remove_all(conv);
    const auto b = all_logits(*m, tokens, 512);
    int same_top1 = 0;
    double kl_sum = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      const std::span<const float> la(a.data() + i * n_vocab, n_vocab), lb(b.data() + i * n_vocab, n_vocab);
      same_top1 += argmax(la) == argmax(lb);
      const auto za = logprobs_of(la, 0, 0).logprob - la[0], zb = logprobs_of(lb, 0, 0).logprob - lb[0];
      for (int64_t v = 0; v < n_vocab; ++v) {
        const double lpa = la[v] + za, lpb = lb[v] + zb;
        kl_sum += std::exp(lpa) * (lpa - lpb);
      }
    }
    const double top1 = same_top1 / double(tokens.size()), mean_kl = kl_sum / double(tokens.size());
    std::cout << "[   INFO   ] " << type_name(t) << " vs F32: top-1 agreement " << top1 << ", mean KL " << mean_kl << "\n";
    EXPECT_GE(top1, 0.95) << type_name(t);
    EXPECT_LT(mean_kl, 0.01) << type_name(t);
    EXPECT_GT(mean_kl, 0.0) << type_name(t) << " must differ from F32, or the comparison is vacuous";
    const auto chunked = all_logits(*m, tokens, 7);  // other batch sizes, other tiles: the same bits
    EXPECT_EQ(0, std::memcmp(chunked.data(), b.data(), b.size() * 4)) << type_name(t) << ": chunks of 7 differ";
  }
}

}  // namespace
}  // namespace serval

namespace serval {
namespace {

// F16 activations rounded at every level are the bits of the scalar level's f32_to_fp16 then
// fp16_to_f32: ties to even, subnormal halves, overflow to infinity, infinities, NaNs of either sign
// (made quiet), and every tail length.
TEST(FloatGemm, F16ActivationRoundingIsTheScalarBitsAtEveryLevel) {
  std::vector<float> x = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.0f, 65520.0f, -65520.0f, 1e-8f, -1e-8f, 5.96e-8f, 2.98e-8f,
                          2.9802326e-8f, 6.1e-5f, 6.097e-5f, 1.00048828125f, 1.000732421875f, 3.0e38f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::denorm_min()};
  uint32_t payload_nan = 0x7F812345u;  // a signalling NaN with a payload
  float f;
  std::memcpy(&f, &payload_nan, 4);
  x.push_back(f);
  for (float v : test::random_floats(300, 99)) x.push_back(v * 1e-3f);
  for (int64_t cols : {int64_t(x.size()), int64_t(1), int64_t(7), int64_t(9), int64_t(17)}) {
    cpu::FloatActs want, got;
    IsaGuard guard;
    cpu::force_isa(cpu::Isa::Scalar);
    cpu::prepare_float_acts(DType::F16, x.data(), cols, 1, want);
    for (cpu::Isa level : {cpu::Isa::Avx2, cpu::Isa::Avx512, cpu::Isa::Amx}) {
      if (int(level) > int(cpu::detected_isa())) continue;
      cpu::force_isa(level);
      cpu::prepare_float_acts(DType::F16, x.data(), cols, 1, got);
      ASSERT_EQ(got.x.size(), want.x.size());
      EXPECT_EQ(std::memcmp(got.x.data(), want.x.data(), want.x.size() * 4), 0) << cpu::isa_name(level) << " cols " << cols;
    }
  }
}

}  // namespace
}  // namespace serval
