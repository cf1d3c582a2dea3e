// AWQ-style activation-aware scaling for `serval quantize --method awq` (docs/quantization.md).
// Input channels that carry large activations are scaled up before quantization (s_j = a_j^alpha, a_j
// the channel's RMS activation from the imatrix, normalized), so their weights keep more precision,
// and the inverse scale is folded into what produces those activations: the RMSNorm weights before
// q/k/v and before gate/up, and the rows of ffn_up before ffn_down. The result is a plain GGUF: the
// model computes the same function before rounding. alpha is searched per group of matrices sharing an
// input, on a grid 0, 0.1 .. 1 (0 = no scaling), minimizing the imatrix-weighted output error
// sum_j E[x_j^2] (w_j - q(w s)_j / s_j)^2 of the quantized rows (a sample of them).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "quant/quantize_model.h"

namespace serval {

class GgufFile;
struct Imatrix;

// Per tensor: multiply column j by col_mul[j] (weights), divide element j of a 1-D tensor by
// col_div[j] (norms), divide row r by row_div[r] (ffn_up). Empty vectors: nothing.
struct ChannelRescale {
  std::vector<float> col_mul, col_div, row_div;
};

struct AwqPlan {
  std::map<std::string, ChannelRescale> rescale;
  std::vector<std::pair<std::string, float>> alphas;  // group (its first weight's name) -> chosen alpha
};

// The scales for `choices` (the quantized tensors and their types). Llama and Qwen2 only; throws Error
// for another architecture or a group the imatrix has no entry for.
AwqPlan awq_plan(const GgufFile& in, const std::vector<TensorChoice>& choices, const Imatrix& im);

}  // namespace serval
