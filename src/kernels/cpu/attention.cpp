// Attention over the paged KV cache: flash-style (tiled over keys, online softmax), reading K and V
// in place in the cache, with the query heads of a KV group and the consecutive queries of a
// sequence sharing every key read. The kernel is attention_tile_impl.h (one per ISA level); this
// file forms the query tiles, splits the work over the compute pool and holds the portable level.
// Design, semantics and figures: docs/attention.md.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "base/error.h"
#include "base/thread_pool.h"
#include "kernels/cpu/attention_dense_impl.h"
#include "kernels/cpu/attention_tile.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "tensor/dequant.h"

// The portable kernel. This file is compiled with the baseline flags (and -ffp-contract=off, so the
// compiler never fuses a multiply and an add the SIMD levels do separately).
#include "kernels/cpu/attention_tile_impl.h"

namespace serval {
namespace cpu {
namespace attn {
namespace {

// Lane by lane, the same IEEE operations as the SIMD policies (max/min with the x86 semantics,
// fused multiply-adds through std::fma, F16 rounding to nearest even).
struct VScalar {
  static constexpr int W = kLanesScalar;
  static constexpr int kRowVectors = 1;
  static constexpr int kPvRows = 1, kPvDims = 1;  // pv_single: rows x vectors of dimensions per call
  static constexpr int kQkRows = 1;                // qk_single: rows per call
  struct T {
    float v[W];
  };
  struct M {
    bool b[W];
  };
  static constexpr bool kKeysInRegisters = false;  // single-query scores read transpose_keys' rows
  static T zero() { return set1(0.0f); }
  static T set1(float x) {
    T r;
    for (int i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  static T load(const float* p) {
    T r;
    std::memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static T load(const uint16_t* p) {  // F16 values, converted
    T r;
    for (int i = 0; i < W; ++i) r.v[i] = fp16_to_f32(p[i]);
    return r;
  }
  static void store(float* p, T x) { std::memcpy(p, x.v, sizeof x.v); }
  template <class F>
  static T map(T a, T b, F f) {
    T r;
    for (int i = 0; i < W; ++i) r.v[i] = f(a.v[i], b.v[i]);
    return r;
  }
  static T add(T a, T b) { return map(a, b, [](float x, float y) { return x + y; }); }
  static T sub(T a, T b) { return map(a, b, [](float x, float y) { return x - y; }); }
  static T mul(T a, T b) { return map(a, b, [](float x, float y) { return x * y; }); }
  static T div(T a, T b) { return map(a, b, [](float x, float y) { return x / y; }); }
  static T max(T a, T b) { return map(a, b, [](float x, float y) { return x > y ? x : y; }); }
  static T min(T a, T b) { return map(a, b, [](float x, float y) { return x < y ? x : y; }); }
  static T fma(T a, T b, T c) {
    T r;
    for (int i = 0; i < W; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
  static M le(T a, T b) {
    M m;
    for (int i = 0; i < W; ++i) m.b[i] = a.v[i] <= b.v[i];
    return m;
  }
  static M lt(T a, T b) {
    M m;
    for (int i = 0; i < W; ++i) m.b[i] = a.v[i] < b.v[i];
    return m;
  }
  static M mand(M a, M b) {
    M m;
    for (int i = 0; i < W; ++i) m.b[i] = a.b[i] && b.b[i];
    return m;
  }
  static T select(M m, T t, T f) {
    T r;
    for (int i = 0; i < W; ++i) r.v[i] = m.b[i] ? t.v[i] : f.v[i];
    return r;
  }
  static T mask_fma(M m, T a, T b, T c) {
    T r;
    for (int i = 0; i < W; ++i) r.v[i] = m.b[i] ? std::fma(a.v[i], b.v[i], c.v[i]) : c.v[i];
    return r;
  }
  static T pow2i(T n) {  // n integral in [-127, 127]
    T r;
    for (int i = 0; i < W; ++i) {
      const uint32_t bits = uint32_t(int32_t(n.v[i]) + 127) << 23;
      std::memcpy(&r.v[i], &bits, 4);
    }
    return r;
  }
  // Lane j of the result holds lane j + k of x (j < k); the others are left as they were.
  static T fold(T x, int k) {
    T r = x;
    for (int i = 0; i + k < W; ++i) r.v[i] = x.v[i + k];
    return r;
  }
  static float lane0(T x) { return x.v[0]; }
  static void transpose_keys(const float* const* rows, int D, float* out) {
    for (int d = 0; d < D; ++d)
      for (int j = 0; j < 16; ++j) out[int64_t(d) * 16 + j] = rows[j][d];
  }
  static void transpose_keys(const uint16_t* const* rows, int D, float* out) {
    for (int d = 0; d < D; ++d)
      for (int j = 0; j < 16; ++j) out[int64_t(d) * 16 + j] = fp16_to_f32(rows[j][d]);
  }
  static T f16_round(T x) {
    T r;
    for (int i = 0; i < W; ++i) r.v[i] = fp16_to_f32(f32_to_fp16(x.v[i]));
    return r;
  }
  static void prefetch(const void* p) { __builtin_prefetch(p, 0, 1); }
  static void cvt_f16_row(const uint16_t* src, float* dst, int n) {
    for (int i = 0; i < n; ++i) dst[i] = fp16_to_f32(src[i]);
  }
  static void cvt_fp8_row(const uint8_t* src, float* dst, int n, float scale) {
    const float* t = fp8_e4m3_table();
    for (int i = 0; i < n; ++i) dst[i] = t[src[i]] * scale;
  }
};

}  // namespace

void tile_scalar(const TileArgs& a) { run_tile<VScalar>(a); }
void dense_head_scalar(const DenseArgs& a) { dense_head_any(a); }
void fp8_row_scalar(const uint8_t* src, float* dst, int n, float scale) { VScalar::cvt_fp8_row(src, dst, n, scale); }

namespace {

struct Kernel {
  void (*fn)(const TileArgs&);
  int lanes;
};

// The kernel of the active level. Amx has no attention kernel of its own (its tiles multiply BF16
// or INT8, which would change the F16/F32 arithmetic): it runs the AVX-512 one.
Kernel active_kernel() {
  switch (active_isa()) {
    case Isa::Scalar: return {tile_scalar, kLanesScalar};
    case Isa::Avx2: return {tile_avx2, kLanesAvx2};
    case Isa::Avx512:
    case Isa::Amx: return {tile_avx512, kLanesAvx512};
  }
  return {tile_scalar, kLanesScalar};
}

// Per thread, 64-byte aligned, kept from call to call: the kernel's scratch (slot 0) and room for
// scores (slot 1) of a task; a split call's chunk states (slot 2) and kept scores (slot 3), on the
// calling thread. Never cleared: every float is written before it is read.
enum BufferSlot { kScratch, kTaskScores, kCallStates, kCallScores, kSlots };
float* thread_buffer(int slot, int64_t n) {
  thread_local std::unique_ptr<float[]> buf[kSlots];
  thread_local int64_t cap[kSlots] = {0, 0, 0, 0};
  if (cap[slot] < n) {
    cap[slot] = n;
    buf[slot].reset(new float[size_t(n + 16)]);
  }
  const auto p = reinterpret_cast<uintptr_t>(buf[slot].get());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// Floats of scores kept between the passes, per task and in all for a split call: beyond this pass
// 2 computes them again (the same values; only the cost differs).
std::atomic<int64_t> g_task_scores{int64_t(1) << 20}, g_call_scores{int64_t(1) << 22};

// Rows of the types the kernels do not convert themselves, dequantized as KvLayerView::load does (the
// reference's values): the same functions.
void dequant_bf16(const uint8_t* src, float* dst, int n, float) { dequantize_row(DType::BF16, src, dst, size_t(n)); }
void dequant_q8_0(const uint8_t* src, float* dst, int n, float) { dequantize_row(DType::Q8_0, src, dst, size_t(n)); }

using DequantFn = void (*)(const uint8_t*, float*, int, float);
DequantFn dequant_fn(DType type) {
  switch (type) {
    case DType::BF16: return dequant_bf16;
    case DType::Q8_0: return dequant_q8_0;
    default: return nullptr;
  }
}

// A query tile: queries [begin, begin + n) of the call.
struct Tile {
  int64_t begin = 0;
  int n = 0;
  int64_t lo = 0, hi = 0;  // positions attended by any of them: [first of the first, last of the last]
};

// Whether query b may join the tile whose last query is a: same sequence (the same block table),
// the next position, and a window that does not leave a gap in the tile's keys.
bool same_run(const AttentionQuery& a, const AttentionQuery& b) {
  return a.keys.blocks.data() == b.keys.blocks.data() && a.keys.blocks.size() == b.keys.blocks.size() &&
         a.keys.block_size == b.keys.block_size && b.keys.last == a.keys.last + 1 && b.keys.first >= a.keys.first &&
         b.keys.first <= a.keys.last + 1;
}

}  // namespace

void set_score_room(int64_t per_task, int64_t per_call) {
  g_task_scores.store(per_task, std::memory_order_relaxed);
  g_call_scores.store(per_call, std::memory_order_relaxed);
}
int64_t score_room_per_task() { return g_task_scores.load(std::memory_order_relaxed); }
int64_t score_room_per_call() { return g_call_scores.load(std::memory_order_relaxed); }

}  // namespace attn

namespace {

// attention_batch but for V's rotation (KvLayerView::v_rotated).
void attention_batch_stored(const AttentionShape& s, std::span<const AttentionQuery> queries, KvLayerView kv) {
  using namespace attn;
  if (queries.empty()) return;
  check(s.n_head_kv > 0 && s.n_head % s.n_head_kv == 0 && s.d_head > 0, "attention: bad head shape");
  check(kv.type == DType::F16 || kv.type == DType::F32 || kv.type == DType::BF16 || kv.type == DType::Q8_0 ||
            kv.type == DType::F8_E4M3,
        "attention: the KV cache must be F32, F16, BF16, Q8_0 or F8_E4M3");
  check(kv.type != DType::Q8_0 || s.d_head % 32 == 0, "attention: a Q8_0 cache needs d_head a multiple of 32");
  const KvKind kind = kv.type == DType::F32       ? KvKind::F32
                      : kv.type == DType::F16     ? KvKind::F16
                      : kv.type == DType::F8_E4M3 ? KvKind::Fp8
                                                  : KvKind::Dequant;
  const int64_t slot_bytes = int64_t(row_bytes(kv.type, size_t(kv.kv_dim)));
  const int64_t head_bytes = int64_t(row_bytes(kv.type, size_t(s.d_head)));
  const int group = s.n_head / s.n_head_kv;
  const int max_q = std::clamp(kMaxTileRows / group, 1, kMaxTileQueries);

  // Query tiles: runs of consecutive positions of one sequence. Empty spans give zeros.
  std::vector<Tile> tiles;
  for (size_t i = 0; i < queries.size(); ++i) {
    const AttentionQuery& q = queries[i];
    if (q.keys.size() <= 0) {
      std::fill(q.out, q.out + int64_t(s.n_head) * s.d_head, 0.0f);
      continue;
    }
    check(q.keys.first >= 0 && q.keys.last < (int64_t(1) << 24), "attention: positions beyond 2^24");
    if (!tiles.empty()) {
      Tile& t = tiles.back();
      if (t.begin + t.n == int64_t(i) && t.n < max_q && same_run(queries[i - 1], q)) {
        ++t.n;
        t.hi = q.keys.last;
        continue;
      }
    }
    tiles.push_back({int64_t(i), 1, q.keys.first, q.keys.last});
  }
  if (tiles.empty()) return;

  const Kernel kernel = active_kernel();
  const int64_t n_units = int64_t(tiles.size()) * s.n_head_kv;
  // A unit's chunks are those holding any of its positions.
  auto c_first = [&](const Tile& t) { return t.lo / kChunk; };
  auto c_last = [&](const Tile& t) { return t.hi / kChunk; };

  // Flat per-query arrays the kernel reads.
  std::vector<const float*> qp(queries.size());
  std::vector<float*> op(queries.size());
  std::vector<int64_t> first(queries.size()), last(queries.size());
  for (size_t i = 0; i < queries.size(); ++i) {
    qp[i] = queries[i].q, op[i] = queries[i].out;
    first[i] = queries[i].keys.first, last[i] = queries[i].keys.last;
  }
  auto args = [&](const Tile& t, int kv_head) {
    const AttentionQuery& q0 = queries[t.begin];
    TileArgs a;
    a.n_q = t.n, a.group = group, a.d_head = s.d_head, a.scale = s.scale, a.softcap = s.softcap, a.sinks = s.sinks, a.half = kv.type != DType::F32;
    a.kv_head = kv_head;
    a.kind = kind, a.dequant = dequant_fn(kv.type);
    a.head_scale = kv.type == DType::F8_E4M3 && kv.head_scale ? kv.head_scale[kv_head] : 1.0f;
    a.q = qp.data() + t.begin, a.out = op.data() + t.begin;
    a.first = first.data() + t.begin, a.last = last.data() + t.begin;
    a.blocks = q0.keys.blocks.data(), a.block_size = q0.keys.block_size;
    a.k = kv.k, a.v = kv.v, a.slot_bytes = slot_bytes, a.head_bytes = head_bytes;
    a.scratch = thread_buffer(kScratch, scratch_floats(t.n * group, s.d_head, kernel.lanes));
    return a;
  };

  // Few units (decode of a few sequences at long context): each pass is split by chunk
  // (flash-decoding): a task per (unit, chunk) for pass 1, the same for pass 2 (each task merging
  // the unit's chunk statistics itself), then a task per unit adding up its chunks. Otherwise a task
  // per unit. Both run the same chunks and the same merges in the same order: the results are the
  // same bits.
  auto n_chunks = [&](const Tile& t) { return c_last(t) - c_first(t) + 1; };
  auto state_of = [&](const Tile& t) { return state_floats(t.n * group, s.d_head, kernel.lanes); };
  const int threads = pool_threads();
  int64_t n_tasks = 0, n_floats = 0;
  for (const Tile& t : tiles) {
    n_tasks += n_chunks(t) * s.n_head_kv;
    n_floats += n_chunks(t) * s.n_head_kv * state_of(t);
  }
  const bool split = threads > 1 && n_units < 4 * threads && n_tasks > n_units && n_floats <= (int64_t(1) << 24);

  if (!split) {
    // Largest first (dynamic claiming then balances the tail).
    std::vector<int64_t> order(n_units);
    for (int64_t u = 0; u < n_units; ++u) order[u] = u;
    auto cost = [&](int64_t u) { const Tile& t = tiles[u / s.n_head_kv]; return t.n * (t.hi - t.lo + 1); };
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost(x) > cost(y); });
    parallel_for(n_units, [&](int64_t i) {
      const int64_t u = order[i];
      const Tile& t = tiles[u / s.n_head_kv];
      TileArgs a = args(t, int(u % s.n_head_kv));
      a.mode = Mode::Full, a.c_begin = c_first(t), a.c_end = c_last(t) + 1;
      const int64_t room = n_chunks(t) * scores_floats(t.n * group, kernel.lanes);
      if (room <= g_task_scores.load(std::memory_order_relaxed)) a.scores = thread_buffer(kTaskScores, room);
      kernel.fn(a);
    });
    return;
  }

  // Split: task k -> (unit, chunk); each unit's chunk states stored in chunk order.
  std::vector<int64_t> unit_float(n_units + 1, 0), unit_score(n_units + 1, 0);
  for (int64_t u = 0; u < n_units; ++u) {
    const Tile& t = tiles[u / s.n_head_kv];
    unit_float[u + 1] = unit_float[u] + n_chunks(t) * state_of(t);
    unit_score[u + 1] = unit_score[u] + n_chunks(t) * scores_floats(t.n * group, kernel.lanes);
  }
  float* states = thread_buffer(kCallStates, unit_float[n_units]);
  const bool keep = unit_score[n_units] <= g_call_scores.load(std::memory_order_relaxed);
  float* kept = keep ? thread_buffer(kCallScores, unit_score[n_units]) : nullptr;
  // A task takes a run of `per_task` chunks of one unit, enough runs for kSplitTasksPerThread a thread
  // (each task transposes its queries and, in pass 2, merges its unit's statistics once, so fewer and
  // longer tasks cost less). Tasks in chunk order across a tile's KV heads (k -> unit, first chunk):
  // the pool hands out runs of consecutive tasks, so one thread tends to read all heads of a chunk's
  // slot rows.
  const int64_t per_task = std::max<int64_t>(1, n_tasks / (kSplitTasksPerThread * threads));
  std::vector<int64_t> task_unit, task_chunk, task_end;
  for (size_t ti = 0; ti < tiles.size(); ++ti)
    for (int64_t c = c_first(tiles[ti]); c <= c_last(tiles[ti]); c += per_task)
      for (int h = 0; h < s.n_head_kv; ++h) {
        task_unit.push_back(int64_t(ti) * s.n_head_kv + h);
        task_chunk.push_back(c);
        task_end.push_back(std::min(c + per_task, c_last(tiles[ti]) + 1));
      }
  auto unit_args = [&](int64_t u, Mode mode) {
    const Tile& t = tiles[u / s.n_head_kv];
    TileArgs a = args(t, int(u % s.n_head_kv));
    a.mode = mode, a.c_begin = c_first(t), a.c_end = c_last(t) + 1;
    a.partial = states + unit_float[u];
    if (keep) a.scores = kept + unit_score[u];
    return a;
  };
  for (Mode mode : {Mode::Stats, Mode::Values})
    parallel_for(int64_t(task_unit.size()), [&](int64_t k) {
      TileArgs a = unit_args(task_unit[k], mode);
      a.chunk = task_chunk[k], a.chunk_end = task_end[k];
      kernel.fn(a);
    });
  parallel_for(n_units, [&](int64_t u) { kernel.fn(unit_args(u, Mode::Sum)); });
}

}  // namespace

void attention_batch(const AttentionShape& s, std::span<const AttentionQuery> queries, KvLayerView kv) {
  attention_batch_stored(s, queries, kv);
  if (!kv.v_rotated) return;
  parallel_for(int64_t(queries.size()), [&](int64_t i) {
    for (int h = 0; h < s.n_head; ++h) hadamard_rotate(queries[i].out + int64_t(h) * s.d_head, s.d_head);
  });
}

// One query: a batch of one over `slots` as a block table of block size 1.
void attention(const AttentionShape& s, const float* q, KvLayerView kv, std::span<const int32_t> slots, float* out) {
  const AttentionQuery query{q, KvSpan{slots, 1, 0, int64_t(slots.size()) - 1}, out};
  attention_batch(s, std::span<const AttentionQuery>(&query, 1), kv);
}

// One task per (span, head), run by the active level's dense_head (attention_dense_impl.h; Amx runs the
// AVX-512 one): a span's result does not depend on the other spans, and every level gives the same bits.
void attention_dense(const AttentionShape& s, const float* q, const float* k, const float* v, std::span<const RowSpan> spans,
                     float* out) {
  check(s.n_head_kv > 0 && s.n_head % s.n_head_kv == 0 && s.d_head > 0, "attention: bad head shape");
  check(s.softcap == 0.0f && !s.sinks, "attention_dense: soft-capping and sinks are not implemented for encoders");
  const int64_t q_stride = int64_t(s.n_head) * s.d_head, kv_stride = int64_t(s.n_head_kv) * s.d_head;
  const int group = s.n_head / s.n_head_kv;
  const Isa level = active_isa();
  void (*head)(const attn::DenseArgs&) = level >= Isa::Avx512 ? attn::dense_head_avx512
                                         : level == Isa::Avx2 ? attn::dense_head_avx2
                                                              : attn::dense_head_scalar;
  parallel_for(int64_t(spans.size()) * s.n_head, [&](int64_t task) {
    const RowSpan span = spans[size_t(task / s.n_head)];
    const int h = int(task % s.n_head), g = h / group;
    thread_local std::vector<float> scratch;  // the worker's
    scratch.resize(size_t((s.d_head + attn::kDenseQueries) * attn::dense_padded(span.n)));
    head({q + int64_t(h) * s.d_head, k + int64_t(g) * s.d_head, v + int64_t(g) * s.d_head, out + int64_t(h) * s.d_head,
          span.begin, span.n, q_stride, kv_stride, s.d_head, s.scale, scratch.data()});
  });
}

}  // namespace cpu
}  // namespace serval
