// `serval quantize`: a GGUF file to another tensor type, choosing each tensor's type the way
// llama.cpp's `llama-quantize` does (docs/quantization.md), so that without an importance matrix the
// same input and file type give the same tensor types and bytes.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "io/ggml_types.h"
#include "quant/gptq.h"

namespace serval {

class GgufFile;
struct Imatrix;

// A target file type: llama.cpp's name and `general.file_type` number, and the type most tensors get.
struct FileType {
  std::string name;
  uint32_t id = 0;  // llama_ftype
  DType default_type = DType::F32;
};

// llama-quantize's type names ("Q4_K_M", "q8_0", "IQ4_NL", the aliases "Q4_K" ...) or numbers ("15");
// throws Error naming the types there are.
FileType parse_file_type(const std::string& text);
// A tensor type for --output-tensor-type / --token-embedding-type ("q8_0", "f16", ...); throws Error.
DType parse_tensor_type(const std::string& text);

struct QuantizeOptions {
  std::optional<DType> output_tensor_type, token_embedding_type;
  bool pure = false;                 // every quantized tensor gets the default type
  bool allow_requantize = false;     // inputs already quantized are dequantized first (lossy)
  bool leave_output_tensor = false;  // output.weight is copied as it is
  // Importance matrix (quant/imatrix.h): weighted searches, and llama.cpp's rules for files made with
  // one (the first eighth of ffn_down in Q4_0 / Q5_0 files gets Q4_1 / Q5_1). Tensors without an entry
  // are quantized without it, as llama-quantize does.
  const Imatrix* imatrix = nullptr;
  std::string imatrix_path;  // recorded in the output's metadata
  // "rtn" (round to nearest with the searches above), "awq" (quant/awq.h; needs the imatrix) or
  // "gptq" (quant/gptq.h; needs `hessians`).
  std::string method = "rtn";
  // --method gptq: the calibration Hessians by weight name; quantized matrices without one (the output
  // and the embedding) are rounded as with rtn. `gptq_damp`: the Hessian's diagonal damping.
  HessianSource hessians;
  float gptq_damp = 0.01f;
};

struct TensorChoice {
  std::string name;
  DType from = DType::F32, to = DType::F32;
  bool convert = false;  // false: copied byte for byte
};

// Each tensor's type, in the order written (by name, as llama-quantize writes them); throws Error for
// a tensor that cannot take its type (its rows are not whole blocks and no fallback applies).
std::vector<TensorChoice> choose_types(const GgufFile& in, const FileType& ft, const QuantizeOptions& o);

struct QuantizeReport {
  uint64_t bytes_in = 0, bytes_out = 0, n_params = 0;
  int64_t converted = 0, copied = 0;
  int64_t without_imatrix = 0;  // quantized tensors the imatrix has no entry for
  int64_t gptq = 0;             // tensors rounded by GPTQ
  std::vector<std::pair<std::string, float>> awq_alphas;  // --method awq: each group's alpha (0: unscaled)
  std::vector<std::string> warnings;  // fallbacks and requantized inputs
};

// Quantizes `in_path` into `out_path` (written through a temporary file renamed at the end: a failed
// or interrupted run leaves no output file). `progress(i, n, choice)` is called after each tensor.
QuantizeReport quantize_file(const std::string& in_path, const std::string& out_path, const FileType& ft,
                             const QuantizeOptions& o,
                             const std::function<void(size_t, size_t, const TensorChoice&)>& progress = {});

}  // namespace serval
