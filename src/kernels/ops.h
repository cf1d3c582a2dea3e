// Backend-neutral op signatures: the only kernel header model/ sees.
// Every op here has a scalar reference in ref/ (the test oracle) and a fast CPU version in cpu/.
// Batch invariance: each output row is computed in a fixed order that does not depend on how many
// rows (tokens) are in the call.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "io/ggml_types.h"

namespace serval {
namespace cpu {
struct PackedWeights;
struct PackedFloatWeights;
}

// A weight matrix of `rows` x `cols` in any supported type; each row is `cols` contiguous elements.
struct WeightMatrix {
  DType type = DType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;
  size_t row_stride = 0;  // bytes between rows
  // The same matrix repacked for the CPU GEMM (cpu::prepare_weights), when its type has a layout.
  std::shared_ptr<const cpu::PackedWeights> packed;
  // F16 / BF16 matrices repacked for the float GEMM (cpu::prepare_weights; kernels/cpu/gemm_float.h).
  std::shared_ptr<const cpu::PackedFloatWeights> packed_float;
  // The matrix rounded to BF16 for the CPU's BF16 matrix tiles (cpu::prepare_bf16_tiles), when asked.
  std::shared_ptr<const cpu::PackedFloatWeights> tiles_bf16;
  bool empty() const { return data == nullptr; }
};

// Keys and values of one layer for attention: pools of `kv_dim` elements per slot, F32 or F16.
// With F16 the query and the attention weights are rounded to F16 before their products, as
// llama.cpp does with its default F16 cache (so the two agree to float rounding).
struct KvLayerView {
  DType type = DType::F32;
  const uint8_t* k = nullptr;  // [n_slots, kv_dim]
  const uint8_t* v = nullptr;  // [n_slots, kv_dim]
  int64_t kv_dim = 0;
  // FP8 (F8_E4M3) caches: the stored value times the scale of its KV head (d_head values per head);
  // null: 1. Fixed per layer and head (never computed from a batch), so stored bytes and the values
  // read back never depend on what else was in the batch.
  int64_t d_head = 0;
  const float* head_scale = nullptr;
  // FP8 caches store each head's V values rotated by the orthonormal Walsh-Hadamard transform
  // (hadamard_rotate), which spreads them evenly over the head, so that small values stay out of
  // E4M3's subnormal range; attention rotates its weighted sum of V back, so its output is the same
  // function as without the rotation (docs/quantization.md). K is stored as it is.
  bool v_rotated = false;

  // Copies `n` elements of slot `slot` starting at element `offset` of K (or V) into `out` as floats.
  // Types: F32, F16, BF16, Q8_0 (offset and n multiples of 32), F8_E4M3 (one KV head at most).
  void load(const uint8_t* pool, int32_t slot, int64_t offset, int64_t n, float* out) const;
};

// The keys one query attends: positions [first, last] of a sequence whose KV slots are found through
// its block table (slot = blocks[p / block_size] * block_size + p % block_size), in position order.
struct KvSpan {
  std::span<const int32_t> blocks;
  int32_t block_size = 1;
  int64_t first = 0;
  int64_t last = -1;
  int64_t size() const { return last - first + 1; }
  int32_t slot(int64_t p) const { return blocks[p / block_size] * block_size + int32_t(p % block_size); }
};

// One query token of a batched attention call: its n_head query rows, its keys, its output rows.
struct AttentionQuery {
  const float* q = nullptr;
  KvSpan keys;
  float* out = nullptr;
};

// The orthonormal Walsh-Hadamard transform of x[n] in place (n a power of two); its own inverse.
void hadamard_rotate(float* x, int64_t n);

struct AttentionShape {
  int n_head = 0;
  int n_head_kv = 0;
  int d_head = 0;
  float scale = 1.0f;
  // > 0: scores soft-capped to softcap * tanh(score / softcap) before the softmax (Gemma 2).
  float softcap = 0.0f;
  // Attention sinks (gpt-oss): n_head learned logits, each joining its head's softmax as one more
  // score with no value (it only adds exp(sink - max) to the denominator); null: none.
  const float* sinks = nullptr;
};

namespace ref {
// y[t, r] = sum_c W[r, c] * x[t, c] for t < n_tok, with llama.cpp's semantics: each activation row is
// first put in the format its weight type is multiplied with (act_quant.h), then dotted per block.
void matmul(const WeightMatrix& w, const float* x, float* y, int64_t n_tok);
// Attention of one query token over the keys in `slots` (in position order).
void attention(const AttentionShape& s, const float* q, KvLayerView kv, std::span<const int32_t> slots, float* out);
}  // namespace ref
namespace cpu {
struct LoraSegment;
}
namespace ref {
// cpu::lora_update's reference: each product summed in double.
void lora_update(std::span<const cpu::LoraSegment> segments, int64_t in, int64_t out, const float* x, float* y);
}  // namespace ref

namespace cpu {
// Repacks `w` for the GEMM kernels when its type has a packed layout (once, at load); a no-op
// otherwise. Results of matmul are the same function of the inputs either way, to float rounding.
void prepare_weights(WeightMatrix& w);
// Where the CPU multiplies BF16 in matrix tiles (the Amx level with AMX-BF16), also keeps `w` rounded
// to BF16 for them (kernels/cpu/gemm_float.h); matmul then runs it that way at that level, for every
// token count. A different arithmetic from the other levels' (BF16 weights and activations, float sums
// over the whole K; tested against a double sum of the same BF16 values within a bound), still batch
// invariant: for models whose results are not held bitwise across levels (encoders, docs/kernels.md).
// F32 matrices stay exact (a no-op), as does everything on CPUs without the tiles.
void prepare_bf16_tiles(WeightMatrix& w);
// Same contract as ref::matmul; SIMD and threaded. Packed matrices run the register-tiled GEMM of
// the active ISA level (isa.h); other types dot rows with vec_dot_rows or float dots.
void matmul(const WeightMatrix& w, const float* x, float* y, int64_t n_tok);
// One product of matmul_many: y = W x.
struct MatmulOut {
  const WeightMatrix* w = nullptr;
  float* y = nullptr;
  const float* bias = nullptr;  // when set, y = W x + bias (w->rows values), added in the product's job
  bool gelu_erf = false;        // then y = GELU(y) (gelu_erf_inplace), in the product's job too
};
// Several matrices applied to the same activations (Q/K/V, gate/up): each as matmul, with the
// activations quantized once per format and every product's tasks in one parallel job.
void matmul_many(std::span<const MatmulOut> outs, const float* x, int64_t n_tok);
// Same contract as ref::attention.
void attention(const AttentionShape& s, const float* q, KvLayerView kv, std::span<const int32_t> slots, float* out);
// Every query of a batch, each as ref::attention over its KvSpan, on the compute pool. A query's
// result does not depend on the other queries of the call (batch invariance).
void attention_batch(const AttentionShape& s, std::span<const AttentionQuery> queries, KvLayerView kv);
// Attention without a cache or a mask (encoders): each query row of a span attends every key row of
// that span. q and out are [rows][n_head * d_head], k and v [rows][n_head_kv * d_head]; spans are
// [begin, begin + n) row ranges. Same function as ref::attention over an F32 view of the span's rows,
// to float rounding; a span's result does not depend on the other spans (batch invariance).
struct RowSpan {
  int64_t begin = 0, n = 0;
};
void attention_dense(const AttentionShape& s, const float* q, const float* k, const float* v, std::span<const RowSpan> spans,
                     float* out);
// Fixed-order dot product of two float vectors.
float dot(const float* a, const float* b, int64_t n);
// LoRA updates, each adapter's tokens one segment (Punica / S-LoRA): y[t] += factor * B (A x[t]) for
// every token t of a segment, A [rank][in] and B transposed [rank][out] in F32; x rows have `in`
// values, y rows `out`. Each adapter's matrices are read once per call however many tokens it has.
// Threaded on the compute pool, SIMD at the active ISA level (kernels/cpu/lora*.cpp); a token's update
// is computed in an order that depends only on its own row and the shapes (batch invariance). Same
// function as ref::lora_update, to float rounding.
struct LoraSegment {
  const float* a = nullptr;
  const float* bt = nullptr;
  int64_t rank = 0;
  std::span<const int64_t> tokens;  // rows of x and y
  std::span<const float> factors;   // per token: the user's scale * alpha / rank
};
void lora_update(std::span<const LoraSegment> segments, int64_t in, int64_t out, const float* x, float* y);
// Gated activations of the feed-forward block: out[i] = act(gate[i]) * up[i] for i < n, act = SiLU
// (x * sigmoid(x)) or GELU in its tanh form (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))). Vectorised
// at the active ISA level (kernels/cpu/glu*.cpp), within 10 float ulps (plus the error of GELU's
// argument) of the exact formula; act(-inf) = -0, act(+inf) = +inf, act(NaN) = NaN. `out` may be
// `gate` or `up`. A lane's result does not depend on n or its position.
enum class GluKind { Silu, GeluTanh };
void glu(GluKind kind, const float* gate, const float* up, float* out, int64_t n);
// gpt-oss's SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) g sigmoid(alpha g).
// Written as the level's SiLU GLU of (alpha g, (u + 1) / alpha), after one clamping pass. out may be gate.
void glu_oai(const float* gate, const float* up, float* out, int64_t n, float alpha, float limit);
// x[i] = GELU in its erf form (BERT's "gelu"), in place. The scalar level is gelu_erf (std::erf); the
// SIMD levels use Abramowitz & Stegun's erf (7.1.26, as PyTorch's vectorized erf), within
// 0.5 |x| 1.5e-7 plus float rounding of it (kernels/cpu/glu_avx2.cpp). A lane's result does not depend
// on n or its position. With `bias`, x[i] = GELU(x[i] + bias[i]) (the sum rounded to float first).
void gelu_erf_inplace(float* x, int64_t n, const float* bias = nullptr);
}  // namespace cpu

// Small elementwise ops, one implementation (they are their own reference).
void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps);
// LayerNorm: (x - mean) / sqrt(var + eps) * w + b (biased variance; sums in double). `out` may be `x`.
void layer_norm(const float* x, const float* w, const float* b, float* out, int64_t n, float eps);
// GELU in its exact form, 0.5 x (1 + erf(x / sqrt 2)) (BERT's "gelu"), as 0.5 x erfc(-x / sqrt 2) in double.
float gelu_erf(float x);
void softmax_inplace(float* x, int64_t n);
float silu(float x);
float gelu_tanh(float x);
// Copies row `row` of `w` into `out` as floats.
void get_row(const WeightMatrix& w, int64_t row, float* out);

}  // namespace serval
