#include "quant/gptq.h"

#include <Eigen/Cholesky>
#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "base/thread_pool.h"
#include "tensor/blocks.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ColMat = Eigen::MatrixXf;

// H / rows, with the columns that saw no input marked dead and given a unit diagonal, and `damp` x
// its mean diagonal added.
ColMat damped(const Hessian& hs, float damp, std::vector<char>& dead) {
  const int64_t n = hs.n;
  ColMat a = Eigen::Map<const RowMat>(hs.h.data(), n, n);
  check(a.allFinite(), "GPTQ: the calibration inputs were not finite (the model overflows on this text)");
  a /= float(std::max(1.0, hs.rows));
  dead.assign(size_t(n), 0);
  for (int64_t j = 0; j < n; ++j)
    if (a(j, j) <= 0) dead[size_t(j)] = 1, a.row(j).setZero(), a.col(j).setZero(), a(j, j) = 1;
  const float mean = a.diagonal().mean();
  a.diagonal().array() += damp * mean;
  return a;
}

// The upper-triangular U with U^T U = A^-1, which GPTQ's sequential updates read: with J the
// reversal, J A J = L L^T gives A^-1 = (J L^-1 J)^T (J L^-1 J), J L^-1 J upper triangular.
RowMat inverse_cholesky_upper(const ColMat& a) {
  ColMat reversed = a.reverse();
  Eigen::LLT<ColMat> llt(reversed);
  check(llt.info() == Eigen::Success, "GPTQ: the calibration Hessian is not positive definite (raise --gptq-damp)");
  ColMat inv = ColMat::Identity(a.rows(), a.cols());
  llt.matrixL().solveInPlace(inv);
  return inv.reverse();
}

// The grid one block's stored scales fix: value of code c at element i is scale[i] * c + offset[i].
struct BlockGrid {
  float scale[256], offset[256];
};

void block_grid(DType type, const uint8_t* block, BlockGrid& g) {
  if (is_kquant(type)) {
    BlockK k;
    unpack_block_k(type, block, k);
    for (int s = 0; s < k.n_sub; ++s)
      for (int i = s * k.sub_len; i < (s + 1) * k.sub_len; ++i)
        g.scale[i] = k.d * float(k.scale[s]), g.offset[i] = -(k.dmin * float(k.min[s]));
    return;
  }
  Block32 b;
  unpack_block32(type, block, b);
  for (int i = 0; i < 32; ++i) g.scale[i] = b.d, g.offset[i] = b.m;
}

// The code nearest to `v` on element i's grid (IQ4_NL: the nearest of its levels).
int nearest_code(DType type, const BlockGrid& g, int i, float v, CodeRange range) {
  if (g.scale[i] == 0) return 0;
  const float t = (v - g.offset[i]) / g.scale[i];
  if (type != DType::IQ4_NL) return std::clamp(int(std::lround(t)), range.lo, range.hi);
  const int8_t* levels = iq4nl_levels();
  int best = 0;
  for (int k = 1; k < 16; ++k)
    if (std::fabs(float(levels[k]) - t) < std::fabs(float(levels[best]) - t)) best = k;
  return levels[best];
}

// One row's share of a group of columns [c0, c0 + len), block by block: the block's scales searched
// on the row as it now stands, then each column rounded in turn on their grid, its error
// err_j = (w_j - q_j) / U_jj recorded in `err` and spread over the group's later columns (the later
// groups get it from the caller, as one product).
void quantize_group_row(DType type, float* w, uint8_t* out, int64_t c0, int64_t len, const RowMat& u,
                        const float* importance, float* err) {
  BlockGrid g;
  const CodeRange range = code_range(type);
  const int64_t block = is_kquant(type) ? 256 : 32;
  for (int64_t b0 = 0; b0 < len; b0 += block) {
    uint8_t* bytes = out + row_bytes(type, size_t(b0));
    float total = 0;  // a block whose columns all saw no input is searched unweighted
    for (int64_t i = 0; i < block; ++i) total += importance[b0 + i];
    quantize_row(type, w + b0, bytes, size_t(block), total > 0 ? importance + b0 : nullptr);
    block_grid(type, bytes, g);
    int8_t codes[256];
    for (int64_t i = 0; i < block; ++i) {
      const int64_t j = b0 + i, col = c0 + j;
      codes[i] = int8_t(nearest_code(type, g, int(i), w[j], range));
      const float q = g.scale[i] * float(codes[i]) + g.offset[i];
      err[j] = (w[j] - q) / u(col, col);
      const float* u_row = &u(col, 0);
      for (int64_t k = j + 1; k < len; ++k) w[k] -= err[j] * u_row[c0 + k];
    }
    if (is_kquant(type)) pack_codes_k(type, bytes, codes);
    else pack_codes32(type, bytes, codes);
  }
}

}  // namespace

void Hessian::add(const float* x, int64_t n_rows) {
  Eigen::Map<const RowMat> xs(x, n_rows, n);
  Eigen::Map<RowMat>(h.data(), n, n).noalias() += xs.transpose() * xs;  // Eigen's product, on OpenMP's threads
  rows += double(n_rows);
}

std::vector<float> Hessian::mean_square() const {
  std::vector<float> d(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) d[size_t(j)] = float(double(h[size_t(j * n + j)]) / std::max(1.0, rows));
  return d;
}

bool gptq_supports(DType t) {
  return is_kquant(t) || t == DType::Q8_0 || t == DType::Q4_0 || t == DType::Q4_1 || t == DType::Q5_0 ||
         t == DType::Q5_1 || t == DType::IQ4_NL;
}

std::vector<uint8_t> gptq_quantize(DType type, const float* w, int64_t rows, int64_t cols, const Hessian& hs, float damp,
                                   const std::vector<float>& importance) {
  check(gptq_supports(type), "GPTQ cannot write {}", dtype_info(type).name);
  check(hs.n == cols, "GPTQ: the Hessian is {} wide, the matrix {}", hs.n, cols);
  check(damp >= 0 && std::isfinite(damp), "--gptq-damp must be a non-negative number");
  std::vector<char> dead;
  const RowMat u = inverse_cholesky_upper(damped(hs, damp, dead));
  const std::vector<float> imp = importance.empty() ? hs.mean_square() : importance;
  RowMat work = Eigen::Map<const RowMat>(w, rows, cols);
  for (int64_t j = 0; j < cols; ++j)
    if (dead[size_t(j)]) work.col(j).setZero();
  const size_t out_row = row_bytes(type, size_t(cols));
  std::vector<uint8_t> out(size_t(rows) * out_row);
  const int64_t group = std::min<int64_t>(cols, 256);  // a whole number of blocks of either size
  RowMat err(rows, group);
  const int64_t chunk = 16;  // rows per task
  for (int64_t c0 = 0; c0 < cols; c0 += group) {
    const int64_t len = std::min(group, cols - c0), rest = cols - c0 - len;
    parallel_for((rows + chunk - 1) / chunk, [&](int64_t t) {
      for (int64_t r = t * chunk; r < std::min(rows, (t + 1) * chunk); ++r) {
        uint8_t* o = out.data() + size_t(r) * out_row + row_bytes(type, size_t(c0));
        quantize_group_row(type, &work(r, c0), o, c0, len, u, imp.data() + c0, &err(r, 0));
      }
    });
    if (rest > 0)  // the later columns take the group's errors (Eigen's product, on OpenMP's threads)
      work.rightCols(rest).noalias() -= err.leftCols(len) * u.block(c0, c0 + len, len, rest);
  }
  return out;
}

double gptq_output_error(DType type, const float* w, const uint8_t* q, int64_t rows, int64_t cols, const Hessian& hs) {
  const size_t in_row = row_bytes(type, size_t(cols));
  RowMat e(rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(type, q + size_t(r) * in_row, &e(r, 0), size_t(cols));
    for (int64_t j = 0; j < cols; ++j) e(r, j) = w[size_t(r * cols + j)] - e(r, j);
  }
  const Eigen::MatrixXd h = Eigen::Map<const RowMat>(hs.h.data(), cols, cols).cast<double>();
  const double total = (e.cast<double>() * h).cwiseProduct(e.cast<double>()).sum();
  return total / std::max(1.0, hs.rows);
}

}  // namespace serval
