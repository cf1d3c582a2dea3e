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
    default: return {0, 0};
  }
}

LoraTarget target_from_gguf(const std::string& kind) {
  for (int t = 0; t < int(LoraTarget::Count); ++t)
    if (kind == lora_target_name(LoraTarget(t))) return LoraTarget(t);
  return LoraTarget::Count;
}

LoraTarget target_from_peft(const std::string& module) {
  static const std::map<std::string, LoraTarget> m = {
      {"self_attn.q_proj", LoraTarget::Q},  {"self_attn.k_proj", LoraTarget::K}, {"self_attn.v_proj", LoraTarget::V},
      {"self_attn.o_proj", LoraTarget::O},  {"mlp.gate_proj", LoraTarget::Gate}, {"mlp.up_proj", LoraTarget::Up},
      {"mlp.down_proj", LoraTarget::Down}};
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
    check(il >= 0 && il < c_.n_layer, "{}: tensor '{}' is for layer {}, the model has {}", a_.path, ref.name, il, c_.n_layer);
    check(ref.ne.size() == 2, "{}: tensor '{}' is not a matrix", a_.path, ref.name);
    // A mixture-of-experts layer has no dense FFN products to update (its experts take no adapters).
    const bool ffn = t == LoraTarget::Gate || t == LoraTarget::Up || t == LoraTarget::Down;
    check(!ffn || c_.layer_is_moe.empty() || !c_.layer_is_moe[size_t(il)],
          "{}: tensor '{}' updates the FFN of layer {}, a mixture-of-experts layer: LoRA on experts is not "
          "supported (attention projections are)", a_.path, ref.name, il);
    const auto [out, in] = target_shape(c_, t);
    const int64_t rows = int64_t(ref.ne[1]), cols = int64_t(ref.ne[0]);
    const int64_t rank = is_a ? rows : cols;
    check(a_.rank == 0 || a_.rank == rank, "{}: tensor '{}' has rank {}, others {}", a_.path, ref.name, rank, a_.rank);
    check(rank > 0 && rank <= 4096, "{}: tensor '{}' has a bad rank {}", a_.path, ref.name, rank);
    a_.rank = rank;
    check(is_a ? cols == in : rows == out,
          "{}: tensor '{}' has shape [{}, {}], which does not fit the model's {} ({} x {}): an adapter of another model",
          a_.path, ref.name, rows, cols, lora_target_name(t), out, in);
    std::vector<float> x(size_t(rows * cols));
    dequantize_row(ref.type, ref.data, x.data(), x.size());
    if (permute != 0 && !is_a && (t == LoraTarget::Q || t == LoraTarget::K))
      x = interleave_rows(x, rows, cols, t == LoraTarget::Q ? c_.n_head : c_.n_head_kv, permute < 0);
    LoraPair& pair = a_.layers[size_t(il)][size_t(t)];
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

  void finish() {
    int pairs = 0;
    for (auto& layer : a_.layers)
      for (int t = 0; t < int(LoraTarget::Count); ++t) {
        const LoraPair& p = layer[size_t(t)];
        check(p.a.empty() == p.b.empty(), "{}: a {} update has only one of its two matrices", a_.path, lora_target_name(LoraTarget(t)));
        pairs += !p.a.empty();
      }
    check(pairs > 0, "{}: no LoRA tensors for the model's matrix products", a_.path);
    check(std::isfinite(a_.alpha) && a_.alpha > 0, "{}: bad LoRA alpha {}", a_.path, a_.alpha);
  }

 private:
  const ModelConfig& c_;
  LoraAdapter& a_;
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
  static const std::regex re(R"((?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+\.\w+)\.lora_(A|B)(?:\.default)?\.weight)");
  const int permute = c.rope_style == RopeStyle::Interleaved ? 1 : 0;  // a GGUF llama base
  for (const auto& t : file.tensors()) {
    std::smatch m;
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

const char* lora_target_name(LoraTarget t) {
  static const char* names[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"};
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
