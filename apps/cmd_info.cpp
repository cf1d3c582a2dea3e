// `serval info MODEL` and `serval tokenize -m MODEL -p TEXT` (or --jsonl FILE).
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "apps/parallel_flags.h"
#include "base/error.h"
#include "io/gguf.h"
#include "model/model.h"
#include "tokenizer/load.h"

namespace serval::cli {
namespace {

// The RoPE scaling a model runs with, for `serval info` ("" when none).
std::string rope_scaling_text(const ModelConfig& c, const Model& m) {
  if (c.yarn_factor > 0)
    return fmt::format(", YaRN factor {} over an original {} (betas {}/{}{}), cos/sin x {:.4f}", c.yarn_factor, c.rope_orig_ctx,
                       c.yarn_beta_fast, c.yarn_beta_slow, c.yarn_truncate ? "" : ", not truncated", c.rope_attn_factor);
  if (c.longrope)
    return fmt::format(", LongRoPE ({} factors: context {} {} the original {}), cos/sin x {:.4f}", m.uses_long_rope() ? "long" : "short",
                       c.n_ctx_train, m.uses_long_rope() ? ">" : "<=", c.rope_orig_ctx, c.rope_attn_factor);
  if (c.rope_linear_scale != 1.0f) return fmt::format(", linear scaling {}", c.rope_linear_scale);
  if (!m.weights().rope_freqs.empty()) return ", per-pair frequency factors (Llama 3.1)";
  return "";
}

void print_info(const std::string& path, const std::string& load_format) {
  auto model = Model::load(path, ParallelFlags::with_format({}, load_format));
  const auto& c = model->config();
  const auto& w = model->weights();
  uint64_t n_params = 0;
  std::map<std::string, int> types;
  auto count = [&](const WeightMatrix& m) {
    if (m.empty()) return;
    n_params += uint64_t(m.rows) * m.cols;
    ++types[std::string(dtype_info(m.type).name)];
  };
  count(w.tok_embd);
  if (w.output.data != w.tok_embd.data) count(w.output);
  uint64_t idle_expert_params = 0;  // per token: the experts a token does not run
  for (const auto& L : w.layers) {
    for (const auto* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.router, &L.sh_gate, &L.sh_up, &L.sh_down,
                          &L.wq_a, &L.wq_b, &L.wkv_a})
      count(*m);
    for (const auto* experts : {&L.exp_gate, &L.exp_up, &L.exp_down, &L.wk_b, &L.wv_b})
      for (const auto& m : *experts) count(m);
    if (!L.exp_gate.empty())
      idle_expert_params += uint64_t(c.n_expert - c.n_expert_used) * 3 * uint64_t(c.n_ff_exp) * uint64_t(c.n_embd);
    n_params += L.sh_router.size() + L.bo.size() + L.sinks.size() + L.router_b.size() + L.exp_gate_b.size() +
                L.exp_up_b.size() + L.exp_down_b.size();
    n_params += L.attn_norm.size() + L.ffn_norm.size() + L.bq.size() + L.bk.size() + L.bv.size() + L.q_norm.size() +
                L.k_norm.size() + L.post_attn_norm.size() + L.post_ffn_norm.size() + L.q_a_norm.size() + L.kv_a_norm.size();
  }
  n_params += w.output_norm.size();
  fmt::print("file:               {}\n", path);
  fmt::print("architecture:       {}\n", c.arch);
  fmt::print("parameters:         {} ({:.3f} B)\n", n_params, n_params / 1e9);
  fmt::print("vocabulary:         {}\n", c.n_vocab);
  fmt::print("context (trained):  {}\n", c.n_ctx_train);
  fmt::print("layers:             {}\n", c.n_layer);
  fmt::print("embedding:          {}\n", c.n_embd);
  fmt::print("heads / kv heads:   {} / {} (d_head {})\n", c.n_head, c.n_head_kv, c.d_head);
  fmt::print("feed-forward:       {}\n", c.n_ff);
  if (c.is_moe()) {
    const auto moe_layers = std::count(c.layer_is_moe.begin(), c.layer_is_moe.end(), 1);
    fmt::print("experts:            {} ({} used per token, expert FFN {}{}{}), in {} of {} layers\n", c.n_expert,
               c.n_expert_used, c.n_ff_exp, c.n_ff_shexp > 0 ? fmt::format(", shared expert FFN {}", c.n_ff_shexp) : "",
               c.expert_weights_norm ? ", weights renormalized" : "", moe_layers, c.n_layer);
    fmt::print("active parameters:  {} per token ({:.3f} B)\n", n_params - idle_expert_params, (n_params - idle_expert_params) / 1e9);
  }
  if (c.sliding_window > 0) fmt::print("sliding window:     {}\n", c.sliding_window);
  fmt::print("rope:               base {}{}\n", c.rope_base, rope_scaling_text(c, *model));
  fmt::print("matrix types:      ");
  for (const auto& [name, n] : types) fmt::print(" {} x{}", name, n);
  fmt::print("\n");
  fmt::print("weight memory:      {} bytes ({:.1f} MiB)\n", w.weight_bytes, w.weight_bytes / 1048576.0);
  if (c.mla) {
    fmt::print("latent attention:   kv_lora_rank {}, q_lora_rank {}, per head {} + {} query/key values, {} values\n",
               c.kv_lora_rank, c.q_lora_rank, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim);
    fmt::print("KV bytes per token: {} (F16: {} layers x ({} latent + {} rotated key) x 2 bytes: MLA); F32: {}\n",
               c.kv_bytes_per_token(2), c.n_layer, c.kv_lora_rank, c.qk_rope_dim, c.kv_bytes_per_token(4));
  } else {
    fmt::print("KV bytes per token: {} (F16: 2 x {} layers x {} kv heads x {} d_head x 2 bytes); F32: {}\n",
               c.kv_bytes_per_token(2), c.n_layer, c.n_head_kv, c.d_head, c.kv_bytes_per_token(4));
  }
  const auto& v = model->tokenizer().vocab();
  fmt::print("tokenizer:          {} ({} tokens, BOS {}, EOS {}, add BOS {})\n",
             v.kind == TokenizerKind::Spm ? "sentencepiece" : v.kind == TokenizerKind::ByteLevelBpe ? "byte-level BPE" : "BPE",
             v.tokens.size(), v.bos, v.eos, v.add_bos);
}

// The vocabulary alone (no weights are read): a GGUF file's, a directory's tokenizer.json, or the
// --tokenizer override. A vocabulary-only GGUF works too.
Vocab load_vocab(const std::string& path, const std::string& tokenizer_json) {
  if (!tokenizer_json.empty()) return vocab_from_tokenizer_json(tokenizer_json);
  if (std::filesystem::is_directory(path)) return vocab_from_tokenizer_json((std::filesystem::path(path) / "tokenizer.json").string());
  if (path.ends_with(".safetensors"))
    return vocab_from_tokenizer_json((std::filesystem::path(path).parent_path() / "tokenizer.json").string());
  return vocab_from_gguf(GgufFile(path));
}

}  // namespace

void add_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Show a model's architecture, parameters, types and memory");
  auto path = std::make_shared<std::string>(), format = std::make_shared<std::string>("auto");
  cmd->add_option("model,-m,--model", *path, "GGUF file, safetensors model directory, or cached model name")->required();
  ParallelFlags::add_load_format(cmd, *format);
  cmd->callback([path, format] { print_info(resolve_model_path(*path), *format); });
}

// `--jsonl FILE`: one JSON string per line, each answered by one line of space-separated ids (many
// texts for one load of the vocabulary; llama.cpp's tokenizer test vectors are checked this way).
void tokenize_jsonl(const Tokenizer& tok, const std::string& path, bool bos, bool special) {
  std::ifstream in(path);
  check(in.good(), "{}: cannot open", path);
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    nlohmann::json text;
    try {
      text = nlohmann::json::parse(line);
    } catch (const std::exception&) {
      fail("{}:{}: not a JSON string", path, n);
    }
    check(text.is_string(), "{}:{}: not a JSON string", path, n);
    fmt::print("{}\n", fmt::join(tok.encode(text.get<std::string>(), bos, special), " "));
  }
}

void add_tokenize(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenize", "Print the token ids of a text, one per line");
  struct Opts { std::string model, prompt, tokenizer, jsonl; bool no_bos = false, special = false, pieces = false; };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-m,--model,model", o->model, "model")->required();
  auto* prompt = cmd->add_option("-p,--prompt", o->prompt, "text to tokenize");
  auto* jsonl = cmd->add_option("--jsonl", o->jsonl, "a file of JSON strings, one per line: one line of ids each");
  prompt->excludes(jsonl);
  cmd->add_option("--tokenizer", o->tokenizer, "use this tokenizer.json instead of the model's");
  cmd->add_flag("--no-bos", o->no_bos, "add no special tokens (BOS/EOS)");
  cmd->add_flag("--parse-special", o->special, "turn special-token text such as <|im_start|> into its id");
  cmd->add_flag("--show-pieces", o->pieces, "print each id with its text");
  cmd->callback([o, prompt, jsonl] {
    check(prompt->count() + jsonl->count() == 1, "give the text with -p, or a file of texts with --jsonl");
    const Tokenizer tok(load_vocab(resolve_model_path(o->model), o->tokenizer));
    if (!o->jsonl.empty()) return tokenize_jsonl(tok, o->jsonl, !o->no_bos, o->special);
    for (int32_t id : tok.encode(o->prompt, !o->no_bos, o->special)) {
      if (o->pieces) fmt::print("{} -> '{}'\n", id, tok.token_to_piece(id, true));
      else fmt::print("{}\n", id);
    }
  });
}

}  // namespace serval::cli
