// cpu::attention_batch (the flash-style kernel, docs/attention.md) against ref::attention, at every
// ISA level this CPU runs, and its batch invariance: a query's output is bitwise the same alone, in
// a batch with other sequences and prefill tiles, split over 1 or 2 threads, and at every level.
//
// Tolerance (derived, not fitted; u = 2^-24). For output element (h, d), with the exact weights w_j,
// A = sum_j w_j |v_jd|, B = max_j scale * sum_d |q_d k_jd| and n keys, each weight the kernel uses
// differs from the exact one by at most, relative:
//   2 (D + 1) u B        the F32 dot products and the scale (a score error e moves the weight by
//                        e, and the normaliser by up to e: twice);
//   u |s_j - max_s|      the rounding of the argument of exp;
//   16 u                 exp of the weight, the sum's exps, 1 / L and the product (about 2 ulp each);
//   (2 n + 5 (n/16 + n/256 + 2)) u   the F32 sums over keys (the normaliser and the values) and the
//                        rescales of the running sum (an exp and a product each);
//   and with an F16 cache 2^-10: the kernel and the reference each round the normalised weight to F16
//   (2^-11 each; they round values that differ by the above, so near a rounding boundary they may
//   land one F16 step apart), plus 2^-24 absolute per key whose weight is below the F16 normal
//   range (2^-14), where F16 rounding is absolute (2^-25 each).
// Summed against |v_jd|, plus the final rounding u |out|, times 1.25 for second-order terms.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "base/cpu.h"
#include "kernels/cpu/attention_dense_impl.h"
#include "kernels/cpu/attention_tile.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "random_blocks.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

using cpu::Isa;

// K and V pools of one layer, each between inaccessible guard regions: a read outside the pool (a
// block of -1, a slot past the end) faults instead of reading neighbouring memory.
class GuardedPools {
 public:
  // FP8 pools get head scales 1, 0.5, 1, 0.5, ... (d_head values per head).
  GuardedPools(DType type, int64_t n_slots, int64_t kv_dim, uint32_t seed, int64_t d_head = 0)
      : type_(type), kv_dim_(kv_dim), d_head_(d_head) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t row = row_bytes(type, size_t(kv_dim));
    bytes_ = size_t(n_slots) * row;
    guard_ = (row * 16 * 2 + page - 1) / page * page;    // > one block of 16 slots
    span_ = guard_ + (bytes_ + page - 1) / page * page;  // [guard][pool ...]
    total_ = 2 * span_ + guard_;                         // [guard][K][guard][V][guard]
    void* p = mmap(nullptr, total_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    base_ = static_cast<uint8_t*>(p);
    // Pools end right at the guard that follows them (a read past the end faults at once).
    k_ = base_ + span_ - bytes_;
    v_ = base_ + 2 * span_ - bytes_;
    EXPECT_EQ(mprotect(base_ + guard_, span_ - guard_, PROT_READ | PROT_WRITE), 0);
    EXPECT_EQ(mprotect(base_ + span_ + guard_, span_ - guard_, PROT_READ | PROT_WRITE), 0);
    for (int64_t h = 0; d_head > 0 && h < kv_dim / d_head; ++h) scales_.push_back(h % 2 ? 0.5f : 1.0f);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0, 1);
    std::vector<float> x(static_cast<size_t>(kv_dim));
    for (uint8_t* pool : {k_, v_})
      for (int64_t i = 0; i < n_slots; ++i) {
        for (auto& e : x) e = nd(rng);
        if (type == DType::F8_E4M3) {
          for (int64_t j = 0; j < kv_dim; ++j) pool[size_t(i) * row + size_t(j)] = f32_to_fp8_e4m3(x[size_t(j)]);
        } else {
          quantize_row(type, x.data(), pool + size_t(i) * row, size_t(kv_dim));
        }
      }
  }
  ~GuardedPools() { munmap(base_, total_); }
  GuardedPools(const GuardedPools&) = delete;
  GuardedPools& operator=(const GuardedPools&) = delete;
  KvLayerView view() const { return {type_, k_, v_, kv_dim_, d_head_, scales_.empty() ? nullptr : scales_.data()}; }

 private:
  DType type_;
  int64_t kv_dim_, d_head_;
  std::vector<float> scales_;
  size_t bytes_ = 0, guard_ = 0, span_ = 0, total_ = 0;
  uint8_t* base_ = nullptr;
  uint8_t* k_ = nullptr;
  uint8_t* v_ = nullptr;
};

// A block table for `n_pos` positions: blocks drawn from a shuffled list of the pool's blocks, and
// -1 for blocks that hold no position at or after `first_used`.
std::vector<int32_t> block_table(int64_t n_pos, int32_t bs, int64_t first_used, std::vector<int32_t>& free_blocks) {
  std::vector<int32_t> t((n_pos + bs - 1) / bs);
  for (size_t b = 0; b < t.size(); ++b) {
    if (int64_t(b + 1) * bs <= first_used) {
      t[b] = -1;
      continue;
    }
    t[b] = free_blocks.back();
    free_blocks.pop_back();
  }
  return t;
}

std::vector<int32_t> shuffled_blocks(int32_t n, uint32_t seed) {
  std::vector<int32_t> b(n);
  std::iota(b.begin(), b.end(), 0);
  std::shuffle(b.begin(), b.end(), std::mt19937(seed));
  return b;
}

// The reference output of one query and the tolerance of each element (see the top of the file).
struct Expected {
  std::vector<float> out;
  std::vector<double> tol;
};

Expected expected(const AttentionShape& s, const float* q, KvLayerView kv, const KvSpan& span) {
  std::vector<int32_t> slots;
  for (int64_t p = span.first; p <= span.last; ++p) slots.push_back(span.slot(p));
  Expected e;
  const int64_t D = s.d_head, n = int64_t(slots.size());
  e.out.resize(size_t(s.n_head * D));
  e.tol.resize(e.out.size());
  ref::attention(s, q, kv, slots, e.out.data());
  const bool half = kv.type != DType::F32;  // F16's rounding points: every cache but F32
  const double u = std::ldexp(1.0, -24);
  const int group = s.n_head / s.n_head_kv;
  std::vector<float> k(D), v(D);
  std::vector<double> sc(n), w(n);
  for (int h = 0; h < s.n_head; ++h) {
    const int g = h / group;
    std::vector<double> qh(D);
    for (int64_t d = 0; d < D; ++d) qh[d] = half ? fp16_to_f32(f32_to_fp16(q[h * D + d])) : q[h * D + d];
    double B = 0, mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      kv.load(kv.k, slots[j], g * D, D, k.data());
      double dot = 0, mag = 0;
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d], mag += std::abs(qh[d] * k[d]);
      sc[j] = dot * s.scale;
      if (s.softcap > 0) sc[j] = s.softcap * std::tanh(sc[j] / s.softcap);  // slope <= 1: B still bounds
      B = std::max(B, mag * s.scale);
      mx = std::max(mx, sc[j]);
    }
    if (s.sinks) mx = std::max(mx, double(s.sinks[h]));
    double sum = s.sinks ? std::exp(double(s.sinks[h]) - mx) : 0.0;
    for (int64_t j = 0; j < n; ++j) sum += (w[j] = std::exp(sc[j] - mx));
    for (auto& x : w) x /= sum;
    // Soft-capping adds the error of its tanh (through vexp and a division): a few units of the cap.
    const double rel = 2 * double(D + 1) * u * B + (2 * double(n) + 5 * (n / 16 + n / 256 + 2) + 16) * u +
                       (half ? std::ldexp(1.0, -10) : 0) + 16 * double(s.softcap) * u;
    std::vector<double> A(D, 0), E(D, 0), tiny(D, 0);
    for (int64_t j = 0; j < n; ++j) {
      kv.load(kv.v, slots[j], g * D, D, v.data());
      for (int64_t d = 0; d < D; ++d) {
        A[d] += w[j] * std::abs(v[d]);
        E[d] += w[j] * std::abs(v[d]) * (mx - sc[j]);
        if (w[j] < std::ldexp(1.0, -14)) tiny[d] += std::abs(v[d]);
      }
    }
    for (int64_t d = 0; d < D; ++d)
      e.tol[h * D + d] = 1.25 * (A[d] * rel + u * E[d] + (half ? u * tiny[d] : 0) + u * std::abs(e.out[h * D + d]));
  }
  return e;
}

// Forces an ISA level for the test and restores the previous one afterwards; a level this CPU
// cannot run is skipped, by name.
class AttentionLevel : public ::testing::TestWithParam<Isa> {
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

std::string level_name(const ::testing::TestParamInfo<Isa>& info) { return cpu::isa_name(info.param); }

// One configuration of the sweep.
struct Case {
  int d_head, group;
  int64_t n_ctx;
  int32_t bs;
  DType type;
  int64_t window;         // 0: none
  float softcap = 0.0f;  // 0: none
  bool sinks = false;    // gpt-oss's attention sinks, one random logit per head
};

std::string describe(const Case& c) {
  return "d_head " + std::to_string(c.d_head) + " group " + std::to_string(c.group) + " ctx " +
         std::to_string(c.n_ctx) + " block " + std::to_string(c.bs) + " " + std::string(dtype_info(c.type).name) +
         " window " + std::to_string(c.window) + (c.softcap > 0 ? " softcap " + std::to_string(c.softcap) : "") +
         (c.sinks ? " sinks" : "");
}

// The last min(n_ctx, 10) positions of one sequence as one batched call (a prefill chunk: query
// tiles), checked one by one against the reference; returns the outputs.
std::vector<float> check_case(const Case& c, uint32_t seed) {
  const int n_kv = 2, n_head = n_kv * c.group, D = c.d_head;
  AttentionShape s{n_head, n_kv, D, 1.0f / std::sqrt(float(D)), c.softcap};
  std::vector<float> sinks = test::random_floats(size_t(n_head), seed + 3);  // [-1, 1): scaled to [-3, 3)
  for (float& x : sinks) x *= 3;
  if (c.sinks) s.sinks = sinks.data();
  const int64_t n_q = std::min<int64_t>(c.n_ctx, 10);
  const int64_t p0 = c.n_ctx - n_q;
  auto first_of = [&](int64_t p) { return c.window ? std::max<int64_t>(0, p - c.window + 1) : 0; };
  const int32_t n_blocks = int32_t((c.n_ctx + c.bs - 1) / c.bs) + 3;
  GuardedPools pools(c.type, int64_t(n_blocks) * c.bs, int64_t(n_kv) * D, seed, c.type == DType::F8_E4M3 ? D : 0);
  auto free_blocks = shuffled_blocks(n_blocks, seed + 1);
  const auto table = block_table(c.n_ctx, c.bs, first_of(p0), free_blocks);
  const auto q = test::random_floats(size_t(n_q * n_head * D), seed + 2);
  std::vector<float> out(q.size(), NAN);
  std::vector<AttentionQuery> queries;
  for (int64_t i = 0; i < n_q; ++i)
    queries.push_back(
        {q.data() + i * n_head * D, KvSpan{table, c.bs, first_of(p0 + i), p0 + i}, out.data() + i * n_head * D});
  cpu::attention_batch(s, queries, pools.view());
  for (int64_t i = 0; i < n_q; ++i) {
    const Expected e = expected(s, queries[i].q, pools.view(), queries[i].keys);
    for (size_t x = 0; x < e.out.size(); ++x) {
      const float got = queries[i].out[x];
      if (!(std::abs(double(got) - e.out[x]) <= e.tol[x])) {
        ADD_FAILURE() << describe(c) << ": position " << p0 + i << " element " << x << ": got " << got << ", reference "
                      << e.out[x] << ", tolerance " << e.tol[x];
        return out;
      }
    }
  }
  return out;
}

constexpr DType kKvTypes[] = {DType::F16, DType::F32, DType::BF16, DType::Q8_0, DType::F8_E4M3};

std::vector<Case> sweep() {
  std::vector<Case> cases;
  for (int d_head : {40, 64, 72, 128})
    for (int group : {1, 2, 7})
      for (int64_t n_ctx : {1, 15, 16, 17, 260, 300, 1100})  // 260: a prefill tile across chunk 1's start
        for (int32_t bs : {1, 16})
          for (DType type : kKvTypes)
            for (int64_t window : {int64_t(0), n_ctx > 200 ? int64_t(100) : int64_t(5)}) {
              if (window >= n_ctx) continue;
              // Q8_0 blocks of 32 never straddle heads; the newer types at one block size.
              if (type == DType::Q8_0 && d_head % 32 != 0) continue;
              if (type != DType::F16 && type != DType::F32 && bs != 16) continue;
              cases.push_back({d_head, group, n_ctx, bs, type, window});
            }
  return cases;
}

TEST_P(AttentionLevel, MatchesReferenceOnOddShapes) {
  uint32_t seed = 100;
  for (const Case& c : sweep()) {
    check_case(c, seed++);
    if (HasFailure()) return;
  }
}

// The levels run the same operations lane by lane: their outputs are bitwise equal to the
// portable level's.
TEST_P(AttentionLevel, BitwiseEqualToPortableLevel) {
  if (GetParam() == Isa::Scalar) GTEST_SKIP() << "the portable level itself";
  uint32_t seed = 500;
  for (const Case& c : sweep()) {
    if (c.n_ctx > 300 && c.d_head != 64) continue;  // keep the scalar runs short
    const auto mine = check_case(c, seed);
    cpu::force_isa(Isa::Scalar);
    const auto scalar = check_case(c, seed);
    cpu::force_isa(GetParam());
    ++seed;
    ASSERT_EQ(std::memcmp(mine.data(), scalar.data(), mine.size() * sizeof(float)), 0) << describe(c);
  }
}

// Gemma 2's soft-capped scores: against the reference (std::tanh in double), and bitwise across levels.
std::vector<Case> softcap_sweep() {
  std::vector<Case> cases;
  for (int d_head : {64, 128})
    for (int group : {1, 7})
      for (int64_t n_ctx : {1, 17, 300})
        for (DType type : {DType::F16, DType::F32, DType::Q8_0})
          for (float cap : {0.25f, 30.0f}) cases.push_back({d_head, group, n_ctx, 16, type, n_ctx > 200 ? 100 : 0, cap});
  return cases;
}

TEST_P(AttentionLevel, SoftcapMatchesReferenceAndPortableLevel) {
  uint32_t seed = 900;
  for (const Case& c : softcap_sweep()) {
    const auto mine = check_case(c, seed);
    Case uncapped = c;
    uncapped.softcap = 0;
    const auto plain = check_case(uncapped, seed);
    if (HasFailure()) return;
    if (c.softcap < 1 && c.n_ctx > 1) ASSERT_NE(std::memcmp(mine.data(), plain.data(), mine.size() * sizeof(float)), 0) << describe(c);
    cpu::force_isa(Isa::Scalar);
    const auto scalar = check_case(c, seed);
    cpu::force_isa(GetParam());
    ++seed;
    ASSERT_EQ(std::memcmp(mine.data(), scalar.data(), mine.size() * sizeof(float)), 0) << describe(c);
  }
}

// gpt-oss's attention sinks (a learned logit per head in the softmax's denominator): against the
// reference, different from no sinks, and bitwise across levels, over GQA groups, windows and caches.
TEST_P(AttentionLevel, SinksMatchReferenceAndPortableLevel) {
  uint32_t seed = 1300;
  for (int d_head : {64, 72})
    for (int group : {1, 8})
      for (int64_t n_ctx : {1, 17, 300})
        for (DType type : {DType::F16, DType::F32, DType::Q8_0}) {
          if (type == DType::Q8_0 && d_head % 32 != 0) continue;
          const Case c{d_head, group, n_ctx, 16, type, n_ctx > 200 ? 128 : 0, 0.0f, true};
          const auto mine = check_case(c, seed);
          Case plain_case = c;
          plain_case.sinks = false;
          const auto plain = check_case(plain_case, seed);
          if (HasFailure()) return;
          ASSERT_NE(std::memcmp(mine.data(), plain.data(), mine.size() * sizeof(float)), 0) << describe(c);
          cpu::force_isa(Isa::Scalar);
          const auto scalar = check_case(c, seed);
          cpu::force_isa(GetParam());
          ++seed;
          ASSERT_EQ(std::memcmp(mine.data(), scalar.data(), mine.size() * sizeof(float)), 0) << describe(c);
        }
}

// Each level converts FP8 rows with its own vectors (the F16 trick, attention_avx2/512.cpp): every one
// of the 256 codes, at every row length up to 40 (the tails) and two head scales, gives the table's
// value times the scale bit for bit, NaN codes NaN.
TEST_P(AttentionLevel, Fp8RowsEqualTheTable) {
  using Fn = void (*)(const uint8_t*, float*, int, float);
  const Fn fn = GetParam() == Isa::Scalar ? Fn(cpu::attn::fp8_row_scalar)
                : GetParam() == Isa::Avx2 ? Fn(cpu::attn::fp8_row_avx2)
                                          : Fn(cpu::attn::fp8_row_avx512);
  const float* table = fp8_e4m3_table();
  std::vector<uint8_t> codes(256 + 40);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t(i * 37 + 11);  // every code, shuffled
  std::vector<float> out(codes.size() + 1);
  int nan_codes = 0;
  for (float scale : {1.0f, 0.375f})
    for (int start : {0, 1, 7})
      for (int n : {1, 7, 8, 15, 16, 17, 31, 40, 256}) {
        out.assign(out.size(), -7.0f);
        fn(codes.data() + start, out.data(), n, scale);
        for (int i = 0; i < n; ++i) {
          const uint8_t c = codes[size_t(start + i)];
          const float want = table[c] * scale;
          if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(out[size_t(i)])) << int(c);
            nan_codes += n == 256 && start == 0 && scale == 1.0f;
          } else {
            uint32_t a, b;
            std::memcpy(&a, &out[size_t(i)], 4), std::memcpy(&b, &want, 4);
            EXPECT_EQ(a, b) << "code " << int(c) << " scale " << scale << " n " << n;
          }
        }
        EXPECT_EQ(out[size_t(n)], -7.0f) << "wrote past the row";
      }
  EXPECT_EQ(nan_codes, 2);  // 0x7F and 0xFF
}

// Several sequences in one pool: a long one (chunks 0..2) with a prefill chunk of 10, a decode, a
// windowed prefill chunk whose early blocks are -1, and a fresh prefill from position 0.
struct Scene {
  static constexpr int kKv = 2, kGroup = 7, kD = 64, kHeads = kKv * kGroup;
  const AttentionShape s{kHeads, kKv, kD, 0.125f};
  GuardedPools pools;
  std::vector<std::vector<int32_t>> tables;
  struct Q {
    int seq;
    int64_t first, pos;
  };
  std::vector<Q> qs;
  std::vector<float> q;

  explicit Scene(DType type) : pools(type, 160 * 16, kKv * kD, 7, kD) {
    auto free_blocks = shuffled_blocks(160, 8);
    const int64_t window = 100;
    tables.push_back(block_table(700, 16, 0, free_blocks));
    tables.push_back(block_table(521, 16, 0, free_blocks));
    tables.push_back(block_table(305, 16, 300 - window + 1, free_blocks));
    tables.push_back(block_table(3, 16, 0, free_blocks));
    for (int64_t p = 690; p < 700; ++p) qs.push_back({0, 0, p});
    qs.push_back({1, 0, 520});
    for (int64_t p = 300; p < 305; ++p) qs.push_back({2, p - window + 1, p});
    for (int64_t p = 0; p < 3; ++p) qs.push_back({3, 0, p});
    q = test::random_floats(qs.size() * kHeads * kD, 9);
  }

  // Runs the queries `idx` (in that order) as one call; returns every query's output (NaN for
  // those not run).
  std::vector<float> run(const std::vector<size_t>& idx) const {
    std::vector<float> out(q.size(), NAN);
    std::vector<AttentionQuery> batch;
    for (size_t i : idx)
      batch.push_back({q.data() + i * kHeads * kD, KvSpan{tables[qs[i].seq], 16, qs[i].first, qs[i].pos},
                       out.data() + i * kHeads * kD});
    cpu::attention_batch(s, batch, pools.view());
    return out;
  }
};

void expect_same_rows(const std::vector<float>& got, const std::vector<float>& want, const std::vector<size_t>& idx,
                      const std::string& what) {
  const size_t row = Scene::kHeads * Scene::kD;
  for (size_t i : idx)
    EXPECT_EQ(std::memcmp(got.data() + i * row, want.data() + i * row, row * sizeof(float)), 0)
        << what << ": query " << i;
}

TEST_P(AttentionLevel, BatchInvariance) {
  const int saved_threads = compute_threads();
  for (DType type : kKvTypes) {
    const Scene scene(type);
    const size_t n = scene.qs.size();
    std::vector<size_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    // Each query alone, on 1 thread: the baseline.
    set_compute_threads(1);
    std::vector<float> alone(scene.q.size(), NAN);
    for (size_t i = 0; i < n; ++i) {
      const auto one = scene.run({i});
      const size_t row = Scene::kHeads * Scene::kD;
      std::copy(one.begin() + i * row, one.begin() + (i + 1) * row, alone.begin() + i * row);
    }
    // Queries within the reference tolerance (the sweep's check, once here for the scene).
    for (size_t i = 0; i < n; ++i) {
      const auto& qi = scene.qs[i];
      const Expected e = expected(scene.s, scene.q.data() + i * Scene::kHeads * Scene::kD, scene.pools.view(),
                                  KvSpan{scene.tables[qi.seq], 16, qi.first, qi.pos});
      for (size_t x = 0; x < e.out.size(); ++x)
        ASSERT_LE(std::abs(double(alone[i * e.out.size() + x]) - e.out[x]), e.tol[x])
            << "query " << i << " element " << x;
    }
    // Interleaved: no two consecutive queries of one sequence (tiles of one query).
    std::vector<size_t> interleaved;
    for (size_t k = 0; k < n; ++k) interleaved.push_back((k * 5) % n);  // 5 and n = 19 are coprime
    ASSERT_EQ(n, 19u);
    const int64_t task_room = cpu::attn::score_room_per_task(), call_room = cpu::attn::score_room_per_call();
    for (auto [threads, keep_scores] : {std::pair{1, true}, {2, true}, {1, false}, {2, false}}) {
      set_compute_threads(threads);
      // Scores kept between the passes, or computed again.
      if (keep_scores) cpu::attn::set_score_room(task_room, call_room);
      else cpu::attn::set_score_room(0, 0);
      const std::string t = " (" + std::to_string(threads) + " threads, " + std::string(dtype_info(type).name) +
                            (keep_scores ? ", scores kept)" : ", scores computed again)");
      expect_same_rows(scene.run(all), alone, all, "all in one call" + t);
      expect_same_rows(scene.run(interleaved), alone, all, "interleaved" + t);
      std::vector<size_t> reversed(all.rbegin(), all.rend());
      expect_same_rows(scene.run(reversed), alone, all, "reversed" + t);
      for (int seq = 0; seq < 4; ++seq) {
        std::vector<size_t> mine;
        for (size_t i = 0; i < n; ++i)
          if (scene.qs[i].seq == seq) mine.push_back(i);
        expect_same_rows(scene.run(mine), alone, mine, "sequence " + std::to_string(seq) + " alone" + t);
      }
      for (size_t i = 0; i < n; ++i) expect_same_rows(scene.run({i}), alone, {i}, "alone" + t);
    }
    cpu::attn::set_score_room(task_room, call_room);
    set_compute_threads(saved_threads);
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, AttentionLevel, ::testing::Values(Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx),
                         level_name);

// The single-query entry point over a slot list (block size 1, slots out of order).
TEST(Attention, SingleQueryOverSlots) {
  const AttentionShape s{14, 2, 64, 0.125f};
  GuardedPools pools(DType::F16, 600, 128, 3);
  std::vector<int32_t> slots;
  for (int j = 0; j < 517; ++j) slots.push_back(int32_t((j * 7 + 3) % 600));
  const auto q = test::random_floats(14 * 64, 4);
  std::vector<float> out(q.size());
  cpu::attention(s, q.data(), pools.view(), slots, out.data());
  const Expected e = expected(s, q.data(), pools.view(), KvSpan{slots, 1, 0, int64_t(slots.size()) - 1});
  for (size_t x = 0; x < out.size(); ++x) ASSERT_LE(std::abs(double(out[x]) - e.out[x]), e.tol[x]) << x;
}

// A decode at long context on two threads is split by chunk (flash-decoding), each task taking a run
// of chunks (kSplitTasksPerThread): 23 chunks x 2 KV heads give runs of 2 and a last run of 1. The
// output is the bits of one thread (not split: one task per head) and within the reference's bound,
// for an F16 and an F32 cache, with the scores kept between the passes and computed again.
TEST(Attention, LongDecodeSplitIntoRunsOfChunks) {
  const AttentionShape s{14, 2, 64, 0.125f};
  const int64_t pos = 5700;  // chunks 0 .. 22
  ASSERT_EQ(2 * (pos / cpu::attn::kChunk + 1) / (cpu::attn::kSplitTasksPerThread * 2), 2);
  const int saved_threads = compute_threads();
  const int64_t task_room = cpu::attn::score_room_per_task(), call_room = cpu::attn::score_room_per_call();
  for (DType type : {DType::F16, DType::F32}) {
    GuardedPools pools(type, 360 * 16, 128, 5, 64);
    auto free_blocks = shuffled_blocks(360, 6);
    const auto table = block_table(pos + 1, 16, 0, free_blocks);
    const auto q = test::random_floats(14 * 64, 7);
    auto run = [&](int threads, bool keep) {
      set_compute_threads(threads);
      cpu::attn::set_score_room(keep ? task_room : 0, keep ? call_room : 0);
      std::vector<float> out(q.size(), NAN);
      const AttentionQuery query{q.data(), KvSpan{table, 16, 0, pos}, out.data()};
      cpu::attention_batch(s, std::span<const AttentionQuery>(&query, 1), pools.view());
      return out;
    };
    const auto one = run(1, true);
    const Expected e = expected(s, q.data(), pools.view(), KvSpan{table, 16, 0, pos});
    for (size_t x = 0; x < one.size(); ++x) ASSERT_LE(std::abs(double(one[x]) - e.out[x]), e.tol[x]) << x;
    for (bool keep : {true, false}) {
      const auto two = run(2, keep);
      EXPECT_EQ(std::memcmp(two.data(), one.data(), one.size() * sizeof(float)), 0)
          << dtype_info(type).name << (keep ? ", scores kept" : ", scores computed again");
    }
  }
  cpu::attn::set_score_room(task_room, call_room);
  set_compute_threads(saved_threads);
}

// Timings of the kernel alone at Qwen2.5-0.5B's shape (14 query heads, 2 KV heads, d_head 64, F16
// cache, blocks of 16), one layer: batch-1 decode at 8K and 1K, a 512-token prefill chunk at 4K.
// Run with --gtest_also_run_disabled_tests --gtest_filter='*AttentionBench*' (figures in
// docs/attention.md).
TEST(AttentionBench, DISABLED_Qwen05bShapes) {
  const AttentionShape s{14, 2, 64, 0.125f};
  const int64_t ctx = 8192;
  GuardedPools pools(DType::F16, ctx, 128, 1);
  auto free_blocks = shuffled_blocks(int32_t(ctx / 16), 2);
  const auto table = block_table(ctx, 16, 0, free_blocks);
  auto time = [&](const char* what, int64_t n_q, int64_t last, int64_t first_of_window = 0) {
    const auto q = test::random_floats(size_t(n_q * 14 * 64), 3);
    std::vector<float> out(q.size());
    std::vector<AttentionQuery> batch;
    for (int64_t i = 0; i < n_q; ++i)
      batch.push_back(
          {q.data() + i * 896, KvSpan{table, 16, first_of_window, last - n_q + 1 + i}, out.data() + i * 896});
    double pairs = 0;
    for (const auto& b : batch) pairs += double(b.keys.size());
    cpu::attention_batch(s, batch, pools.view());  // warm up
    // Wall time, and CPU time of all threads: on a shared machine the steadier one for 1 thread (with
    // 2, it includes the pool's idle spinning).
    auto cpu_now = [] {
      timespec ts;
      clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
      return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
    };
    double best = 1e30, best_cpu = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const double c0 = cpu_now();
      const auto t0 = std::chrono::steady_clock::now();
      cpu::attention_batch(s, batch, pools.view());
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      best_cpu = std::min(best_cpu, cpu_now() - c0);
    }
    // 4 flops per (query, key, head, dimension): the QK and PV multiply-adds.
    printf("%-7s %-30s wall %8.3f ms  cpu %8.3f ms  %6.1f GFLOP/s per cpu-second\n", cpu::isa_name(cpu::active_isa()),
           what, best * 1e3, best_cpu * 1e3, pairs * 14 * 64 * 4 / best_cpu * 1e-9);
  };
  const Isa saved = cpu::active_isa();
  const int saved_threads = compute_threads();
  for (Isa level : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    if (int(level) > int(cpu::detected_isa())) continue;
    cpu::force_isa(level);
    for (int threads : {1, 2}) {
      set_compute_threads(threads);
      const std::string t = std::to_string(threads) + "t ";
      time((t + "decode, 8K context").c_str(), 1, ctx - 1);
      time((t + "decode, 1K context").c_str(), 1, 1023);
      if (level != Isa::Scalar) time((t + "prefill 512 at 3584..4095").c_str(), 512, 4095);
    }
  }
  cpu::force_isa(saved);
  set_compute_threads(saved_threads);
}

// The dense kernel's softmax exponential (attention_dense_impl.h), compiled here at the baseline as the
// scalar level compiles it: within 2^-22 relative of std::exp down to -87, 0 below, NaN kept.
TEST(AttentionDense, LaneExponentialIsWithinItsBound) {
  using cpu::attn::Lanes;
  std::vector<float> a;
  for (double v = -100; v <= 0; v += 0.0137) a.push_back(float(v));
  for (float v : {0.0f, -0.0f, -1e-30f, -86.99f, -87.0f, -87.01f, -1e30f, -INFINITY}) a.push_back(v);
  a.push_back(std::nanf(""));
  while (a.size() % 16) a.push_back(-1.0f);
  for (size_t i = 0; i < a.size(); i += 16) {
    float got[16];
    cpu::attn::store_lanes(got, cpu::attn::exp_lanes(cpu::attn::load_lanes(a.data() + i)));
    for (int l = 0; l < 16; ++l) {
      const float x = a[i + size_t(l)];
      if (std::isnan(x)) EXPECT_TRUE(std::isnan(got[l]));
      else if (x < -87.0f) EXPECT_EQ(got[l], 0.0f) << x;
      else EXPECT_NEAR(got[l], std::exp(double(x)), std::exp(double(x)) * 0x1p-22) << x;
    }
  }
}

// Encoder attention (every query of a span attends every key of it) at each level: against the
// reference over an F32 view of the span's rows, with GQA, for a head size of the generic loops (16)
// and of the fixed ones (32, 64), spans shorter and longer than the 16-key chunks; the same bits as the
// scalar level, and a span's result the same bits alone or beside others.
TEST_P(AttentionLevel, DenseMatchesReferenceScalarBitsAndIsBatchInvariant) {
  for (const int d_head : {16, 32, 64}) {
    const AttentionShape s{8, 2, d_head, float(1.0 / std::sqrt(double(d_head)))};
    const int64_t rows = 71, qd = 8 * d_head, kvd = 2 * d_head;
    const auto q = test::random_floats(rows * qd, 11), k = test::random_floats(rows * kvd, 12),
               v = test::random_floats(rows * kvd, 13);
    const std::vector<cpu::RowSpan> spans = {{0, 1}, {1, 20}, {21, 16}, {37, 34}};
    std::vector<float> out(rows * qd), alone(rows * qd), scalar(rows * qd);
    cpu::attention_dense(s, q.data(), k.data(), v.data(), spans, out.data());
    cpu::force_isa(Isa::Scalar);
    cpu::attention_dense(s, q.data(), k.data(), v.data(), spans, scalar.data());
    cpu::force_isa(GetParam());
    EXPECT_EQ(out, scalar) << "head size " << d_head;
    KvLayerView view;
    view.type = DType::F32;
    view.k = reinterpret_cast<const uint8_t*>(k.data());
    view.v = reinterpret_cast<const uint8_t*>(v.data());
    view.kv_dim = kvd;
    for (const auto& span : spans) {
      std::vector<int32_t> slots;
      for (int64_t j = 0; j < span.n; ++j) slots.push_back(int32_t(span.begin + j));
      std::vector<float> want(qd);
      for (int64_t i = span.begin; i < span.begin + span.n; ++i) {
        ref::attention(s, q.data() + i * qd, view, slots, want.data());
        for (int64_t d = 0; d < qd; ++d) ASSERT_NEAR(out[size_t(i * qd + d)], want[size_t(d)], 1e-5f) << i << " " << d_head;
      }
      const cpu::RowSpan one[] = {span};
      cpu::attention_dense(s, q.data(), k.data(), v.data(), one, alone.data());
      for (int64_t i = span.begin * qd; i < (span.begin + span.n) * qd; ++i) ASSERT_EQ(alone[size_t(i)], out[size_t(i)]);
    }
  }
}

}  // namespace
}  // namespace serval
