// `serval bench-serving`: offline throughput of the engine (continuous batching, paged KV) against
// the naive static-batch baseline on the same workload of mixed prompt and output lengths; with
// --url, a load generator for a running OpenAI-compatible server over HTTP (apps/bench_http.h).
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <random>

#include "apps/bench_http.h"
#include "apps/commands.h"
#include "apps/engine_flags.h"
#include "apps/parallel_flags.h"
#include "base/error.h"
#include "engine/engine.h"
#include "engine/naive_engine.h"

namespace serval::cli {
namespace {

struct ServingOptions {
  std::string model, mode = "both", prompt_len = "16:256", output_len = "16:128", load_format = "auto";
  int requests = 64, concurrency = 32, threads = 0;
  EngineFlags engine{"1GiB"};
  uint64_t seed = 1;
};

// The flags as given; --requests, --concurrency and --output-len have one default per mode.
struct BenchServingFlags {
  ServingOptions in_process;
  HttpBenchOptions http;
  std::string requests, concurrency, output_len, request_rate;
};

struct Summary {
  double seconds = 0, kv_waste = 0;
  int64_t output_tokens = 0, computed_tokens = 0;
  std::vector<double> ttft, tpot;
};

std::pair<int, int> parse_range(const std::string& s) {
  const auto colon = s.find(':');
  try {
    const int lo = std::stoi(s.substr(0, colon)), hi = colon == std::string::npos ? lo : std::stoi(s.substr(colon + 1));
    check(lo > 0 && hi >= lo, "bad range '{}'", s);
    return {lo, hi};
  } catch (const std::invalid_argument&) {
    fail("bad range '{}' (MIN:MAX)", s);
  }
}

Summary run_continuous(const Model& m, const std::vector<NaiveRequest>& work, const ServingOptions& o) {
  o.engine.spec.load_heads(m);
  EngineConfig cfg = o.engine.config();
  cfg.scheduler.max_seqs = o.concurrency;
  Engine e(m, cfg);
  fmt::print(stderr, "{}\n", e.capacity().describe(e.max_model_len()));
  Summary s;
  std::map<RequestId, std::vector<double>> times;  // token arrival times per request
  const auto t0 = Clock::now();
  auto now = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  for (const auto& r : work)
    e.add_request(r.prompt, r.params, [&](const TokenEvent& ev) { if (!ev.finished) times[ev.id].push_back(now()); });
  double reserved = 0, used = 0;
  while (e.has_work()) {
    e.step();
    const EngineStats st = e.stats();
    reserved += double(st.reserved_slots);
    used += double(st.used_slots);
  }
  s.seconds = now();
  s.computed_tokens = e.stats().computed_tokens;
  s.kv_waste = reserved > 0 ? 1.0 - used / reserved : 0;
  for (const auto& [id, t] : times) {
    s.output_tokens += int64_t(t.size());
    s.ttft.push_back(t.front());
    if (t.size() > 1) s.tpot.push_back((t.back() - t.front()) / double(t.size() - 1));
  }
  return s;
}

// The static batch the KV budget allows: each request reserves its batch's longest prompt plus the
// longest output contiguously, as a contiguous-KV server must (the worst case over the workload).
int naive_batch_size(const Model& m, const std::vector<NaiveRequest>& work, const ServingOptions& o) {
  size_t longest = 0;
  int max_out = 0;
  for (const auto& r : work) longest = std::max(longest, r.prompt.size()), max_out = std::max(max_out, r.params.max_tokens);
  const EngineConfig cfg = o.engine.config();
  const uint64_t per_request = uint64_t(m.config().kv_bytes_per_token(bytes_per_elem(cfg.kv_type))) *
                               (longest + uint64_t(max_out));
  const uint64_t fits = per_request > 0 ? cfg.kv_cache_bytes / per_request : uint64_t(o.concurrency);
  check(fits > 0, "the KV budget does not hold one request of {} tokens", longest + max_out);
  return int(std::min<uint64_t>(fits, uint64_t(o.concurrency)));
}

Summary run_naive(const Model& m, const std::vector<NaiveRequest>& work, const ServingOptions& o) {
  const int batch = naive_batch_size(m, work, o);
  fmt::print(stderr, "naive: static batches of {} (concurrency {}, KV budget {})\n", batch, o.concurrency,
             o.engine.kv_memory);
  NaiveEngine naive(m, batch);
  const NaiveResult r = naive.run(work);
  Summary s;
  s.seconds = r.seconds;
  s.computed_tokens = r.computed_tokens;
  s.kv_waste = r.reserved_slot_steps > 0 ? 1.0 - r.used_slot_steps / r.reserved_slot_steps : 0;
  for (size_t i = 0; i < work.size(); ++i) {
    s.output_tokens += int64_t(r.outputs[i].size());
    s.ttft.push_back(r.ttft_s[i]);
    if (r.outputs[i].size() > 1) s.tpot.push_back((r.e2e_s[i] - r.ttft_s[i]) / double(r.outputs[i].size() - 1));
  }
  return s;
}

void print_row(const char* mode, const Summary& s) {
  fmt::print("| {} | {:.1f} | {:.1f} | {} | {:.0f} | {:.1f} | {:.1f}% |\n", mode, s.seconds, s.output_tokens / s.seconds,
             s.computed_tokens, median(s.ttft) * 1e3, median(s.tpot) * 1e3, 100.0 * s.kv_waste);
}

void run_bench_serving(const ServingOptions& o) {
  set_threads(o.threads);
  check(o.mode == "both" || o.mode == "continuous" || o.mode == "naive", "--mode is continuous, naive or both");
  check(o.requests > 0 && o.concurrency > 0, "--requests and --concurrency must be positive");
  auto m = Model::load(resolve_model_path(o.model), ParallelFlags::with_format({}, o.load_format));
  const auto [p_lo, p_hi] = parse_range(o.prompt_len);
  const auto [o_lo, o_hi] = parse_range(o.output_len);
  std::mt19937_64 rng(o.seed);
  std::vector<NaiveRequest> work;
  for (int i = 0; i < o.requests; ++i) {
    NaiveRequest r;
    const int n_prompt = p_lo + int(rng() % uint64_t(p_hi - p_lo + 1));
    for (int k = 0; k < n_prompt; ++k) r.prompt.push_back(int32_t(rng() % uint64_t(m->config().n_vocab)));
    r.params.max_tokens = o_lo + int(rng() % uint64_t(o_hi - o_lo + 1));
    r.params.ignore_eos = true;  // every request produces exactly its output length
    r.params.sampling.temperature = 0;
    r.params.sampling.compute_logprob = false;  // as a client that asks for no logprobs
    work.push_back(std::move(r));
  }
  fmt::print("{} requests, prompts {} tokens, outputs {} tokens, concurrency {}\n\n", o.requests, o.prompt_len,
             o.output_len, o.concurrency);
  fmt::print("| mode | seconds | output tok/s | tokens computed | median TTFT ms | median TPOT ms | KV waste |\n");
  fmt::print("|---|---|---|---|---|---|---|\n");
  if (o.mode != "naive") print_row("continuous (paged)", run_continuous(*m, work, o));
  if (o.mode != "continuous") print_row("naive (static, contiguous)", run_naive(*m, work, o));
}

constexpr const char* kInProcess = "In-process engine (without --url)";
constexpr const char* kHttp = "HTTP client (with --url)";

int positive_int(const std::string& s, const char* flag) {
  const std::vector<int> v = parse_int_list(s, flag);
  check(v.size() == 1, "{} '{}': one number, not a list", flag, s);
  return v.front();
}

// A flag of the other mode is a mistake, not something to ignore silently.
void check_flag_groups(const CLI::App& cmd, bool http) {
  for (const CLI::Option* opt : cmd.get_options())
    if (opt->count() > 0 && opt->get_group() == (http ? kInProcess : kHttp))
      fail("{} {}", opt->get_name(), http ? "is for the in-process mode (without --url)" : "needs --url");
}

void run_http_mode(BenchServingFlags& f) {
  HttpBenchOptions& h = f.http;
  h.seed = f.in_process.seed;
  if (!f.requests.empty()) h.requests = positive_int(f.requests, "--requests");
  if (!f.output_len.empty()) h.output_len = positive_int(f.output_len, "--output-len");
  if (!f.request_rate.empty()) h.request_rate = parse_rate_list(f.request_rate, "--request-rate");
  if (!f.concurrency.empty()) h.concurrency = parse_int_list(f.concurrency, "--concurrency");
  else if (h.request_rate.empty()) h.concurrency = {16};
  run_http_bench(h);
}

void run_selected_mode(const CLI::App& cmd, BenchServingFlags& f) {
  const bool http = cmd.count("--url") > 0;
  check_flag_groups(cmd, http);
  if (http) return run_http_mode(f);
  ServingOptions& o = f.in_process;
  check(!o.model.empty(), "--model is required (or --url to benchmark a running server)");
  if (!f.requests.empty()) o.requests = positive_int(f.requests, "--requests");
  if (!f.concurrency.empty()) o.concurrency = positive_int(f.concurrency, "--concurrency");
  if (!f.output_len.empty()) o.output_len = f.output_len;
  run_bench_serving(o);
}

void add_in_process_flags(CLI::App* cmd, ServingOptions& o) {
  cmd->add_option("-m,--model,model", o.model, "model")->group(kInProcess);
  ParallelFlags::add_load_format(cmd, o.load_format);
  cmd->add_option("--mode", o.mode, "continuous, naive or both (default)")->group(kInProcess);
  cmd->add_option("--prompt-len", o.prompt_len, "MIN:MAX prompt tokens (default 16:256)")->group(kInProcess);
  const size_t before = cmd->get_options().size();
  o.engine.add_to(cmd, /*with_max_seqs=*/false);  // --concurrency sets it
  cmd->add_option("-t,--threads", o.threads, "threads (default: the cores available)");
  const std::vector<CLI::Option*> all = cmd->get_options();
  for (size_t i = before; i < all.size(); ++i) all[i]->group(kInProcess);
}

void add_http_flags(CLI::App* cmd, BenchServingFlags& f) {
  HttpBenchOptions& h = f.http;
  auto add = [&](const char* name, auto& value, const char* help) { cmd->add_option(name, value, help)->group(kHttp); };
  add("--url", h.url, "benchmark the OpenAI-compatible server at this URL (http://HOST:PORT) over HTTP");
  add("--request-rate", f.request_rate, "requests/s, Poisson arrivals, instead of a fixed concurrency; a list sweeps");
  add("--served-model", h.served_model, "model name to send (default: the first of GET /v1/models)");
  add("--endpoint", h.endpoint, "completions (default: /v1/completions) or chat (/v1/chat/completions)");
  add("--prompt-words", h.prompt_words, "synthetic prompts of this many random common words (default 60)");
  add("--prompt-file", h.prompt_file, "prompts from this file, one a line (used in turn)");
  add("--extra-body", h.extra_body, "JSON object merged into every request (e.g. a response_format); %REQ% in it becomes a number unique to each request");
  add("--shared-prefix-words", h.shared_prefix_words, "the same N random words start every prompt (default 0)");
  add("--slo-ttft-ms", h.slo_ttft_ms, "goodput: TTFT objective in ms (default: none)");
  add("--slo-tpot-ms", h.slo_tpot_ms, "goodput: TPOT objective in ms (default: none)");
  add("--json", h.json_path, "write every figure to this JSON file");
  add("--plot", h.plot_path, "write a PNG of throughput and TTFT against concurrency (python3 + matplotlib)");
  add("--api-key", h.api_key, "sent as 'Authorization: Bearer KEY'");
  add("--timeout", h.timeout_s, "seconds without progress before a request fails (default 600)");
}

}  // namespace

void add_bench_serving(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench-serving",
                                 "Serving benchmark: the engine in process (continuous batching versus static "
                                 "batches), or a running OpenAI-compatible server over HTTP (--url)");
  auto f = std::make_shared<BenchServingFlags>();
  cmd->add_option("--requests", f->requests, "number of requests (default 64; with --url 48 per concurrency)");
  cmd->add_option("--concurrency", f->concurrency,
                  "requests at once, the naive batch size (default 32); with --url a list like 1,4,16 (default 16), "
                  "or with --request-rate the most in flight");
  cmd->add_option("--output-len", f->output_len, "MIN:MAX output tokens (default 16:128); with --url N (default 64)");
  cmd->add_option("-s,--seed", f->in_process.seed, "workload seed (prompts, arrivals)");
  add_in_process_flags(cmd, f->in_process);
  add_http_flags(cmd, *f);
  cmd->callback([cmd, f] { run_selected_mode(*cmd, *f); });
}

}  // namespace serval::cli
