// GPTQ-style quantization for `serval quantize --method gptq` (docs/quantization.md): each weight
// matrix is rounded column by column, and the rounding error of each column is spread over the
// columns not yet rounded so that the layer's output on the calibration inputs changes least
// (Frantar et al., "GPTQ", 2022; the error model is Optimal Brain Surgeon's). The result is stored in
// an ordinary GGUF type: for each block (32 columns, or a 256-column k-quant super-block) the type's
// own search picks the scales from the values as they stand when the block's turn comes; the columns
// of the block are then rounded one by one on the grid those scales fix.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/ggml_types.h"

namespace serval {

// The second moment of a matrix's inputs: sum over input rows x of x x^T (n x n, symmetric), and the
// number of rows added.
struct Hessian {
  explicit Hessian(int64_t n_) : n(n_), h(size_t(n_ * n_), 0.0f) {}
  int64_t n;
  std::vector<float> h;  // row-major
  double rows = 0;

  // Adds x[n_rows][n].
  void add(const float* x, int64_t n_rows);
  // Each column's mean square input (the diagonal over the row count): an imatrix's importance.
  std::vector<float> mean_square() const;
};

// By weight name; matrices that share their input (q/k/v, gate/up) share one Hessian.
using HessianSet = std::map<std::string, std::shared_ptr<Hessian>>;
// The Hessian of a weight by name, or null when there is none; asked for in the order the weights are
// quantized (a source may measure them a few layers at a time).
using HessianSource = std::function<std::shared_ptr<const Hessian>(const std::string& weight_name)>;

// Whether gptq_quantize can write `type` (the integer block types: Q4_0 .. Q8_0, IQ4_NL, Q2_K .. Q6_K).
bool gptq_supports(DType type);

// Quantizes w[rows][cols] to `type` (rows of row_bytes(type, cols) bytes). `damp`: added to the
// Hessian's diagonal as a fraction of its mean (GPTQ's percdamp; 0.01). `importance`: each column's
// weight in the per-block scale search (empty: the Hessian's mean squares). Columns that never saw
// a non-zero input are quantized as zeros. Throws Error for a type gptq_supports refuses.
std::vector<uint8_t> gptq_quantize(DType type, const float* w, int64_t rows, int64_t cols, const Hessian& h,
                                   float damp = 0.01f, const std::vector<float>& importance = {});

// The error GPTQ minimizes: the mean over calibration rows x of |x (W - Q)^T|^2, that is
// sum over weight rows r of (w_r - q_r) H (w_r - q_r)^T / h.rows, for `q` of `type`.
double gptq_output_error(DType type, const float* w, const uint8_t* q, int64_t rows, int64_t cols, const Hessian& h);

}  // namespace serval
