// `serval generate`: stream a completion to stdout, timings to stderr.
#include <fmt/core.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "apps/lora_flags.h"
#include "apps/engine_flags.h"
#include "apps/parallel_flags.h"
#include "base/error.h"
#include "base/file_util.h"
#include "base/utf8.h"
#include "engine/engine.h"
#include "sampling/sampler.h"

namespace serval::cli {
namespace {

struct GenerateOptions {
  std::string model, prompt, prompt_file, tokenizer, cache_type = "f16";
  int n_predict = 128, ctx = 0, threads = 0;
  bool no_bos = false, json = false, ignore_eos = false, special = false;
  SamplingParams sampling;
  std::vector<std::string> logit_bias;
  SpecFlags spec;
  ParallelFlags parallel;
  LoraFlags lora;
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void parse_logit_bias(const std::vector<std::string>& items, SamplingParams& s) {
  for (const auto& item : items) {  // "ID+BIAS" or "ID-BIAS" or "ID=BIAS", as llama.cpp's --logit-bias
    const auto sep = item.find_first_of("+-=", 1);
    check(sep != std::string::npos, "--logit-bias expects TOKEN_ID(+|-|=)BIAS, got '{}'", item);
    try {
      const int32_t id = std::stoi(item.substr(0, sep));
      float bias = std::stof(item.substr(sep + (item[sep] == '=' ? 1 : 0)));
      s.logit_bias.emplace_back(id, bias);
    } catch (const std::exception&) {
      fail("--logit-bias expects TOKEN_ID(+|-|=)BIAS, got '{}'", item);
    }
  }
}

// Prints one generated token (text, or a JSON line with its log-probabilities).
void print_token(const GenerateOptions& o, const Tokenizer& tok, const TokenEvent& ev, Utf8StreamDecoder& utf8) {
  const std::string piece = tok.token_to_piece(ev.token);
  if (o.json) {
    nlohmann::json j{{"id", ev.token}, {"text", piece}, {"logprob", ev.logprob}};
    for (const auto& t : ev.top) j["top"].push_back({{"id", t.id}, {"logprob", t.logprob}});
    fmt::print("{}\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("{}", utf8.push(piece));
  }
  std::fflush(stdout);
}

// One request on the engine, with the whole prompt in one step and KV for exactly n_ctx tokens.
EngineConfig generate_config(GenerateOptions& o, int64_t n_ctx, size_t n_prompt) {
  EngineConfig cfg;
  cfg.kv_type = parse_cache_type(o.cache_type);
  cfg.block_size = 16;
  cfg.num_blocks = int32_t((n_ctx + 15) / 16);
  cfg.max_model_len = n_ctx;
  cfg.prefix_caching = false;
  cfg.scheduler.max_batched_tokens = std::max<int64_t>(int64_t(n_prompt), 64);
  cfg.scheduler.max_seqs = 1;
  cfg.spec = o.spec.load();
  return cfg;
}

std::string spec_summary(const EngineStats& st, const std::string& method) {
  if (method == "none") return "";
  const auto& s = st.spec;
  return fmt::format(" | speculative {}: {} of {} proposed tokens accepted ({:.0f} %), {:.2f} tokens per step",
                     method, s.accepted_tokens, s.draft_tokens,
                     s.draft_tokens ? 100.0 * double(s.accepted_tokens) / double(s.draft_tokens) : 0.0,
                     st.steps > 1 ? double(st.generation_tokens - 1) / double(st.steps - 1) : 0.0);
}

void run_generate(GenerateOptions& o) {
  set_threads(o.threads);
  if (!o.prompt_file.empty()) {
    o.prompt = read_text_file(o.prompt_file);
  }
  const auto t_load = Clock::now();
  auto model = o.parallel.load(resolve_model_path(o.model), {o.tokenizer});
  const auto& tok = model->tokenizer();
  parse_logit_bias(o.logit_bias, o.sampling);
  o.sampling.validate(tok.n_vocab());
  check(o.n_predict >= 0, "-n must be >= 0");
  std::vector<int32_t> prompt = tok.encode(o.prompt, !o.no_bos, o.special);
  check(!prompt.empty(), "the prompt is empty (nothing to condition on; drop --no-bos or give text)");
  const int64_t n_ctx = o.ctx > 0 ? o.ctx : std::min<int64_t>(model->config().n_ctx_train, prompt.size() + o.n_predict);
  check(int64_t(prompt.size()) < n_ctx, "prompt of {} tokens does not fit the context of {}", prompt.size(), n_ctx);
  o.spec.load_heads(*model);
  const size_t n_adapters = o.lora.load(*model);
  check(n_adapters <= 1, "generate applies one LoRA adapter at a time ({} given)", n_adapters);
  model->set_context_length(n_ctx);  // LongRoPE: the short factors unless n_ctx exceeds the original context
  Engine engine(*model, generate_config(o, n_ctx, prompt.size()));
  const double load_s = seconds_since(t_load);
  if (!o.json) fmt::print("{}", o.prompt), std::fflush(stdout);
  if (o.n_predict == 0) return void(fmt::print("\n"));

  GenerationParams params;
  params.sampling = o.sampling;
  params.sampling.compute_logprob = o.json;  // only --json prints it: a log-sum-exp over the vocabulary per token
  params.max_tokens = o.n_predict;
  params.ignore_eos = o.ignore_eos;
  if (n_adapters == 1) params.adapter = 0, params.adapter_scale = model->adapters()[0]->scale;
  Utf8StreamDecoder utf8;
  double ttft = 0;
  int n_gen = 0;
  std::string error;
  const auto t0 = Clock::now();
  engine.add_request(prompt, params, [&](const TokenEvent& ev) {
    if (ev.finished) return void(error = ev.error);
    if (n_gen++ == 0) ttft = seconds_since(t0);
    print_token(o, tok, ev, utf8);
  });
  while (engine.step()) {
  }
  check(error.empty(), "generation failed: {}", error);
  const double total = seconds_since(t0);
  if (!o.json) fmt::print("{}\n", utf8.flush());
  const double tpot = n_gen > 1 ? (total - ttft) / (n_gen - 1) : 0;
  fmt::print(stderr, "\nload {:.2f} s | prompt {} tokens | generated {} tokens | TTFT {:.1f} ms | TPOT {:.1f} ms | "
             "{:.2f} tokens/s{}\n", load_s, prompt.size(), n_gen, ttft * 1e3, tpot * 1e3, tpot > 0 ? 1.0 / tpot : 0.0,
             spec_summary(engine.stats(), engine.spec_name()));
}

}  // namespace

void add_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Complete a prompt, streaming text to stdout");
  auto o = std::make_shared<GenerateOptions>();
  auto& s = o->sampling;
  cmd->add_option("-m,--model,model", o->model, "GGUF file, safetensors directory or cached model name")->required();
  cmd->add_option("-p,--prompt", o->prompt, "prompt text");
  cmd->add_option("-f,--file", o->prompt_file, "read the prompt from a file");
  cmd->add_option("-n,--n-predict", o->n_predict, "tokens to generate (default 128)");
  cmd->add_option("-c,--ctx-size", o->ctx, "context size (default: prompt + n, at most the trained context)");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  cmd->add_option("--temp", s.temperature, "temperature; 0 = greedy (default 0.8)");
  cmd->add_option("--top-k", s.top_k, "top-k, 0 = off (default 40)");
  cmd->add_option("--top-p", s.top_p, "top-p, 1 = off (default 0.95)");
  cmd->add_option("--min-p", s.min_p, "min-p, 0 = off (default 0.05)");
  cmd->add_option("--repeat-penalty", s.repeat_penalty, "repetition penalty, 1 = off (default 1)");
  cmd->add_option("--repeat-last-n", s.repeat_last_n, "tokens the penalties look back over (default 64, -1 = all)");
  cmd->add_option("--presence-penalty", s.presence_penalty, "presence penalty (default 0)");
  cmd->add_option("--frequency-penalty", s.frequency_penalty, "frequency penalty (default 0)");
  cmd->add_option("--logit-bias", o->logit_bias, "TOKEN_ID(+|-)BIAS, repeatable");
  cmd->add_option("-s,--seed", s.seed, "random seed (same seed, same output)");
  cmd->add_option("--logprobs", s.n_logprobs, "report the top N log-probabilities per token (with --json)");
  cmd->add_option("--tokenizer", o->tokenizer, "use this tokenizer.json instead of the model's");
  cmd->add_option("--cache-type,--cache-type-k,--kv-cache-dtype", o->cache_type, kKvCacheTypeHelp);
  cmd->add_flag("--no-bos", o->no_bos, "do not add BOS");
  cmd->add_flag("--parse-special", o->special, "turn special-token text in the prompt into its id");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "keep generating past end-of-generation tokens");
  o->spec.add_to(cmd);
  o->parallel.add_to(cmd);
  o->lora.add_to(cmd);
  cmd->add_flag("--json", o->json, "print one JSON object per generated token (id, text, logprob, top)");
  cmd->callback([o] { run_generate(*o); });
}

}  // namespace serval::cli
