#include "model/gpt_oss.h"

#include <cstring>
#include <regex>

#include "base/error.h"
#include "tensor/dequant.h"

namespace serval {

namespace {
// OpenAI's MXFP4 checkpoint: blocks [E, rows, in / 32, 16] (value 2k in the low nibble of byte k, 2k + 1
// in the high one) and scales [E, rows, in / 32] (E8M0). GGUF's MXFP4 block: the scale byte, then
// value j in the low nibble and j + 16 in the high nibble of byte j. Rows first, first + step, ...
std::vector<uint8_t> mxfp4_rows(const TensorRef& blocks, const TensorRef& scales, uint64_t step, uint64_t first,
                                std::vector<uint64_t>& ne) {
  check(blocks.ne.size() == 4 && blocks.ne[0] == 16 && scales.ne.size() == 3 && scales.ne[0] == blocks.ne[1] &&
            scales.ne[1] == blocks.ne[2] && scales.ne[2] == blocks.ne[3] && blocks.type == DType::U8 && scales.type == DType::U8,
        "{}: MXFP4 blocks and scales of mismatched shapes", blocks.name);
  const uint64_t groups = blocks.ne[1], src_rows = blocks.ne[2], n_e = blocks.ne[3], rows = src_rows / step;
  std::vector<uint8_t> out(n_e * rows * groups * 17);
  uint8_t* o = out.data();
  for (uint64_t e = 0; e < n_e; ++e)
    for (uint64_t r = 0; r < rows; ++r)
      for (uint64_t g = 0; g < groups; ++g, o += 17) {
        const uint64_t src = (e * src_rows + r * step + first) * groups + g;
        const uint8_t* b = blocks.data + src * 16;
        auto code = [&](int k) { return k % 2 == 0 ? b[k / 2] & 0x0F : b[k / 2] >> 4; };
        o[0] = scales.data[src];
        for (int j = 0; j < 16; ++j) o[1 + j] = uint8_t(code(j) | (code(j + 16) << 4));
      }
  ne = {groups * 32, rows, n_e};
  return out;
}

std::vector<float> tensor_floats(const TensorRef& t) {
  std::vector<float> v(t.n_elements());
  for (uint64_t r = 0; r < t.n_rows(); ++r)
    dequantize_row(t.type, t.data + r * row_bytes(t.type, t.row_len()), v.data() + r * t.row_len(), int64_t(t.row_len()));
  return v;
}

// The F32 relayouts of the stacked float tensors (see the header).
std::vector<float> relaid(const TensorRef& src, const std::string& kind, bool bias, std::vector<uint64_t>& ne) {
  const std::vector<float> x = tensor_floats(src);
  if (bias && kind == "down") {  // [E, n_embd] as it is
    ne = src.ne;
    return x;
  }
  const uint64_t odd = kind == "up";
  if (bias) {  // [E, 2 n_ff] -> [E, n_ff], the even or odd columns
    check(src.ne.size() == 2, "{}: expected a 2-D tensor", src.name);
    const uint64_t two_ff = src.ne[0], n_e = src.ne[1];
    std::vector<float> out(x.size() / 2);
    for (uint64_t e = 0; e < n_e; ++e)
      for (uint64_t i = 0; i < two_ff / 2; ++i) out[e * two_ff / 2 + i] = x[e * two_ff + 2 * i + odd];
    ne = {two_ff / 2, n_e};
    return out;
  }
  // Transpose each expert's [in][out] (gate/up: its even or odd out columns) to [out][in].
  check(src.ne.size() == 3, "{}: expected a 3-D tensor", src.name);
  const uint64_t cols = src.ne[0], in = src.ne[1], n_e = src.ne[2];
  const uint64_t step = kind == "down" ? 1 : 2, rows = cols / step;
  std::vector<float> out(n_e * rows * in);
  for (uint64_t e = 0; e < n_e; ++e)
    for (uint64_t r = 0; r < rows; ++r)
      for (uint64_t c = 0; c < in; ++c) out[(e * rows + r) * in + c] = x[(e * in + c) * cols + r * step + odd];
  ne = {in, rows, n_e};
  return out;
}
}  // namespace

const TensorRef* GptOssExperts::find(const std::string& gguf_name) {
  static const std::regex re(R"(blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(gguf_name, m, re)) return nullptr;
  if (const auto it = by_name_.find(gguf_name); it != by_name_.end()) return it->second;
  const std::string kind = m[2], hf = "model.layers." + m[1].str() + ".mlp.experts." + (kind == "down" ? "down_proj" : "gate_up_proj");
  const bool bias = m[3] == "bias";
  std::vector<uint64_t> ne;
  DType type = DType::F32;
  std::vector<uint8_t> bytes;
  const TensorRef* blocks = bias ? nullptr : find_(hf + "_blocks");
  if (blocks) {
    const TensorRef* scales = find_(hf + "_scales");
    check(scales != nullptr, "{}: MXFP4 blocks without their scales", hf);
    bytes = mxfp4_rows(*blocks, *scales, kind == "down" ? 1 : 2, kind == "up" ? 1 : 0, ne);
    type = DType::MXFP4;
  } else {
    const TensorRef* src = find_(hf + (bias ? "_bias" : ""));
    if (!src) return nullptr;
    const std::vector<float> x = relaid(*src, kind, bias, ne);
    bytes.resize(x.size() * sizeof(float));
    std::memcpy(bytes.data(), x.data(), bytes.size());
  }
  data_.push_back(std::move(bytes));
  made_.push_back(TensorRef{gguf_name, type, ne, data_.back().data(), data_.back().size()});
  return by_name_[gguf_name] = &made_.back();
}

bool GptOssExperts::is_source(const std::string& hf_name) {
  static const std::regex re(R"(model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?)");
  return std::regex_match(hf_name, re);
}

}  // namespace serval
