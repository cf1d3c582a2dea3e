#include "quant/quantize_model.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <map>

#include "base/error.h"
#include "base/thread_pool.h"
#include "io/gguf.h"
#include "io/gguf_writer.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

struct KnownFileType {
  const char* name;
  uint32_t id;
  DType type;
  bool supported;
};

// llama.cpp's file types (llama_ftype numbers); the unsupported ones are named in errors.
constexpr KnownFileType kFileTypes[] = {
    {"F32", 0, DType::F32, true},     {"F16", 1, DType::F16, true},     {"Q4_0", 2, DType::Q4_0, true},
    {"Q4_1", 3, DType::Q4_1, true},   {"Q8_0", 7, DType::Q8_0, true},   {"Q5_0", 8, DType::Q5_0, true},
    {"Q5_1", 9, DType::Q5_1, true},   {"BF16", 32, DType::BF16, true},  {"Q2_K", 10, DType::Q2_K, false},
    {"Q3_K_S", 11, DType::Q3_K, false}, {"Q3_K_M", 12, DType::Q3_K, false}, {"Q3_K_L", 13, DType::Q3_K, false},
    {"Q4_K_S", 14, DType::Q4_K, false}, {"Q4_K_M", 15, DType::Q4_K, false}, {"Q5_K_S", 16, DType::Q5_K, false},
    {"Q5_K_M", 17, DType::Q5_K, false}, {"Q6_K", 18, DType::Q6_K, false},  {"IQ4_NL", 25, DType::F32, false},
};

std::string upper(std::string s) {
  for (char& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

bool is_quantized(DType t) { return t != DType::F32 && t != DType::F16 && t != DType::BF16; }
int64_t block_elems(DType t) { return int64_t(dtype_info(t).block_elems); }

// llama.cpp's order: tensors outside the blocks first, then block by block, by name within each.
bool weight_order(const std::string& a, const std::string& b) {
  int la = -1, lb = -1;
  std::sscanf(a.c_str(), "blk.%d.", &la);
  std::sscanf(b.c_str(), "blk.%d.", &lb);
  return la != lb ? la < lb : a < b;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// Weights llama-quantize quantizes: 2-D (or more) `...weight` tensors but for norms, positional
// embeddings and a few small special matrices.
bool quantizable(const TensorRef& t, const QuantizeOptions& o) {
  static const char* const kKept[] = {"_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight", "time_mix_first.weight",
                                      "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_decay_w1.weight",
                                      "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight"};
  if (!ends_with(t.name, "weight") || t.ne.size() < 2) return false;
  if (t.name == "position_embd.weight" || t.name == "token_types.weight") return false;
  if (o.leave_output_tensor && t.name == "output.weight") return false;
  return std::none_of(std::begin(kKept), std::end(kKept), [&](const char* k) { return contains(t.name, k); });
}

// A type whose blocks do not divide the rows falls back as llama.cpp's does (k-quants to the 32-element
// types, those to F16); other types cannot.
DType fallback(DType t, const std::string& name, int64_t cols) {
  DType f;
  switch (t) {
    case DType::Q4_K: f = DType::Q5_0; break;
    case DType::Q5_K: f = DType::Q5_1; break;
    case DType::Q6_K: f = DType::Q8_0; break;
    default: fail("{}: rows of {} elements are not whole {} blocks", name, cols, dtype_info(t).name);
  }
  return cols % block_elems(f) == 0 ? f : DType::F16;
}

// llama.cpp's choice for one tensor (llama_tensor_get_type) for the file types Serval writes: the
// output matrix (or a tied embedding) gets Q6_K unless the file type is Q8_0 or its rows do not take
// the default type; then blocks that do not divide the rows fall back.
DType tensor_type(const TensorRef& t, DType def, bool has_output, const QuantizeOptions& o) {
  const int64_t cols = int64_t(t.ne[0]);
  DType to = def;
  if (t.name == "output.weight" || (!has_output && t.name == "token_embd.weight")) {
    if (o.output_tensor_type) to = *o.output_tensor_type;
    else if (cols % block_elems(def) != 0) to = DType::Q8_0;
    else if (def != DType::Q8_0) to = DType::Q6_K;
  } else if (t.name == "token_embd.weight" && o.token_embedding_type) {
    to = *o.token_embedding_type;
  }
  return cols % block_elems(to) == 0 ? to : fallback(to, t.name, cols);
}

}  // namespace

FileType parse_file_type(const std::string& text) {
  const std::string u = upper(text);
  std::string names;
  for (const auto& k : kFileTypes) {
    if (u == k.name || text == std::to_string(k.id)) {
      check(k.supported, "{}: serval quantize cannot write this type yet (it writes F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
                         "Q5_0 and Q5_1; k-quants and IQ4_NL are not implemented)", k.name);
      return {k.name, k.id, k.type};
    }
    if (k.supported) names += std::string(names.empty() ? "" : ", ") + k.name;
  }
  fail("unknown quantization type '{}' (one of {})", text, names);
}

DType parse_tensor_type(const std::string& text) {
  const std::string u = upper(text);
  for (const auto& k : kFileTypes)
    if (u == k.name && k.supported) return k.type;
  fail("unknown or unsupported tensor type '{}' (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1)", text);
}

std::vector<TensorChoice> choose_types(const GgufFile& in, const FileType& ft, const QuantizeOptions& o) {
  std::vector<const TensorRef*> order;
  for (const auto& t : in.tensors()) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return weight_order(a->name, b->name); });
  const bool has_output = in.find_tensor("output.weight") != nullptr;
  std::vector<TensorChoice> out;
  for (const TensorRef* t : order) {
    TensorChoice c{t->name, t->type, t->type, false};
    if (quantizable(*t, o)) {
      DType to = ft.default_type;
      if (!o.pure && is_quantized(to)) to = tensor_type(*t, to, has_output, o);
      if (t->name == "token_embd.weight" && o.token_embedding_type) to = *o.token_embedding_type;
      if (t->name == "output.weight" && o.output_tensor_type) to = *o.output_tensor_type;
      check(int64_t(t->ne[0]) % block_elems(to) == 0, "{}: rows of {} elements are not whole {} blocks", t->name, t->ne[0],
            dtype_info(to).name);
      c.to = to;
      c.convert = to != t->type;
    }
    if (c.convert && !can_quantize_to(c.to))
      fail("{} would become {} (as llama-quantize chooses), which serval quantize cannot write yet; choose its type "
           "with --output-tensor-type / --token-embedding-type, or --pure", t->name, dtype_info(c.to).name);
    if (c.convert && is_quantized(t->type) && !o.allow_requantize)
      fail("{} is already {}: requantizing loses precision twice; pass --allow-requantize to do it anyway", t->name,
           dtype_info(t->type).name);
    out.push_back(c);
  }
  return out;
}

namespace {

// One tensor converted: rows dequantized to float and quantized again, rows in parallel.
std::vector<uint8_t> convert_tensor(const TensorRef& t, DType to) {
  const int64_t cols = int64_t(t.row_len()), rows = int64_t(t.n_rows());
  const size_t in_row = row_bytes(t.type, size_t(cols)), out_row = row_bytes(to, size_t(cols));
  std::vector<uint8_t> out(size_t(rows) * out_row);
  const int64_t chunk = std::max<int64_t>(1, 16384 / cols);  // rows per task
  parallel_for((rows + chunk - 1) / chunk, [&](int64_t task) {
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = task * chunk; r < std::min(rows, (task + 1) * chunk); ++r) {
      dequantize_row(t.type, t.data + size_t(r) * in_row, row.data(), size_t(cols));
      quantize_row(to, row.data(), out.data() + size_t(r) * out_row, size_t(cols));
    }
  });
  return out;
}

void copy_metadata(const GgufFile& in, const FileType& ft, GgufWriter& w) {
  for (const auto& [key, value] : in.metadata()) {
    if (key == "general.file_type" || key == "general.quantization_version" || key.rfind("split.", 0) == 0) continue;
    w.add_value(key, value);
  }
  w.add_u32("general.quantization_version", 2);
  w.add_u32("general.file_type", ft.id);
}

}  // namespace

QuantizeReport quantize_file(const std::string& in_path, const std::string& out_path, const FileType& ft,
                             const QuantizeOptions& o, const std::function<void(size_t, size_t, const TensorChoice&)>& progress) {
  const GgufFile in(in_path);
  const auto choices = choose_types(in, ft, o);
  GgufWriter w;
  copy_metadata(in, ft, w);
  QuantizeReport rep;
  for (size_t i = 0; i < choices.size(); ++i) {
    const TensorChoice& c = choices[i];
    const TensorRef& t = *in.find_tensor(c.name);
    rep.bytes_in += t.nbytes;
    rep.n_params += t.n_elements();
    if (c.convert) {
      const auto bytes = convert_tensor(t, c.to);
      w.add_tensor(c.name, t.ne, uint32_t(c.to), bytes.data(), bytes.size());
      rep.bytes_out += bytes.size();
      ++rep.converted;
      if (is_quantized(t.type))
        rep.warnings.push_back(fmt::format("{} requantized from {}", c.name, dtype_info(t.type).name));
    } else {
      w.add_tensor(c.name, t.ne, uint32_t(t.type), t.data, t.nbytes);
      rep.bytes_out += t.nbytes;
      ++rep.copied;
    }
    if (progress) progress(i + 1, choices.size(), c);
  }
  w.write(out_path);
  return rep;
}

}  // namespace serval
