#include "model/lora.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "base/error.h"
#include "base/file_util.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "tensor/dequant.h"

namespace serval {
namespace lora_load {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Rows [out][in] of the product the target changes, for a model of `c`.
std::pair<int64_t, int64_t> target_shape(const ModelConfig& c, LoraTarget t) {
  switch (t) {
    case LoraTarget::Q: return {c.q_dim(), c.n_embd};
    case LoraTarget::K:
    case LoraTarget::V: return {c.kv_dim(), c.n_embd};
    case LoraTarget::O: return {c.n_embd, c.q_dim()};
    case LoraTarget::Gate:
    case LoraTarget::Up: return {c.n_ff, c.n_embd};
    case LoraTarget::Down: return {c.n_embd, c.n_ff};
    case LoraTarget::ShGate:
    case LoraTarget::ShUp: return {c.n_ff_shexp, c.n_embd};
    case LoraTarget::ShDown: return {c.n_embd, c.n_ff_shexp};
    default: return {0, 0};
  }
}

LoraTarget target_from_gguf(const std::string& kind) {
  for (int t = 0; t < int(LoraTarget::Count); ++t)
    if (kind == lora_target_name(LoraTarget(t))) return LoraTarget(t);
  return LoraTarget::Count;
}

// A routed expert's product from its GGUF name (ffn_gate_exps ...) or PEFT module (gate_proj or
// Mixtral's w1, ...): 0 gate, 1 up, 2 down; -1 for anything else.
int expert_kind(const std::string& name) {
  static const std::map<std::string, int> m = {{"ffn_gate_exps", 0}, {"ffn_up_exps", 1}, {"ffn_down_exps", 2},
                                               {"gate_proj", 0},     {"up_proj", 1},     {"down_proj", 2},
                                               {"w1", 0},            {"w3", 1},          {"w2", 2}};
  const auto it = m.find(name);
  return it == m.end() ? -1 : it->second;
}

LoraTarget target_from_peft(const std::string& module) {
  static const std::map<std::string, LoraTarget> m = {
      {"self_attn.q_proj", LoraTarget::Q},  {"self_attn.k_proj", LoraTarget::K}, {"self_attn.v_proj", LoraTarget::V},
      {"self_attn.o_proj", LoraTarget::O},  {"mlp.gate_proj", LoraTarget::Gate}, {"mlp.up_proj", LoraTarget::Up},
      {"mlp.down_proj", LoraTarget::Down},
      {"mlp.shared_expert.gate_proj", LoraTarget::ShGate},  {"mlp.shared_expert.up_proj", LoraTarget::ShUp},
      {"mlp.shared_expert.down_proj", LoraTarget::ShDown}};
  const auto it = m.find(module);
  return it == m.end() ? LoraTarget::Count : it->second;
}

// HF rotate-half rows of each head to GGUF's interleaved pairs (as the converter permutes Q/K), or
// back (`inverse`: a GGUF llama adapter on a Hugging Face base, which keeps rotate-half order).
std::vector<float> interleave_rows(const std::vector<float>& w, int64_t rows, int64_t cols, int64_t n_head, bool inverse) {
  check(n_head > 0 && rows % (2 * n_head) == 0, "LoRA: {} rows do not split into {} heads", rows, n_head);
  const int64_t half = rows / n_head / 2;
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < n_head; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t hf = h * 2 * half + j * half + i, gguf = h * 2 * half + i * 2 + j;
        std::copy_n(w.begin() + (inverse ? gguf : hf) * cols, cols, out.begin() + (inverse ? hf : gguf) * cols);
      }
  return out;
}

class Builder {
 public:
  Builder(const ModelConfig& c, LoraAdapter& a) : c_(c), a_(a) { a_.layers.resize(size_t(c.n_layer)); }

  // One tensor's floats as A ([rank][in]) or B ([out][rank]) of layer `il`'s target.
  // `permute`: 0 keep B's rows, 1 HF to GGUF order, -1 GGUF to HF order (Q and K only).
  void set(int64_t il, LoraTarget t, bool is_a, const TensorRef& ref, int permute) {
    check_layer(il, ref.name);
    check(ref.ne.size() == 2, "{}: tensor '{}' is not a matrix", a_.path, ref.name);
    // A mixture-of-experts layer has no dense FFN products to update (its experts have their own names).
    const bool ffn = t == LoraTarget::Gate || t == LoraTarget::Up || t == LoraTarget::Down;
    check(!ffn || !moe_layer(il),
          "{}: tensor '{}' updates the dense FFN of layer {}, a mixture-of-experts layer (its experts' updates are "
          "named per expert: mlp.experts.E.gate_proj, ffn_gate_exps)", a_.path, ref.name, il);
    const bool shared = t == LoraTarget::ShGate || t == LoraTarget::ShUp || t == LoraTarget::ShDown;
    check(!shared || (moe_layer(il) && c_.n_ff_shexp > 0), "{}: tensor '{}' updates a shared expert that layer {} "
          "does not have", a_.path, ref.name, il);
    const auto [out, in] = target_shape(c_, t);
    const int64_t rows = int64_t(ref.ne[1]), cols = int64_t(ref.ne[0]);
    check_shape(ref.name, is_a, rows, cols, out, in, lora_target_name(t));
    std::vector<float> x(size_t(rows * cols));
    dequantize_row(ref.type, ref.data, x.data(), x.size());
    if (permute != 0 && !is_a && (t == LoraTarget::Q || t == LoraTarget::K))
      x = interleave_rows(x, rows, cols, t == LoraTarget::Q ? c_.n_head : c_.n_head_kv, permute < 0);
    store(a_.layers[size_t(il)][size_t(t)], is_a, std::move(x), rows, cols);
  }

  // A or B of routed expert e's product `kind` (0 gate, 1 up, 2 down) in layer il: `x` is
  // [rows][cols] (A: [rank][in], B: [out][rank]).
  void set_expert(int64_t il, int64_t e, int kind, bool is_a, std::vector<float> x, int64_t rows, int64_t cols,
                  const std::string& name) {
    check_layer(il, name);
    check(moe_layer(il), "{}: tensor '{}' updates an expert of layer {}, which has none", a_.path, name, il);
    check(e >= 0 && e < c_.n_expert, "{}: tensor '{}' is for expert {}, the model has {}", a_.path, name, e, c_.n_expert);
    const int64_t out = kind == 2 ? c_.n_embd : c_.n_ff_exp, in = kind == 2 ? c_.n_ff_exp : c_.n_embd;
    check_shape(name, is_a, rows, cols, out, in, kind == 0 ? "ffn_gate_exps" : kind == 1 ? "ffn_up_exps" : "ffn_down_exps");
    if (a_.experts.empty()) a_.experts.resize(size_t(c_.n_layer));
    auto& layer = a_.experts[size_t(il)];
    if (layer.empty()) layer.resize(size_t(c_.n_expert));
    LoraPair& pair = layer[size_t(e)][size_t(kind)];
    check((is_a ? pair.a : pair.b).empty(), "{}: tensor '{}' is given twice", a_.path, name);
    store(pair, is_a, std::move(x), rows, cols);
  }

  void finish() {
    int pairs = 0;
    for (auto& layer : a_.layers)
      for (int t = 0; t < int(LoraTarget::Count); ++t)
        pairs += count(layer[size_t(t)], lora_target_name(LoraTarget(t)));
    for (auto& layer : a_.experts)
      for (auto& expert : layer)
        for (int k = 0; k < 3; ++k) pairs += count(expert[size_t(k)], "expert");
    check(pairs > 0, "{}: no LoRA tensors for the model's matrix products", a_.path);
    check(std::isfinite(a_.alpha) && a_.alpha > 0, "{}: bad LoRA alpha {}", a_.path, a_.alpha);
  }

 private:
  const ModelConfig& c_;
  LoraAdapter& a_;

  bool moe_layer(int64_t il) const { return !c_.layer_is_moe.empty() && c_.layer_is_moe[size_t(il)]; }

  void check_layer(int64_t il, const std::string& name) const {
    check(il >= 0 && il < c_.n_layer, "{}: tensor '{}' is for layer {}, the model has {}", a_.path, name, il, c_.n_layer);
  }

  // A is [rank][in], B [out][rank]; every pair of the adapter has one rank.
  void check_shape(const std::string& name, bool is_a, int64_t rows, int64_t cols, int64_t out, int64_t in,
                   const char* product) {
    const int64_t rank = is_a ? rows : cols;
    check(a_.rank == 0 || a_.rank == rank, "{}: tensor '{}' has rank {}, others {}", a_.path, name, rank, a_.rank);
    check(rank > 0 && rank <= 4096, "{}: tensor '{}' has a bad rank {}", a_.path, name, rank);
    a_.rank = rank;
    check(is_a ? cols == in : rows == out,
          "{}: tensor '{}' has shape [{}, {}], which does not fit the model's {} ({} x {}): an adapter of another model",
          a_.path, name, rows, cols, product, out, in);
  }

  void store(LoraPair& pair, bool is_a, std::vector<float> x, int64_t rows, int64_t cols) {
    if (!is_a) {
      std::vector<float> tr(x.size());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) tr[size_t(c * rows + r)] = x[size_t(r * cols + c)];
      a_.storage.push_back(std::move(tr));
      pair.bt = a_.storage.back().data();
    }
    a_.storage.push_back(std::move(x));
    WeightMatrix m{DType::F32, rows, cols, reinterpret_cast<const uint8_t*>(a_.storage.back().data()), size_t(cols) * 4};
    (is_a ? pair.a : pair.b) = m;
  }

  int count(const LoraPair& p, const char* what) const {
    check(p.a.empty() == p.b.empty(), "{}: a {} update has only one of its two matrices", a_.path, what);
    return !p.a.empty();
  }
};

void load_gguf(const std::string& path, const ModelConfig& c, LoraAdapter& a) {
  GgufFile g(path);
  const std::string type = g.find_string("general.type").value_or("adapter");
  check(type == "adapter" && g.find_string("adapter.type").value_or("lora") == "lora",
        "{}: not a LoRA adapter (general.type '{}')", path, type);
  const std::string arch = g.find_string("general.architecture").value_or("");
  check(arch == c.arch, "{}: an adapter for '{}', the model is '{}'", path, arch, c.arch);
  Builder b(c, a);
  // GGUF llama adapters have Q/K rows in interleaved order; a Hugging Face llama base keeps rotate-half.
  const int permute = c.arch == "llama" && c.rope_style == RopeStyle::Neox ? -1 : 0;
  static const std::regex re(R"(blk\.(\d+)\.(\w+)\.weight\.lora_(a|b))");
  for (const auto& t : g.tensors()) {
    std::smatch m;
    check(std::regex_match(t.name, m, re), "{}: tensor '{}' is not a layer's LoRA matrix (embedding and output "
                                           "adapters are not supported)", path, t.name);
    if (const int kind = expert_kind(m[2]); kind >= 0) {  // llama.cpp's stack of every expert's A or B
      check(t.ne.size() == 3 && int64_t(t.ne[2]) == c.n_expert, "{}: tensor '{}' is not a stack of the model's {} "
            "experts' matrices", path, t.name, c.n_expert);
      const int64_t cols = int64_t(t.ne[0]), rows = int64_t(t.ne[1]);
      std::vector<float> all(size_t(rows * cols * c.n_expert));
      dequantize_row(t.type, t.data, all.data(), all.size());
      for (int64_t e = 0; e < c.n_expert; ++e)
        b.set_expert(std::stoll(m[1]), e, kind, m[3] == "a",
                     std::vector<float>(all.begin() + e * rows * cols, all.begin() + (e + 1) * rows * cols), rows, cols,
                     t.name);
      continue;
    }
    const LoraTarget target = target_from_gguf(m[2]);
    check(target != LoraTarget::Count, "{}: tensor '{}' targets an unsupported product", path, t.name);
    b.set(std::stoll(m[1]), target, m[3] == "a", t, permute);
  }
  a.alpha = float(g.find_float("adapter.lora.alpha").value_or(double(a.rank)));
  b.finish();
}

void load_peft(const fs::path& dir, const ModelConfig& c, LoraAdapter& a) {
  const fs::path cfg_path = dir / "adapter_config.json";
  json cfg;
  try {
    cfg = json::parse(read_text_file(cfg_path.string()));
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", cfg_path.string(), e.what());
  }
  check(cfg.value("peft_type", "LORA") == "LORA", "{}: peft_type '{}' is not LORA", cfg_path.string(), cfg.value("peft_type", ""));
  check(!cfg.value("fan_in_fan_out", false) && cfg.value("bias", "none") == "none" &&
            (!cfg.contains("modules_to_save") || cfg["modules_to_save"].is_null()) &&
            cfg.value("rank_pattern", json::object()).empty() && cfg.value("alpha_pattern", json::object()).empty() &&
            !cfg.value("use_dora", false),
        "{}: unsupported LoRA options (fan_in_fan_out, bias, modules_to_save, rank or alpha patterns, DoRA)",
        cfg_path.string());
  const SafetensorsFile file((dir / "adapter_model.safetensors").string());
  Builder b(c, a);
  static const std::regex re(R"((?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+\.\w+(?:\.\w+)?)\.lora_(A|B)(?:\.default)?\.weight)");
  const int permute = c.rope_style == RopeStyle::Interleaved ? 1 : 0;  // a GGUF llama base
  for (const auto& t : file.tensors()) {
    std::smatch m;
    if (const auto e = parse_peft_expert(t.name)) {
      check(e->kind >= 0 && t.ne.size() == 2, "{}: tensor '{}' targets an unsupported expert module", dir.string(), t.name);
      std::vector<float> x(size_t(t.ne[0] * t.ne[1]));
      dequantize_row(t.type, t.data, x.data(), x.size());
      b.set_expert(e->layer, e->expert, e->kind, e->is_a, std::move(x), int64_t(t.ne[1]), int64_t(t.ne[0]), t.name);
      continue;
    }
    check(std::regex_match(t.name, m, re), "{}: tensor '{}' is not a layer's LoRA matrix", dir.string(), t.name);
    const LoraTarget target = target_from_peft(m[2]);
    check(target != LoraTarget::Count, "{}: tensor '{}' targets an unsupported module", dir.string(), t.name);
    b.set(std::stoll(m[1]), target, m[3] == "A", t, permute);
  }
  const float r = float(a.rank);
  a.alpha = cfg.value("lora_alpha", r);
  if (cfg.value("use_rslora", false)) a.alpha *= std::sqrt(r);  // alpha / sqrt(r) as alpha' / r
  b.finish();
}

}  // namespace lora_load

std::optional<PeftExpertTensor> parse_peft_expert(const std::string& name) {
  static const std::regex re(
      R"((?:base_model\.model\.)?model\.layers\.(\d{1,9})\.(?:mlp|block_sparse_moe)\.experts\.(\d{1,9})\.(\w+)\.lora_(A|B)(?:\.default)?\.weight)");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  return PeftExpertTensor{std::stoll(m[1]), std::stoll(m[2]), lora_load::expert_kind(m[3]), m[4] == "A"};
}

const char* expert_gguf_name(int kind) {
  static const char* names[] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
  return kind >= 0 && kind < 3 ? names[kind] : "?";
}

const char* lora_target_name(LoraTarget t) {
  static const char* names[] = {"attn_q",   "attn_k",         "attn_v",       "attn_output",   "ffn_gate",
                                "ffn_up",   "ffn_down",       "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
  return int(t) < int(LoraTarget::Count) ? names[int(t)] : "?";
}

std::shared_ptr<const LoraAdapter> load_lora(const std::string& path, const ModelConfig& config, std::string name,
                                             float scale) {
  check(!config.shard.split(), "LoRA adapters are not supported on a model split over ranks (--tp / --pp)");
  check(!config.mla, "LoRA adapters are not supported on a latent-attention (MLA) model");
  check(std::isfinite(scale), "{}: bad LoRA scale", path);
  auto a = std::make_shared<LoraAdapter>();
  a->name = std::move(name), a->path = path, a->scale = scale;
  namespace fs = std::filesystem;
  check(fs::exists(path), "{}: no such LoRA adapter file or directory", path);
  if (fs::is_directory(path)) lora_load::load_peft(path, config, *a);
  else lora_load::load_gguf(path, config, *a);
  return a;
}

}  // namespace serval
