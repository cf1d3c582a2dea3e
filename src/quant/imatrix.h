// Importance matrices: per weight matrix, the sums of squared input activations of each column,
// gathered by `serval imatrix` and used by `serval quantize --imatrix`. Both of llama.cpp's file
// formats are read and written, so files move between the tools (docs/quantization.md):
//  - GGUF: general.type = "imatrix", imatrix.datasets / chunk_count / chunk_size, and per matrix the
//    tensors "<name>.in_sum2" (F32, [n_per_row, n_mat]) and "<name>.counts" (F32, [1, n_mat]);
//  - the older .dat: entry count, then per entry its name, ncall and the values (mean square x ncall),
//    then the chunk count and the dataset name.
#pragma once
#include <map>
#include <string>
#include <vector>

namespace serval {

struct ImatrixEntry {
  std::vector<double> sum2;    // [n_mat * n_per_row] sums of x^2 per column
  std::vector<double> counts;  // [n_mat] activation rows seen per matrix
  int64_t n_per_row() const { return counts.empty() ? 0 : int64_t(sum2.size() / counts.size()); }
};

struct Imatrix {
  std::map<std::string, ImatrixEntry> entries;  // by weight name ("blk.0.attn_q.weight")
  std::vector<std::string> datasets;
  int chunk_count = 0, chunk_size = 0;

  // Adds the rows x[n_rows][cols] that multiplied matrix `mat` of weight `name`, a stack of n_mat
  // matrices (the experts of a 3-D ffn_*_exps tensor; 1 for a plain matrix).
  void add(const std::string& name, const float* x, int64_t n_rows, int64_t cols, int64_t mat = 0, int64_t n_mat = 1);
  // llama-quantize's importance of each column of each of the n_mat matrices of `name` ([n_mat][cols]):
  // the mean square activation (1 for a matrix that saw no rows, as an expert no token chose); empty
  // when the weight has no entry. Throws Error when the entry's shape is not n_mat x cols.
  std::vector<float> importance(const std::string& name, int64_t cols, int64_t n_mat = 1) const;
};

// Reads either format (GGUF by its magic); throws Error naming the file and the problem.
Imatrix load_imatrix(const std::string& path);
// Writes the GGUF format, or the .dat one when `dat` (through a temporary file renamed at the end).
void save_imatrix(const Imatrix& m, const std::string& path, bool dat);

}  // namespace serval
