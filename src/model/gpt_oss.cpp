#include "model/gpt_oss.h"

#include <regex>

#include "base/error.h"

namespace serval {

namespace {
std::vector<float> tensor_floats(const TensorRef& t) {
  std::vector<float> v(t.n_elements());
  for (uint64_t r = 0; r < t.n_rows(); ++r)
    dequantize_row(t.type, t.data + r * row_bytes(t.type, t.row_len()), v.data() + r * t.row_len(), int64_t(t.row_len()));
  return v;
}
}  // namespace

const TensorRef* GptOssExperts::find(const std::string& gguf_name) {
  static const std::regex re(R"(blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(gguf_name, m, re)) return nullptr;
  if (const auto it = by_name_.find(gguf_name); it != by_name_.end()) return it->second;
  const std::string hf = "model.layers." + m[1].str() + ".mlp.experts." + (m[2] == "down" ? "down_proj" : "gate_up_proj") +
                         (m[3] == "bias" ? "_bias" : "");
  const TensorRef* src = find_(hf);
  if (!src) return nullptr;
  const std::vector<float> x = tensor_floats(*src);
  const bool bias = m[3] == "bias";
  std::vector<float> out(x.size() / (m[2] == "down" ? 1 : 2));
  std::vector<uint64_t> ne;
  if (bias && m[2] == "down") {  // [E, n_embd] as it is
    out = x, ne = src->ne;
  } else if (bias) {  // [E, 2 n_ff] -> [E, n_ff], the even or odd columns
    check(src->ne.size() == 2, "{}: expected a 2-D tensor", hf);
    const uint64_t two_ff = src->ne[0], n_e = src->ne[1], odd = m[2] == "up";
    for (uint64_t e = 0; e < n_e; ++e)
      for (uint64_t i = 0; i < two_ff / 2; ++i) out[e * two_ff / 2 + i] = x[e * two_ff + 2 * i + odd];
    ne = {two_ff / 2, n_e};
  } else {  // transpose each expert's [in][out] (gate/up: its even or odd out columns) to [out][in]
    check(src->ne.size() == 3, "{}: expected a 3-D tensor", hf);
    const uint64_t cols = src->ne[0], in = src->ne[1], n_e = src->ne[2];
    const uint64_t step = m[2] == "down" ? 1 : 2, first = m[2] == "up" ? 1 : 0, rows = cols / step;
    for (uint64_t e = 0; e < n_e; ++e)
      for (uint64_t r = 0; r < rows; ++r)
        for (uint64_t c = 0; c < in; ++c) out[(e * rows + r) * in + c] = x[(e * in + c) * cols + r * step + first];
    ne = {in, rows, n_e};
  }
  data_.push_back(std::move(out));
  made_.push_back(TensorRef{gguf_name, DType::F32, ne, reinterpret_cast<const uint8_t*>(data_.back().data()),
                            data_.back().size() * sizeof(float)});
  return by_name_[gguf_name] = &made_.back();
}

bool GptOssExperts::is_source(const std::string& hf_name) {
  static const std::regex re(R"(model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?)");
  return std::regex_match(hf_name, re);
}

}  // namespace serval
