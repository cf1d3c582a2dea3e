// The unit of work of cpu::attention_batch (attention.cpp): one query tile (consecutive query
// tokens of one sequence) x one KV head, over a range of the fixed KV chunks. Plain data only: this
// header is included by the per-ISA files, which are compiled with their own instruction-set flags
// and must not instantiate any shared inline or template code (see attention_tile_impl.h).
// The design is described in docs/attention.md.
#pragma once
#include <cstdint>

namespace serval::cpu::attn {

// Keys are processed in tiles of kKeyTile positions and in chunks of kChunk positions, both aligned
// to absolute positions (tile t holds positions [t*kKeyTile, (t+1)*kKeyTile)). Pass 1 computes each
// chunk's softmax statistics (running max and sum), merged in position order; pass 2 each chunk's
// weighted sum of values, added in position order. The boundaries never depend on the batch, so
// neither does a query's arithmetic.
constexpr int kKeyTile = 16;
constexpr int64_t kChunk = 256;
static_assert(kChunk % kKeyTile == 0);

// Rows of a tile: query q's head h of the KV group is row q * group + h; rows are the SIMD lanes.
constexpr int kMaxTileRows = 64;
constexpr int kMaxTileQueries = 16;
// A call split by chunk (flash-decoding) gives each thread about this many tasks a pass (runs of
// chunks of a unit): enough for the pool to balance, few enough that a task's setup stays small.
constexpr int kSplitTasksPerThread = 8;

enum class Mode {
  Full,    // both passes over chunks [c_begin, c_end), then the outputs
  Stats,   // pass 1 on chunks [chunk, chunk_end): their statistics into their states at `partial`
  Values,  // pass 2 on chunks [chunk, chunk_end) (statistics of every chunk from `partial`): their sums
           // into their states
  Sum,     // the outputs: the sums of chunks [c_begin, c_end) from `partial`, in order
};

enum class KvKind { F32, F16, Fp8, Dequant };

struct TileArgs {
  // Shape.
  int n_q = 0;     // queries in the tile (1 .. kMaxTileQueries)
  int group = 0;   // query heads per KV head
  int d_head = 0;
  float scale = 1.0f;
  float softcap = 0.0f;  // > 0: scores become softcap * tanh(score / softcap)
  const float* sinks = nullptr;  // per query head (all n_head): a score without a value; null: none
  bool half = false;  // F16 rounding points (the query, the normalised weights): every cache but F32
  int kv_head = 0;
  // The cache's rows: F32 is read in place; F16 and F8_E4M3 (times `head_scale`) converted by the
  // level's vectors into the tile's scratch; any other type (BF16, Q8_0) is dequantized row by row
  // into it by `dequant` (out-of-line, portable: the values the reference reads).
  KvKind kind = KvKind::F32;
  void (*dequant)(const uint8_t* src, float* dst, int n, float scale) = nullptr;
  float head_scale = 1.0f;
  // Per query of the tile.
  const float* const* q = nullptr;  // each: n_head * d_head floats (heads kv_head*group .. +group)
  float* const* out = nullptr;      // each: n_head * d_head floats
  const int64_t* first = nullptr;   // each query attends positions [first, last]
  const int64_t* last = nullptr;
  // The sequence's keys (shared by every query of the tile).
  const int32_t* blocks = nullptr;
  int32_t block_size = 1;
  const uint8_t* k = nullptr;  // pools [n_slots, kv_dim]
  const uint8_t* v = nullptr;
  int64_t slot_bytes = 0;  // bytes of a slot's row (kv_dim values)
  int64_t head_bytes = 0;  // bytes of one head's part of it (d_head values)
  // Work.
  Mode mode = Mode::Full;
  int64_t c_begin = 0, c_end = 0;  // the chunks of the tile's keys
  int64_t chunk = 0, chunk_end = 0;  // Stats, Values: the chunks to do
  float* partial = nullptr;        // Stats, Values, Sum: the states of chunks [c_begin, c_end), in order
  float* scores = nullptr;         // optional: room for the scores of chunks [c_begin, c_end), in order
                                   // (scores_floats each): pass 2 reads them instead of computing them
  float* scratch = nullptr;        // scratch_floats(...) floats, 64-byte aligned
};

// Lanes per SIMD vector of each level's kernel (rows are padded to a multiple of it).
constexpr int kLanesScalar = 8;
constexpr int kLanesAvx2 = 8;
constexpr int kLanesAvx512 = 16;

// Floats of one chunk state (max, sum and value sum of every row) for lane width w.
static inline int64_t state_floats(int rows, int d_head, int w) {
  const int64_t nv = (rows + w - 1) / w;
  return nv * w * (int64_t(d_head) + 2);
}
// Floats of the scores of one chunk (TileArgs::scores).
static inline int64_t scores_floats(int rows, int w) { return kChunk * ((rows + w - 1) / w) * w; }
// Floats of scratch a kernel of lane width w needs.
static inline int64_t scratch_floats(int rows, int d_head, int w) {
  const int64_t nv = (rows + w - 1) / w;
  // Qt; first, last and 1/L per lane; per-vector first/last; the S/P tile; two states (chunk and
  // running); K and V tile rows; a zero row; for a single query: its sums (rows x dimensions), the
  // keys transposed, a chunk's scores where none are kept (scores_floats) and three floats per row
  // and key tile of a chunk; alignment padding between the parts.
  return 2 * nv * w * int64_t(d_head) + (3 + 3 * (kChunk / kKeyTile)) * nv * w + 2 * nv +
         int64_t(nv) * kKeyTile * w + scores_floats(rows, w) + 2 * state_floats(rows, d_head, w) +
         3 * int64_t(kKeyTile) * d_head + d_head + 16 * 16;
}

// Room for scores kept between the two passes (floats per task, and in all for a call split by
// chunk); where there is none, pass 2 computes the scores again. For tests: both ways give the same
// bits.
void set_score_room(int64_t per_task, int64_t per_call);
int64_t score_room_per_task();
int64_t score_room_per_call();

// The kernels, one per level (attention.cpp, attention_avx2.cpp, attention_avx512.cpp). They give
// bitwise identical results: every lane runs the same IEEE operations in the same order.
void tile_scalar(const TileArgs& a);
void tile_avx2(const TileArgs& a);
void tile_avx512(const TileArgs& a);

// Encoder attention of one (span, head) (attention_dense_impl.h): q, k, v, out point at the head's
// values of the span's first row; rows are q_stride (q, out) and kv_stride (k, v) floats apart.
// scratch holds (d_head + kDenseQueries) x dense_padded(n) floats.
struct DenseArgs {
  const float *q, *k, *v;
  float* out;
  int64_t begin, n, q_stride, kv_stride;
  int d_head;
  float scale;
  float* scratch;
};
inline int64_t dense_padded(int64_t n) { return (n + 15) / 16 * 16; }
constexpr int kDenseQueries = 4;
void dense_head_scalar(const DenseArgs& a);
void dense_head_avx2(const DenseArgs& a);
void dense_head_avx512(const DenseArgs& a);

// Each level's FP8 E4M3 row conversion: dst[i] = value of code src[i] times `scale`, bit for bit the
// value of fp8_e4m3_table() times `scale` (NaN codes give NaN). Used by the kernels; here for tests.
void fp8_row_scalar(const uint8_t* src, float* dst, int n, float scale);
void fp8_row_avx2(const uint8_t* src, float* dst, int n, float scale);
void fp8_row_avx512(const uint8_t* src, float* dst, int n, float scale);

}  // namespace serval::cpu::attn
