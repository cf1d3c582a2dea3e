// `serval bench-serving --url URL`: a load generator for any OpenAI-compatible server (serval serve,
// llama.cpp's llama-server, vLLM) over real HTTP. Streams /v1/completions or /v1/chat/completions at a
// fixed concurrency (closed loop) or at a Poisson request rate (open loop) and reports TTFT, TPOT, ITL,
// end-to-end latency, throughput and goodput (docs/benchmarks.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace serval::cli {

struct HttpBenchOptions {
  std::string url;            // http://HOST[:PORT][/PREFIX]; a trailing /v1 is optional
  std::string served_model;   // "" : the first model of GET /v1/models
  std::string endpoint = "completions";  // or "chat"
  std::string api_key;        // sent as "Authorization: Bearer KEY" when set
  std::string prompt_file;    // one prompt per line; "" : synthetic prompts
  // JSON object merged into every request body (e.g. a response_format); "%REQ%" in it becomes a
  // number unique to the request, so each request can carry a schema the server has not seen.
  std::string extra_body;
  std::string json_path, plot_path;
  int requests = 48, output_len = 64, prompt_words = 60, shared_prefix_words = 0;
  std::vector<int> concurrency;      // closed loop: one run per value (a sweep)
  std::vector<double> request_rate;  // open loop: one run per rate; `concurrency` (one value) caps in-flight
  double slo_ttft_ms = 0, slo_tpot_ms = 0;  // 0: no objective on that metric
  double timeout_s = 600;                   // per network operation (connect, write, each read)
  uint64_t seed = 1;
};

// "1,4,16" -> {1, 4, 16}; every value positive. Throws Error naming `flag` otherwise.
std::vector<int> parse_int_list(const std::string& s, const char* flag);
std::vector<double> parse_rate_list(const std::string& s, const char* flag);

// Runs the benchmark: prints a table on stdout (progress on stderr), writes --json and --plot.
// Throws Error for bad options, an unreachable server, a failing test request, and, after the report
// is printed and written, when any request failed.
void run_http_bench(const HttpBenchOptions& o);

}  // namespace serval::cli
