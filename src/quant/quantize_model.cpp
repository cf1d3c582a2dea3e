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
#include "quant/awq.h"
#include "quant/imatrix.h"
#include "tensor/dequant.h"
#include "tensor/quantize.h"

namespace serval {
namespace {

struct KnownFileType {
  const char* name;
  uint32_t id;
  DType type;
};

// llama.cpp's file types that Serval writes (llama_ftype numbers); "Q3_K", "Q4_K" and "Q5_K" are
// llama-quantize's aliases for the _M mixtures.
constexpr KnownFileType kFileTypes[] = {
    {"F32", 0, DType::F32},       {"F16", 1, DType::F16},       {"Q4_0", 2, DType::Q4_0},
    {"Q4_1", 3, DType::Q4_1},     {"Q8_0", 7, DType::Q8_0},     {"Q5_0", 8, DType::Q5_0},
    {"Q5_1", 9, DType::Q5_1},     {"Q2_K", 10, DType::Q2_K},    {"Q3_K_S", 11, DType::Q3_K},
    {"Q3_K_M", 12, DType::Q3_K},  {"Q3_K_L", 13, DType::Q3_K},  {"Q4_K_S", 14, DType::Q4_K},
    {"Q4_K_M", 15, DType::Q4_K},  {"Q5_K_S", 16, DType::Q5_K},  {"Q5_K_M", 17, DType::Q5_K},
    {"Q6_K", 18, DType::Q6_K},    {"IQ4_NL", 25, DType::IQ4_NL}, {"BF16", 32, DType::BF16},
    {"MXFP4_MOE", 38, DType::Q8_0},  // experts MXFP4, everything else Q8_0 (llama-quantize's MXFP4_MOE)
};
constexpr std::pair<const char*, const char*> kAliases[] = {{"Q3_K", "Q3_K_M"}, {"Q4_K", "Q4_K_M"}, {"Q5_K", "Q5_K_M"}};

// llama_ftype numbers the mixture rules test.
enum Ftype : uint32_t {
  kQ40 = 2, kQ50 = 8, kQ2K = 10, kQ3KS = 11, kQ3KM = 12, kQ3KL = 13, kQ4KS = 14, kQ4KM = 15, kQ5KS = 16, kQ5KM = 17, kIQ4NL = 25, kMXFP4MOE = 38,
};

std::string upper(std::string s) {
  for (char& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

bool is_quantized(DType t) { return t != DType::F32 && t != DType::F16 && t != DType::BF16; }
int64_t block_elems(DType t) { return int64_t(dtype_info(t).block_elems); }

int layer_of(const std::string& name) {
  int layer = -1;
  std::sscanf(name.c_str(), "blk.%d.", &layer);
  return layer;
}

// llama.cpp's order: tensors outside the blocks first, then block by block, by name within each.
bool weight_order(const std::string& a, const std::string& b) {
  const int la = layer_of(a), lb = layer_of(b);
  return la != lb ? la < lb : a < b;
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// Weights llama-quantize quantizes: 2-D (or more) `...weight` tensors but for norms, positional
// embeddings and a few small special matrices.
bool quantizable(const TensorRef& t, const QuantizeOptions& o) {
  if (o.leave_output_tensor && t.name == "output.weight") return false;
  return quantizable_tensor(t);
}

// An integer hyperparameter, or the first element of a per-layer array; `fallback` when absent.
int64_t hparam(const GgufFile& in, const std::string& key, int64_t fallback) {
  const auto it = in.metadata().find(key);
  if (it == in.metadata().end()) return fallback;
  if (const auto* arr = std::get_if<GgufArray>(&it->second.value)) return arr->ints.empty() ? fallback : arr->ints[0];
  return in.get_int(key);
}

// What llama.cpp's mixture rules (llama_tensor_get_type) read of the model, and their counters, which
// advance in the order the tensors are written.
struct Mixture {
  uint32_t ftype = 0;
  std::string arch;
  int n_layer = 0, n_expert = 0, n_gqa = 1;
  bool is_70b = false, has_output = false, has_imatrix = false;
  int n_attention_wv = 0, i_attention_wv = 0, i_ffn_down = 0;

  static Mixture of(const GgufFile& in, uint32_t ftype) {
    Mixture m;
    m.ftype = ftype;
    m.arch = in.find_string("general.architecture").value_or("");
    const std::string p = m.arch + ".";
    m.n_layer = int(hparam(in, p + "block_count", 0));
    m.n_expert = int(hparam(in, p + "expert_count", 0));
    const int64_t n_head = hparam(in, p + "attention.head_count", 1);
    const int64_t n_head_kv = hparam(in, p + "attention.head_count_kv", n_head);
    m.n_gqa = n_head_kv > 0 ? int(n_head / n_head_kv) : 0;
    m.is_70b = m.n_layer == 80 && (m.arch == "qwen2" || m.arch == "deci" || m.arch == "olmo" ||
                                   (m.arch == "llama" && m.n_expert != 8 && n_head != n_head_kv));
    for (const auto& t : in.tensors()) {
      if (contains(t.name, "attn_v.weight") || contains(t.name, "attn_qkv.weight") || contains(t.name, "attn_kv_b.weight"))
        ++m.n_attention_wv;
      else if (t.name == "output.weight")
        m.has_output = true;
    }
    return m;
  }
  bool falcon() const { return arch == "falcon"; }
  // Layers llama.cpp gives more bits: the first and last eighth, and every third in between.
  static bool more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }
};

DType output_type(const TensorRef& t, DType def) {
  if (int64_t(t.ne[0]) % block_elems(def) != 0) return DType::Q8_0;
  return def != DType::Q8_0 ? DType::Q6_K : def;
}

DType attn_v_type(Mixture& m, DType def) {
  const int i = m.i_attention_wv++;
  DType to = def;
  switch (m.ftype) {
    case kQ2K: to = m.n_gqa >= 4 ? DType::Q4_K : DType::Q3_K; break;
    case kQ3KM: to = i < 2 ? DType::Q5_K : DType::Q4_K; break;
    case kQ3KL: to = DType::Q5_K; break;
    case kIQ4NL: if (m.n_gqa >= 4) to = DType::Q5_K; break;
    case kQ4KM: case kQ5KM: if (Mixture::more_bits(i, m.n_attention_wv)) to = DType::Q6_K; break;
    case kQ4KS: if (i < 4) to = DType::Q5_K; break;
    default: break;
  }
  if (m.is_70b && (to == DType::Q3_K || to == DType::Q4_K)) to = DType::Q5_K;
  return m.n_expert == 8 ? DType::Q8_0 : to;
}

DType ffn_down_type(Mixture& m, const std::string& name, DType def) {
  int i = m.i_ffn_down++;
  const int n = m.n_layer;
  if (m.n_expert > 1) {  // experts' tensors are not in layer order: take the layer from the name
    i = layer_of(name);
    check(i >= 0 && i < n, "{}: cannot tell its layer (0..{})", name, n - 1);
  }
  switch (m.ftype) {
    case kQ2K: return DType::Q3_K;
    case kQ3KM: return i < n / 16 ? DType::Q5_K : !m.falcon() || Mixture::more_bits(i, n) ? DType::Q4_K : DType::Q3_K;
    case kQ3KL: return m.falcon() ? DType::Q4_K : DType::Q5_K;
    case kQ4KM:
      if (m.falcon()) return i < n / 16 ? DType::Q6_K : Mixture::more_bits(i, n) ? DType::Q5_K : DType::Q4_K;
      return Mixture::more_bits(i, n) ? DType::Q6_K : def;
    case kIQ4NL: return i < n / 8 && !m.has_imatrix ? DType::Q5_K : def;
    case kQ40: case kQ50:  // guards the first layers with an imatrix only (without one, the bytes stay as before)
      return m.has_imatrix && i < n / 8 ? (m.ftype == kQ40 ? DType::Q4_1 : DType::Q5_1) : def;
    case kQ5KM: return Mixture::more_bits(i, n) ? DType::Q6_K : def;
    case kQ4KS: return !m.falcon() && i < n / 8 ? DType::Q5_K : def;
    default: return def;
  }
}

DType attn_output_type(const Mixture& m, DType def) {
  if (m.falcon()) return m.ftype == kQ3KL ? DType::Q4_K : def;
  if (m.n_expert == 8) {
    static constexpr uint32_t kBumped[] = {kQ2K, kQ3KS, kQ3KM, kIQ4NL, kQ4KS, kQ4KM};
    return std::find(std::begin(kBumped), std::end(kBumped), m.ftype) != std::end(kBumped) ? DType::Q5_K : def;
  }
  switch (m.ftype) {
    case kQ2K: return DType::Q3_K;
    case kQ3KM: return DType::Q4_K;
    case kQ3KL: return DType::Q5_K;
    default: return def;
  }
}

DType attn_qkv_type(const Mixture& m, DType def) {
  switch (m.ftype) {
    case kQ3KM: case kQ3KL: return DType::Q4_K;
    case kQ4KM: return DType::Q5_K;
    case kQ5KM: return DType::Q6_K;
    default: return def;
  }
}

// A type whose blocks do not divide the rows falls back as llama.cpp's does; F16 when even the
// fallback does not fit.
DType fallback(DType t, const std::string& name, int64_t cols) {
  DType f;
  switch (t) {
    case DType::Q2_K: case DType::Q3_K: f = DType::IQ4_NL; break;
    case DType::Q4_K: f = DType::Q5_0; break;
    case DType::Q5_K: f = DType::Q5_1; break;
    case DType::Q6_K: f = DType::Q8_0; break;
    case DType::MXFP4: f = DType::F16; break;
    default: fail("{}: rows of {} elements are not whole {} blocks", name, cols, dtype_info(t).name);
  }
  return cols % block_elems(f) == 0 ? f : DType::F16;
}

// llama.cpp's choice for one tensor (llama_tensor_get_type) for the file types Serval writes.
DType tensor_type(Mixture& m, const TensorRef& t, DType def, const QuantizeOptions& o) {
  const std::string& name = t.name;
  DType to = def;
  if (m.ftype == kMXFP4MOE && contains(name, "_exps.weight")) {
    to = DType::MXFP4;
  } else if (name == "output.weight" || (!m.has_output && name == "token_embd.weight")) {
    to = o.output_tensor_type ? *o.output_tensor_type : output_type(t, def);
  } else if (name == "token_embd.weight") {
    if (o.token_embedding_type) to = *o.token_embedding_type;
  } else if (contains(name, "attn_v.weight")) {
    to = attn_v_type(m, def);
  } else if (contains(name, "attn_k.weight")) {
    if (m.n_expert == 8) to = DType::Q8_0;
  } else if (contains(name, "ffn_down")) {
    to = ffn_down_type(m, name, def);
  } else if (contains(name, "attn_output.weight")) {
    to = attn_output_type(m, def);
  } else if (contains(name, "attn_qkv.weight")) {
    to = attn_qkv_type(m, def);
  }
  const int64_t cols = int64_t(t.ne[0]);
  return cols % block_elems(to) == 0 ? to : fallback(to, name, cols);
}

}  // namespace

FileType parse_file_type(const std::string& text) {
  std::string u = upper(text);
  for (const auto& [alias, name] : kAliases)
    if (u == alias) u = name;
  std::string names;
  for (const auto& k : kFileTypes) {
    if (u == k.name || text == std::to_string(k.id)) return {k.name, k.id, k.type};
    names += std::string(names.empty() ? "" : ", ") + k.name;
  }
  fail("unknown quantization type '{}' (one of {})", text, names);
}

DType parse_tensor_type(const std::string& text) {
  const std::string u = upper(text);
  static constexpr DType kTensorTypes[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q8_0, DType::Q4_0,
                                           DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K,
                                           DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL, DType::MXFP4};
  for (DType t : kTensorTypes)
    if (u == dtype_info(t).name) return t;
  fail("unknown or unsupported tensor type '{}' (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, "
       "q5_k, q6_k, iq4_nl, mxfp4)", text);
}

std::vector<TensorChoice> choose_types(const GgufFile& in, const FileType& ft, const QuantizeOptions& o) {
  std::vector<const TensorRef*> order;
  for (const auto& t : in.tensors()) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return weight_order(a->name, b->name); });
  Mixture mix = Mixture::of(in, ft.id);
  mix.has_imatrix = o.imatrix != nullptr;
  std::vector<TensorChoice> out;
  for (const TensorRef* t : order) {
    TensorChoice c{t->name, t->type, t->type, false};
    if (quantizable(*t, o)) {
      DType to = ft.default_type;
      if (!o.pure && is_quantized(to)) to = tensor_type(mix, *t, to, o);
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
// AWQ's rescaling of one float row `r` (quant/awq.h).
void rescale_row(const ChannelRescale& x, int64_t r, float* row, int64_t cols) {
  for (size_t j = 0; j < x.col_mul.size(); ++j) row[j] *= x.col_mul[j];
  for (size_t j = 0; j < x.col_div.size(); ++j) row[j] /= x.col_div[j];
  if (!x.row_div.empty())
    for (int64_t j = 0; j < cols; ++j) row[j] /= x.row_div[size_t(r)];
}

std::vector<uint8_t> convert_tensor(const TensorRef& t, DType to, std::vector<float> importance,
                                    const ChannelRescale* rescale) {
  if (rescale && !rescale->col_mul.empty() && !importance.empty())  // the activations become x / s
    for (size_t j = 0; j < importance.size(); ++j) {
      const float m = rescale->col_mul[j % rescale->col_mul.size()];
      importance[j] /= m * m;
    }
  const int64_t cols = int64_t(t.row_len()), rows = int64_t(t.n_rows());
  const size_t in_row = row_bytes(t.type, size_t(cols)), out_row = row_bytes(to, size_t(cols));
  // One importance row per matrix of the stack (the experts of a 3-D tensor), each for its rows.
  const int64_t n_mat = importance.empty() ? 1 : int64_t(importance.size()) / cols, rows_per_mat = rows / n_mat;
  std::vector<uint8_t> out(size_t(rows) * out_row);
  const int64_t chunk = std::max<int64_t>(1, 16384 / cols);  // rows per task
  parallel_for((rows + chunk - 1) / chunk, [&](int64_t task) {
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = task * chunk; r < std::min(rows, (task + 1) * chunk); ++r) {
      dequantize_row(t.type, t.data + size_t(r) * in_row, row.data(), size_t(cols));
      if (rescale) rescale_row(*rescale, r, row.data(), cols);
      quantize_row(to, row.data(), out.data() + size_t(r) * out_row, size_t(cols),
                   importance.empty() ? nullptr : importance.data() + (r / rows_per_mat) * cols);
    }
  });
  return out;
}

// The Hessian GPTQ rounds tensor `c` with, or null (another method, no entry, a type it cannot write).
std::shared_ptr<const Hessian> hessian_for(const QuantizeOptions& o, const TensorChoice& c, const TensorRef& t) {
  if (o.method != "gptq" || !o.hessians || !gptq_supports(c.to)) return nullptr;
  auto h = o.hessians(c.name);
  check(!h || h->n == int64_t(t.row_len()), "{}: the calibration saw {} inputs, the matrix has {} columns", c.name,
        h ? h->n : 0, t.row_len());
  return h;
}

// A whole matrix rounded by GPTQ: its rows dequantized to float first.
std::vector<uint8_t> gptq_tensor(const TensorRef& t, DType to, const Hessian& h, const QuantizeOptions& o,
                                 const std::vector<float>& importance) {
  const int64_t cols = int64_t(t.row_len()), rows = int64_t(t.n_rows());
  const size_t in_row = row_bytes(t.type, size_t(cols));
  std::vector<float> w(size_t(rows * cols));
  parallel_for(rows, [&](int64_t r) {
    dequantize_row(t.type, t.data + size_t(r) * in_row, w.data() + r * cols, size_t(cols));
  });
  return gptq_quantize(to, w.data(), rows, cols, h, o.gptq_damp, importance);
}

// --method: rtn (the searches alone) or awq (scales first; the norms they fold into are rewritten).
AwqPlan plan_method(const GgufFile& in, std::vector<TensorChoice>& choices, const QuantizeOptions& o) {
  if (o.method == "rtn") return {};
  if (o.method == "gptq") {
    check(bool(o.hessians), "--method gptq needs calibration text (--calib-file) to measure each matrix's inputs");
    return {};
  }
  check(o.method == "awq", "unknown --method '{}' (rtn, awq, gptq)", o.method);
  check(o.imatrix != nullptr, "--method awq needs --imatrix (the activation statistics it scales by)");
  AwqPlan plan = awq_plan(in, choices, *o.imatrix);
  for (auto& c : choices)
    if (!c.convert && plan.rescale.count(c.name)) c.convert = true, c.to = c.from;
  return plan;
}

// What llama-quantize records of the imatrix it used.
void add_imatrix_metadata(const Imatrix& m, const std::string& path, GgufWriter& w) {
  const auto i32 = [](int64_t v) { return GgufValue{GgufValueType::INT32, v}; };
  w.add_string("quantize.imatrix.file", path);
  if (!m.datasets.empty()) w.add_string("quantize.imatrix.dataset", m.datasets.back());
  w.add_value("quantize.imatrix.entries_count", i32(int64_t(m.entries.size())));
  if (m.chunk_count > 0) w.add_value("quantize.imatrix.chunks_count", i32(m.chunk_count));
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
  auto choices = choose_types(in, ft, o);
  const AwqPlan awq = plan_method(in, choices, o);
  GgufWriter w;
  copy_metadata(in, ft, w);
  if (o.imatrix) add_imatrix_metadata(*o.imatrix, o.imatrix_path, w);
  QuantizeReport rep;
  rep.awq_alphas = awq.alphas;
  for (size_t i = 0; i < choices.size(); ++i) {
    const TensorChoice& c = choices[i];
    const TensorRef& t = *in.find_tensor(c.name);
    rep.bytes_in += t.nbytes;
    rep.n_params += t.n_elements();
    if (c.convert) {
      const int64_t n_mat = t.ne.size() == 3 ? int64_t(t.ne[2]) : 1;  // a stack of experts: one row each
      const auto importance = o.imatrix && is_quantized(c.to) ? o.imatrix->importance(c.name, int64_t(t.row_len()), n_mat)
                                                               : std::vector<float>{};
      if (o.imatrix && is_quantized(c.to) && importance.empty()) ++rep.without_imatrix;
      const auto it = awq.rescale.find(c.name);
      const auto h = hessian_for(o, c, t);
      rep.gptq += h != nullptr;
      check(!h || n_mat == 1, "{}: GPTQ of stacked expert matrices is not supported", c.name);
      const auto bytes = h ? gptq_tensor(t, c.to, *h, o, importance)
                           : convert_tensor(t, c.to, importance, it == awq.rescale.end() ? nullptr : &it->second);
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
