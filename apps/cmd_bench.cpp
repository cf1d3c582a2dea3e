// `serval bench`: prompt-processing and generation throughput, as llama-bench measures them
// (pp: one batch of N prompt tokens; tg: N tokens decoded one at a time), median of R runs.
// -d/--n-depth D: each test runs after D context tokens are in the KV cache (their evaluation is not
// timed), as llama-bench's -d. --roofline: measures the machine's int8 peak and read bandwidth first
// (kernels/probe.h) and adds a column: pp as a fraction of the int8 peak, tg of the bandwidth.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "apps/commands.h"
#include "apps/engine_flags.h"
#include "apps/parallel_flags.h"
#include "base/error.h"
#include "base/file_util.h"
#include "engine/engine.h"
#include "kernels/cpu/packed.h"
#include "kernels/probe.h"
#include "model/session.h"

namespace serval::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchOptions {
  std::string model, cache_type = "f16", prompt_file;
  int n_prompt = 128, n_gen = 64, reps = 3, threads = 0;
  std::vector<int> depths{0};
  bool roofline = false;
  mutable SpecFlags spec;
  ParallelFlags parallel;
};

// With --spec: greedy generation of n_gen tokens on the engine after a prompt (the --file text, else the
// random prompt), without and with speculation; decode tokens/s (after the first token), median of reps.
struct SpecRow {
  std::string test;
  double tps;
  std::string note;
};

std::vector<SpecRow> spec_rows(const BenchOptions& o, const Model& model, const std::vector<int32_t>& random_prompt) {
  const std::vector<int32_t> prompt =
      o.prompt_file.empty() ? random_prompt : model.tokenizer().encode(read_text_file(o.prompt_file), true, true);
  check(!prompt.empty(), "the --file prompt is empty");
  o.spec.load_heads(model);
  std::vector<SpecRow> rows;
  for (bool speculate : {false, true}) {
    EngineConfig cfg;
    cfg.kv_type = parse_cache_type(o.cache_type);
    cfg.num_blocks = int32_t((prompt.size() + o.n_gen + 15) / 16 + 1);
    cfg.prefix_caching = false;
    cfg.scheduler.max_batched_tokens = std::max<int64_t>(int64_t(prompt.size()), 64);
    if (speculate) cfg.spec = o.spec.load();
    // Every rep asks the same: suffix speculation's store of earlier outputs would propose reps 2.. from
    // rep 1's output. Off, so that each rep measures a first request.
    cfg.spec.suffix_cache = 0;
    Engine e(model, cfg);
    std::vector<double> tps;
    for (int r = 0; r < o.reps; ++r) {
      GenerationParams p;
      p.sampling.temperature = 0;
      p.sampling.compute_logprob = false;  // greedy tokens only, as llama-bench
      p.max_tokens = o.n_gen;
      p.ignore_eos = true;
      Clock::time_point first;
      int n = 0;
      e.add_request(prompt, p, [&](const TokenEvent& ev) {
        if (!ev.finished && n++ == 0) first = Clock::now();
      });
      while (e.step()) {
      }
      tps.push_back(double(n - 1) / std::chrono::duration<double>(Clock::now() - first).count());
    }
    const auto& st = e.stats().spec;
    const std::string method = speculate ? e.spec_name() : "none";
    rows.push_back({fmt::format("tg{} engine, spec {}", o.n_gen, method), median(tps),
                    speculate ? fmt::format("{} of {} proposed tokens accepted ({:.0f} %), {:.2f} tokens per step",
                                            st.accepted_tokens, st.draft_tokens,
                                            100.0 * double(st.accepted_tokens) / double(std::max<int64_t>(1, st.draft_tokens)),
                                            double(e.stats().generation_tokens - o.reps) /
                                                double(std::max<int64_t>(1, e.stats().steps - o.reps)))
                              : ""});
  }
  return rows;
}

// What a forward pass reads and computes in its weight matrices per token: the layer matrices (every
// 2-D weight but the token embedding and the output matrix; of a MoE layer's experts, the share a
// token uses) and the output matrix. Bytes are what the kernels
// read: the packed copy when the type has a packed layout (kernels/cpu/packed.h), else the GGUF rows.
struct WeightCount {
  double layer_params = 0, layer_bytes = 0, output_params = 0, output_bytes = 0, file_bytes = 0;
};

double read_bytes(const WeightMatrix& w) {
  return w.packed ? double(w.packed->bytes()) : double(w.rows) * double(w.row_stride);
}

// Mixture of experts: a token reads the router, the shared expert and n_expert_used of the n_expert
// experts of each layer, so the experts count at that fraction (per token: exactly so in decode).
WeightCount count_weights(const ModelWeights& mw, const ModelConfig& cfg) {
  WeightCount c;
  auto add = [&](const WeightMatrix& w, double share) {
    if (w.empty()) return;
    c.layer_params += share * double(w.rows) * double(w.cols);
    c.layer_bytes += share * read_bytes(w);
    c.file_bytes += double(w.rows) * double(w.row_stride);
  };
  const double used = cfg.n_expert > 0 ? double(cfg.n_expert_used) / double(cfg.n_expert) : 0.0;
  for (const auto& L : mw.layers) {
    for (const WeightMatrix* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.router, &L.sh_gate,
                                  &L.sh_up, &L.sh_down})
      add(*w, 1.0);
    for (const auto* experts : {&L.exp_gate, &L.exp_up, &L.exp_down})
      for (const WeightMatrix& w : *experts) add(w, used);
  }
  c.output_params = double(mw.output.rows) * double(mw.output.cols);
  c.output_bytes = read_bytes(mw.output);
  c.file_bytes += double(mw.output.rows) * double(mw.output.row_stride);
  return c;
}

void run_bench(const BenchOptions& o) {
  set_threads(o.threads);
  check(o.reps > 0 && o.n_prompt >= 0 && o.n_gen >= 0, "-r must be > 0, -p and -n >= 0");
  check(!o.depths.empty(), "-d needs at least one depth");
  for (int d : o.depths) check(d >= 0, "-d must be >= 0");
  auto model = o.parallel.load(resolve_model_path(o.model));
  const ModelConfig& cfg = model->config();
  const int64_t n_vocab = cfg.n_vocab;
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(o.n_prompt);
  for (auto& t : prompt) t = int32_t(rng() % n_vocab);  // random tokens, as llama-bench
  const int max_depth = *std::max_element(o.depths.begin(), o.depths.end());
  std::vector<int32_t> context(max_depth);
  for (auto& t : context) t = int32_t(rng() % n_vocab);
  // Each test starts at its depth, so the sequence holds at most depth + max(p, n) tokens; p + n leaves room.
  SingleSequence seq(*model, std::max<int64_t>(1, int64_t(max_depth) + o.n_prompt + o.n_gen),
                     parse_cache_type(o.cache_type));

  cpu::RooflinePeaks peaks;
  WeightCount wc;
  if (o.roofline) {
    peaks = cpu::probe_roofline();
    wc = count_weights(model->weights(), cfg);
    fmt::print("roofline peaks, {}\n", peaks.describe());
    fmt::print("weights: layer matrices {:.1f} M ({:.1f} MB as read), output matrix {:.1f} M ({:.1f} MB as read); "
               "{:.1f} MB in the file\n\n",
               wc.layer_params * 1e-6, wc.layer_bytes * 1e-6, wc.output_params * 1e-6, wc.output_bytes * 1e-6,
               wc.file_bytes * 1e-6);
  }

  auto secs = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  struct Row {
    std::string test, roofline;
    double tps;
  };
  std::vector<Row> rows;
  for (int depth : o.depths) {
    const std::string at = depth > 0 ? fmt::format(" @ d{}", depth) : "";
    seq.reset();
    if (depth > 0) seq.eval(std::span(context.data(), size_t(depth)));  // not timed; rewound to after each test
    std::vector<double> pp, tg;
    for (int r = 0; r < o.reps; ++r) {
      if (o.n_prompt > 0) {
        seq.rewind(depth);
        const auto t0 = Clock::now();
        seq.eval(prompt);
        pp.push_back(o.n_prompt / secs(t0));
      }
      if (o.n_gen > 0) {
        seq.rewind(depth);
        const auto t0 = Clock::now();
        int32_t tok = 1;
        for (int i = 0; i < o.n_gen; ++i) tok = int32_t(seq.eval(std::span(&tok, 1)).at(0) > 0 ? 1 : 2);
        tg.push_back(o.n_gen / secs(t0));
      }
    }
    if (!pp.empty()) {
      const double tps = median(pp);
      std::string roof;
      if (o.roofline) {
        // 2 int8 ops per weight per token in the layer matrices; the output matrix once (only the last
        // token's logits are computed). Attention is not counted.
        const double ops = (2 * wc.layer_params * o.n_prompt + 2 * wc.output_params) * tps / o.n_prompt;
        roof = peaks.int8_peak() > 0 ? fmt::format("{:.3f} TOPS = {:.1f}% of int8 peak", ops * 1e-12,
                                                   100 * ops / peaks.int8_peak())
                                     : fmt::format("{:.3f} TOPS", ops * 1e-12);
      }
      rows.push_back({fmt::format("pp{}{}", o.n_prompt, at), roof, tps});
    }
    if (!tg.empty()) {
      const double tps = median(tg);
      std::string roof;
      if (o.roofline) {
        // Per token: every layer matrix and the output matrix, plus the K and V rows it attends to (on
        // average depth + (n - 1) / 2 positions, every layer).
        const double kv = double(cfg.n_layer) * 2 * double(cfg.kv_dim()) * bytes_per_elem(parse_cache_type(o.cache_type)) *
                          (depth + (o.n_gen - 1) / 2.0);
        const double bps = (wc.layer_bytes + wc.output_bytes + kv) * tps;
        roof = fmt::format("{:.1f} GB/s = {:.1f}% of read bw", bps * 1e-9, 100 * bps / peaks.read_bytes_per_s);
      }
      rows.push_back({fmt::format("tg{}{}", o.n_gen, at), roof, tps});
    }
  }
  if (o.spec.method_name() != "none") {
    fmt::print("| model | test | t/s (median of {}) | speculation |\n|---|---|---|---|\n", o.reps);
    for (const auto& r : rows) fmt::print("| {} | {} | {:.2f} | |\n", o.model, r.test, r.tps);
    for (const auto& r : spec_rows(o, *model, prompt)) fmt::print("| {} | {} | {:.2f} | {} |\n", o.model, r.test, r.tps, r.note);
  } else if (o.roofline) {
    fmt::print("| model | test | t/s (median of {}) | roofline |\n|---|---|---|---|\n", o.reps);
    for (const auto& r : rows) fmt::print("| {} | {} | {:.2f} | {} |\n", o.model, r.test, r.tps, r.roofline);
  } else {
    fmt::print("| model | test | t/s (median of {}) |\n|---|---|---|\n", o.reps);
    for (const auto& r : rows) fmt::print("| {} | {} | {:.2f} |\n", o.model, r.test, r.tps);
  }
}

}  // namespace

void add_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Measure prompt processing (pp) and generation (tg) tokens/s");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("-m,--model,model", o->model, "model")->required();
  cmd->add_option("-p,--n-prompt", o->n_prompt, "prompt tokens (default 128)");
  cmd->add_option("-n,--n-gen", o->n_gen, "generated tokens (default 64)");
  cmd->add_option("-d,--n-depth", o->depths,
                  "context tokens in the KV cache before each test (not timed); a list (0,4096,8192) runs each "
                  "(default 0)")
      ->delimiter(',');
  cmd->add_option("-r,--repetitions", o->reps, "repetitions (default 3)");
  cmd->add_option("-t,--threads", o->threads, "threads (default: the cores available)");
  cmd->add_option("--cache-type,--cache-type-k,--kv-cache-dtype", o->cache_type, kKvCacheTypeHelp);
  cmd->add_flag("--roofline", o->roofline,
                "measure the int8 peak and read bandwidth first and show each test as a fraction of them");
  cmd->add_option("-f,--file", o->prompt_file,
                  "with --spec: the prompt (text) the speculative rows generate after (default: the random prompt)");
  o->spec.add_to(cmd);
  o->parallel.add_to(cmd);
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace serval::cli
