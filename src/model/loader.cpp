// Model::load for GGUF files and Hugging Face safetensors layouts.
#include <filesystem>
#include <regex>

#include "base/error.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/dummy.h"
#include "model/gpt_oss.h"
#include "model/model.h"
#include "model/requant.h"
#include "tokenizer/load.h"

namespace serval {
namespace {

namespace fs = std::filesystem;

// This process's share of the model when LoadOptions split it, and the logits it computes.
void set_shard(ModelConfig& c, const LoadOptions& o) {
  if (o.tp * o.pp > 1) c.shard = make_shard_layout(c, o.tp, o.pp, o.tp_rank, o.stage);
  check(o.logit_rows >= 0, "logits for {} tokens asked", o.logit_rows);
  check(o.logit_rows == 0 || o.logit_rows >= c.n_vocab || o.tp * o.pp == 1,
        "a model split over ranks computes all of its logits");
  c.logit_rows = o.logit_rows >= c.n_vocab ? 0 : o.logit_rows;
}

// A GGUF file; with LoadOptions::dummy its header alone (a shape file or any GGUF), the weights made by
// dummy_tensors() instead of read; with LoadOptions::requant its matrices made by requantized_tensors().
class GgufModel : public Model {
 public:
  GgufModel(const std::string& path, const LoadOptions& options)
      : file_(path, options.dummy ? GgufFile::Data::Absent : GgufFile::Data::Required),
        dummy_(options.dummy ? dummy_tensors(file_, options.dummy_seed) : nullptr) {
    path_ = path;
    config_ = config_from_gguf(file_);
    set_shard(config_, options);
    if (options.requant) {
      check(!options.dummy, "{}: dummy weights are made in the file's own types; requantize the file instead", path);
      requant_ = requantized_tensors(file_, *options.requant);
    }
    auto lookup = [this](const std::string& n) {
      if (dummy_) return dummy_->find(n);
      const TensorRef* made = requant_ ? requant_->find(n) : nullptr;
      return made ? made : file_.find_tensor(n);
    };
    // Pages of anonymous memory (dummy or requantized weights) read zeros once given back.
    weights_ = bind_weights(config_, lookup, path, /*reloadable=*/!dummy_ && !requant_);
    Vocab vocab = options.tokenizer_json.empty() ? vocab_from_gguf(file_) : vocab_from_tokenizer_json(options.tokenizer_json);
    check(int64_t(vocab.tokens.size()) == config_.n_vocab, "{}: tokenizer has {} tokens but the model {}", path,
          vocab.tokens.size(), config_.n_vocab);
    tokenizer_ = std::make_unique<Tokenizer>(std::move(vocab));
  }

 private:
  GgufFile file_;
  std::unique_ptr<MadeTensors> dummy_;    // every tensor (--load-format dummy)
  std::unique_ptr<MadeTensors> requant_;  // the converted ones; the rest are the file's
};

using RenameRules = std::vector<std::pair<std::regex, std::string>>;

// `name` rewritten by the first rule whose pattern matches it whole, or "" when none does.
std::string rename(const RenameRules& rules, const std::string& name) {
  for (const auto& [re, fmt] : rules)
    if (std::regex_match(name, re)) return std::regex_replace(name, re, fmt);
  return "";
}

// GGUF tensor name -> Hugging Face tensor name (Llama / Qwen2 / Qwen3 / their MoE layouts; Gemma's
// four norms per layer; Phi-3's fused matrices; DeepSeek-V2's latent attention and shared experts).
std::string hf_name(const std::string& gguf_name, const std::string& arch) {
  static const RenameRules gemma = {
      {std::regex(R"(blk\.(\d+)\.ffn_norm\.(\w+))"), "model.layers.$1.pre_feedforward_layernorm.$2"},
      {std::regex(R"(blk\.(\d+)\.post_attention_norm\.(\w+))"), "model.layers.$1.post_attention_layernorm.$2"},
      {std::regex(R"(blk\.(\d+)\.post_ffw_norm\.(\w+))"), "model.layers.$1.post_feedforward_layernorm.$2"},
  };
  static const RenameRules phi3 = {
      {std::regex(R"(blk\.(\d+)\.attn_qkv\.(\w+))"), "model.layers.$1.self_attn.qkv_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_up\.(\w+))"), "model.layers.$1.mlp.gate_up_proj.$2"},
  };
  static const RenameRules gpt_oss = {
      {std::regex(R"(blk\.(\d+)\.post_attention_norm\.(\w+))"), "model.layers.$1.post_attention_layernorm.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_sinks\.weight)"), "model.layers.$1.self_attn.sinks"},
      {std::regex(R"(blk\.(\d+)\.ffn_gate_inp\.(\w+))"), "model.layers.$1.mlp.router.$2"},
  };
  static const RenameRules deepseek2 = {
      {std::regex(R"(blk\.(\d+)\.attn_q_a\.(\w+))"), "model.layers.$1.self_attn.q_a_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_q_a_norm\.(\w+))"), "model.layers.$1.self_attn.q_a_layernorm.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_q_b\.(\w+))"), "model.layers.$1.self_attn.q_b_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_kv_a_mqa\.(\w+))"), "model.layers.$1.self_attn.kv_a_proj_with_mqa.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_kv_a_norm\.(\w+))"), "model.layers.$1.self_attn.kv_a_layernorm.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_kv_b\.(\w+))"), "model.layers.$1.self_attn.kv_b_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_(gate|up|down)_shexp\.(\w+))"), "model.layers.$1.mlp.shared_experts.$2_proj.$3"},
  };
  const RenameRules* own = arch == "phi3"                          ? &phi3
                           : arch == "gemma2" || arch == "gemma3" ? &gemma
                           : arch == "gpt-oss"                     ? &gpt_oss
                           : arch == "deepseek2"                   ? &deepseek2
                                                                   : nullptr;
  if (own)
    if (std::string name = rename(*own, gguf_name); !name.empty()) return name;
  static const RenameRules rules = {
      {std::regex(R"(token_embd\.weight)"), "model.embed_tokens.weight"},
      {std::regex(R"(output_norm\.weight)"), "model.norm.weight"},
      {std::regex(R"(output\.weight)"), "lm_head.weight"},
      {std::regex(R"(blk\.(\d+)\.attn_norm\.(\w+))"), "model.layers.$1.input_layernorm.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_q_norm\.(\w+))"), "model.layers.$1.self_attn.q_norm.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_k_norm\.(\w+))"), "model.layers.$1.self_attn.k_norm.$2"},
      // Mixture of experts: one tensor per expert (Qwen2/Qwen3-MoE, OLMoE), the router, the shared expert.
      {std::regex(R"(blk\.(\d+)\.ffn_gate\.(\d+)\.(\w+))"), "model.layers.$1.mlp.experts.$2.gate_proj.$3"},
      {std::regex(R"(blk\.(\d+)\.ffn_up\.(\d+)\.(\w+))"), "model.layers.$1.mlp.experts.$2.up_proj.$3"},
      {std::regex(R"(blk\.(\d+)\.ffn_down\.(\d+)\.(\w+))"), "model.layers.$1.mlp.experts.$2.down_proj.$3"},
      {std::regex(R"(blk\.(\d+)\.ffn_gate_inp\.(\w+))"), "model.layers.$1.mlp.gate.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_gate_inp_shexp\.(\w+))"), "model.layers.$1.mlp.shared_expert_gate.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_gate_shexp\.(\w+))"), "model.layers.$1.mlp.shared_expert.gate_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_up_shexp\.(\w+))"), "model.layers.$1.mlp.shared_expert.up_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_down_shexp\.(\w+))"), "model.layers.$1.mlp.shared_expert.down_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_q\.(\w+))"), "model.layers.$1.self_attn.q_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_k\.(\w+))"), "model.layers.$1.self_attn.k_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_v\.(\w+))"), "model.layers.$1.self_attn.v_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.attn_output\.(\w+))"), "model.layers.$1.self_attn.o_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_norm\.(\w+))"), "model.layers.$1.post_attention_layernorm.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_gate\.(\w+))"), "model.layers.$1.mlp.gate_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_up\.(\w+))"), "model.layers.$1.mlp.up_proj.$2"},
      {std::regex(R"(blk\.(\d+)\.ffn_down\.(\w+))"), "model.layers.$1.mlp.down_proj.$2"},
  };
  return rename(rules, gguf_name);
}

// Mixtral's spelling of the same tensors (block_sparse_moe, w1 = gate, w2 = down, w3 = up), or "".
std::string mixtral_name(const std::string& hf) {
  static const RenameRules rules = {
      {std::regex(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.(\w+))"), "model.layers.$1.block_sparse_moe.experts.$2.w1.$3"},
      {std::regex(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.(\w+))"), "model.layers.$1.block_sparse_moe.experts.$2.w2.$3"},
      {std::regex(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.(\w+))"), "model.layers.$1.block_sparse_moe.experts.$2.w3.$3"},
      {std::regex(R"(model\.layers\.(\d+)\.mlp\.gate\.(\w+))"), "model.layers.$1.block_sparse_moe.gate.$2"},
  };
  return rename(rules, hf);
}

class SafetensorsModel : public Model {
 public:
  SafetensorsModel(const fs::path& dir, const fs::path& weights_file, const LoadOptions& options)
      : file_(weights_file.string()) {
    path_ = weights_file.string();
    config_ = config_from_hf((dir / "config.json").string());
    set_shard(config_, options);
    auto lookup = [this](const std::string& n) -> const TensorRef* {
      if (config_.arch == "gpt-oss")
        if (const TensorRef* t = gpt_oss_.find(n)) return t;
      const std::string name = hf_name(n, config_.arch);
      if (name.empty()) return nullptr;
      const TensorRef* t = file_.find_tensor(name);
      if (!t && config_.is_moe())
        if (const std::string m = mixtral_name(name); !m.empty()) t = file_.find_tensor(m);
      // Tied embeddings may be stored under either name.
      if (!t && name == "model.embed_tokens.weight") t = file_.find_tensor("lm_head.weight");
      return t;
    };
    weights_ = bind_weights(config_, lookup, path_);
    const std::string tok = options.tokenizer_json.empty() ? (dir / "tokenizer.json").string() : options.tokenizer_json;
    Vocab vocab = vocab_from_tokenizer_json(tok);
    check(int64_t(vocab.tokens.size()) <= config_.n_vocab, "{}: tokenizer has {} tokens but the model {}", tok,
          vocab.tokens.size(), config_.n_vocab);
    vocab.tokens.resize(config_.n_vocab);
    vocab.attrs.resize(config_.n_vocab, TokenAttr::Unused);
    tokenizer_ = std::make_unique<Tokenizer>(std::move(vocab));
  }

 private:
  SafetensorsFile file_;
  GptOssExperts gpt_oss_{[this](const std::string& n) { return file_.find_tensor(n); }};
};

std::unique_ptr<Model> open_model(const std::string& path, const LoadOptions& options) {
  const fs::path p(path);
  check(fs::exists(p), "{}: no such file or directory", path);
  if (options.dummy) {
    check(!fs::is_directory(p) && p.extension() != ".safetensors",
          "{}: --load-format dummy takes a GGUF file or shape file (serval export-shape; convert a directory first)", path);
    return std::make_unique<GgufModel>(path, options);
  }
  check(!options.requant || (!fs::is_directory(p) && p.extension() != ".safetensors"),
        "{}: requantizing at load takes a GGUF file (serval convert a checkpoint first)", path);
  if (fs::is_directory(p)) {
    const fs::path weights = p / "model.safetensors";
    check(fs::exists(weights), "{}: directory has no model.safetensors (sharded checkpoints are not supported)", path);
    return std::make_unique<SafetensorsModel>(p, weights, options);
  }
  if (p.extension() == ".safetensors") return std::make_unique<SafetensorsModel>(p.parent_path(), p, options);
  return std::make_unique<GgufModel>(path, options);
}

}  // namespace

std::unique_ptr<Model> Model::load(const std::string& path, const LoadOptions& options) {
  std::unique_ptr<Model> m = open_model(path, options);
  m->set_context_length(m->config_.n_ctx_train);  // RoPE factors and the K centres
  m->expert_tokens_ = std::vector<std::atomic<uint64_t>>(size_t(m->config_.n_layer * m->config_.n_expert));
  return m;
}

}  // namespace serval
