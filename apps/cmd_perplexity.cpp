// `serval perplexity`: llama.cpp's convention. The text is split into CTX-token chunks, each starting
// with BOS; only the second half of each chunk is scored; PPL +/- its standard error is reported.
#include <fmt/core.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "apps/commands.h"
#include "apps/lora_flags.h"
#include "apps/parallel_flags.h"
#include "base/error.h"
#include "base/file_util.h"
#include "model/session.h"
#include "sampling/sampler.h"

namespace serval::cli {
namespace {

struct PerplexityOptions {
  std::string model, file, tokenizer, cache_type = "f16";
  int ctx = 512, threads = 0, max_chunks = -1, batch = 512;
  ParallelFlags parallel;
};

void run_perplexity(const PerplexityOptions& o) {
  set_threads(o.threads);
  const std::string text = read_text_file(o.file);
  auto model = o.parallel.load(resolve_model_path(o.model), {o.tokenizer});
  const auto& tok = model->tokenizer();
  check(o.ctx >= 4, "-c must be at least 4");
  const std::vector<int32_t> tokens = tok.encode(text, /*add_special=*/true);
  const int64_t n_ctx = o.ctx;
  int64_t n_chunks = int64_t(tokens.size()) / n_ctx;
  if (o.max_chunks >= 0) n_chunks = std::min<int64_t>(n_chunks, o.max_chunks);
  check(n_chunks > 0, "{}: {} tokens is fewer than one chunk of {} (need at least 2 x ctx for a meaningful score)",
        o.file, tokens.size(), n_ctx);
  fmt::print(stderr, "perplexity: {} tokens, {} chunks of {}\n", tokens.size(), n_chunks, n_ctx);
  SingleSequence seq(*model, n_ctx, parse_cache_type(o.cache_type));
  const int64_t first = n_ctx / 2;
  const bool add_bos = tok.vocab().add_bos && tok.vocab().bos >= 0;
  double nll = 0, nll2 = 0;
  int64_t count = 0;
  const int64_t n_vocab = tok.n_vocab();
  for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
    std::vector<int32_t> input(tokens.begin() + chunk * n_ctx, tokens.begin() + (chunk + 1) * n_ctx);
    if (add_bos) input[0] = tok.vocab().bos;
    seq.reset();
    const std::vector<float> logits = seq.eval(input, /*all_logits=*/true, o.batch);
    for (int64_t j = first; j < n_ctx - 1; ++j) {
      const float* row = logits.data() + j * n_vocab;
      const int32_t target = tokens[chunk * n_ctx + j + 1];
      float mx = row[0];
      for (int64_t v = 1; v < n_vocab; ++v) mx = std::max(mx, row[v]);
      double sum = 0;
      for (int64_t v = 0; v < n_vocab; ++v) sum += std::exp(double(row[v]) - mx);
      const double token_nll = -(double(row[target]) - mx - std::log(sum));
      nll += token_nll;
      nll2 += token_nll * token_nll;
      ++count;
    }
    fmt::print("[{}]{:.4f} ", chunk + 1, std::exp(nll / count));
    std::fflush(stdout);
  }
  const double mean = nll / count;
  const double var = nll2 / count - mean * mean;
  const double ppl = std::exp(mean);
  const double err = var > 0 && count > 1 ? std::sqrt(var / (count - 1)) * ppl : 0;
  fmt::print("\nFinal estimate: PPL = {:.4f} +/- {:.5f}\n", ppl, err);
}

}  // namespace

void add_perplexity(CLI::App& app) {
  auto* cmd = app.add_subcommand("perplexity", "Perplexity of a text file (llama.cpp convention)");
  auto o = std::make_shared<PerplexityOptions>();
  cmd->add_option("-m,--model,model", o->model, "model")->required();
  cmd->add_option("-f,--file", o->file, "text file")->required();
  cmd->add_option("-c,--ctx-size", o->ctx, "chunk (context) size (default 512)");
  cmd->add_option("-b,--batch-size", o->batch, "tokens per forward pass (default 512)");
  cmd->add_option("--chunks", o->max_chunks, "score at most this many chunks");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  o->parallel.add_to(cmd);
  cmd->add_option("--tokenizer", o->tokenizer, "use this tokenizer.json instead of the model's");
  cmd->add_option("--cache-type,--cache-type-k,--kv-cache-dtype", o->cache_type, kKvCacheTypeHelp);
  cmd->callback([o] { run_perplexity(*o); });
}

}  // namespace serval::cli

namespace serval::cli {
namespace {

struct ScoreOptions {
  std::string model, prompt, ids, cache_type = "f16", tokenizer, load_format = "auto";
  bool no_bos = false;
  int threads = 0;
  LoraFlags lora;
};

// Teacher-forced scoring: after the prompt, each given token is appended in one batch; for every
// position print the model's own greedy choice and the log-probability of the given token.
void run_score(const ScoreOptions& o) {
  set_threads(o.threads);
  auto model = Model::load(resolve_model_path(o.model), ParallelFlags::with_format({o.tokenizer}, o.load_format));
  const size_t n_adapters = o.lora.load(*model);
  check(n_adapters <= 1, "score applies one LoRA adapter at a time ({} given)", n_adapters);
  const auto& tok = model->tokenizer();
  std::vector<int32_t> tokens = tok.encode(o.prompt, !o.no_bos);
  check(!tokens.empty(), "the prompt is empty");
  const size_t n_prompt = tokens.size();
  std::vector<int32_t> given;
  std::stringstream ss(o.ids);
  for (std::string item; std::getline(ss, item, ',');) {
    try {
      given.push_back(std::stoi(item));
    } catch (const std::exception&) {
      fail("--ids expects comma-separated token ids, got '{}'", item);
    }
    check(given.back() >= 0 && given.back() < tok.n_vocab(), "token id {} is outside the vocabulary", given.back());
  }
  tokens.insert(tokens.end(), given.begin(), given.end());
  SingleSequence seq(*model, int64_t(tokens.size()), parse_cache_type(o.cache_type));
  if (n_adapters == 1) seq.set_adapter(0, model->adapters()[0]->scale);
  const auto logits = seq.eval(tokens, /*all_logits=*/true);
  const int64_t n_vocab = tok.n_vocab();
  for (size_t i = 0; i < given.size(); ++i) {
    const std::span<const float> row(logits.data() + (n_prompt - 1 + i) * n_vocab, n_vocab);
    const auto r = logprobs_of(row, given[i], 0);
    fmt::print("{{\"id\": {}, \"logprob\": {:.5f}, \"argmax\": {}}}\n", given[i], r.logprob, argmax(row));
  }
}

}  // namespace

void add_score(CLI::App& app) {
  auto* cmd = app.add_subcommand("score", "Log-probabilities of given continuation tokens (teacher forcing), one JSON line each");
  auto o = std::make_shared<ScoreOptions>();
  cmd->add_option("-m,--model,model", o->model, "model")->required();
  cmd->add_option("-p,--prompt", o->prompt, "prompt text")->required();
  cmd->add_option("--ids", o->ids, "comma-separated continuation token ids")->required();
  cmd->add_option("--cache-type,--cache-type-k,--kv-cache-dtype", o->cache_type, kKvCacheTypeHelp);
  cmd->add_flag("--no-bos", o->no_bos, "do not add BOS");
  cmd->add_option("--tokenizer", o->tokenizer, "use this tokenizer.json instead of the model's");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  ParallelFlags::add_load_format(cmd, o->load_format);
  o->lora.add_to(cmd);
  cmd->callback([o] { run_score(*o); });
}

}  // namespace serval::cli
