// `serval bench`: prompt-processing and generation throughput, as llama-bench measures them
// (pp: one batch of N prompt tokens; tg: N tokens decoded one at a time), median of R runs.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "apps/commands.h"
#include "apps/engine_flags.h"
#include "base/error.h"
#include "model/session.h"

namespace serval::cli {
namespace {

struct BenchOptions {
  std::string model, cache_type = "f16";
  int n_prompt = 128, n_gen = 64, reps = 3, threads = 0;
};

void run_bench(const BenchOptions& o) {
  set_threads(o.threads);
  check(o.reps > 0 && o.n_prompt >= 0 && o.n_gen >= 0, "-r must be > 0, -p and -n >= 0");
  auto model = Model::load(resolve_model_path(o.model));
  const int64_t n_vocab = model->config().n_vocab;
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(o.n_prompt);
  for (auto& t : prompt) t = int32_t(rng() % n_vocab);  // random tokens, as llama-bench
  SingleSequence seq(*model, std::max(1, o.n_prompt + o.n_gen), parse_cache_type(o.cache_type));
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  std::vector<double> pp, tg;
  for (int r = 0; r < o.reps; ++r) {
    if (o.n_prompt > 0) {
      seq.reset();
      const auto t0 = Clock::now();
      seq.eval(prompt);
      pp.push_back(o.n_prompt / secs(t0));
    }
    if (o.n_gen > 0) {
      seq.reset();
      const auto t0 = Clock::now();
      int32_t tok = 1;
      for (int i = 0; i < o.n_gen; ++i) tok = int32_t(seq.eval(std::span(&tok, 1)).at(0) > 0 ? 1 : 2);
      tg.push_back(o.n_gen / secs(t0));
    }
  }
  fmt::print("| model | test | t/s (median of {}) |\n|---|---|---|\n", o.reps);
  if (!pp.empty()) fmt::print("| {} | pp{} | {:.2f} |\n", o.model, o.n_prompt, median(pp));
  if (!tg.empty()) fmt::print("| {} | tg{} | {:.2f} |\n", o.model, o.n_gen, median(tg));
}

}  // namespace

void add_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Measure prompt processing (pp) and generation (tg) tokens/s");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("-m,--model", o->model, "model")->required();
  cmd->add_option("-p,--n-prompt", o->n_prompt, "prompt tokens (default 128)");
  cmd->add_option("-n,--n-gen", o->n_gen, "generated tokens (default 64)");
  cmd->add_option("-r,--repetitions", o->reps, "repetitions (default 3)");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  cmd->add_option("--cache-type,--cache-type-k", o->cache_type, "KV cache type (f16, f32)");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace serval::cli
