// The calibration behind `serval quantize --method gptq`: the input model runs over a text and each
// layer matrix's input Hessian is summed (quant/gptq.h), a window of layers at a time, so that the
// memory it takes is bounded whatever the model's size.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "quant/gptq.h"
#include "quant/quantize_model.h"

namespace serval::cli {

struct GptqCalibration {
  std::string model, text;  // the model to run (the quantizer's input) and the calibration text
  int ctx = 512, chunks = 8;  // chunks of ctx tokens, each starting with BOS when the model adds one
  int layers_per_pass = 0;    // layers measured per run over the text (0: as many as 4 GiB of Hessians hold)
};

// A HessianSource for quantize_file writing `choices` (choose_types): the first request for a layer outside the current window measures the window of
// layers_per_pass layers starting there (one more run over the text) and drops the previous one.
// Throws Error for a text shorter than one chunk.
HessianSource gptq_hessians(const GptqCalibration& c, const std::vector<TensorChoice>& choices);

}  // namespace serval::cli
