// Prometheus metrics with the names vLLM dashboards use, under the `serval:` prefix.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace serval {

class Histogram {
 public:
  explicit Histogram(std::vector<double> buckets) : bounds_(std::move(buckets)), counts_(bounds_.size(), 0) {}
  void observe(double v);
  std::string render(const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // cumulative at render time
  uint64_t count_ = 0;
  double sum_ = 0;
};

// The same exposition under vLLM's names: every serval:NAME as vllm:NAME, and the KV usage also as
// vllm:gpu_cache_usage_perc (its name before vLLM 0.10), which the Gateway API Inference Extension's
// model-server protocol reads from older servers.
std::string vllm_aliases(const std::string& exposition);

class Metrics {
 public:
  Metrics();
  void observe_ttft(double s);
  void observe_itl(double s);
  void observe_request(double e2e_s, double tpot_s, const std::string& finish_reason, int64_t prompt_tokens,
                       int64_t generation_tokens);
  // Recent (time, TTFT) and (time, TPOT) samples for the web page.
  std::string recent_json() const;
  // The text exposition, with gauges and counters read from the engine.
  std::string render(const EngineStats& engine, const std::string& model_name) const;

 private:
  mutable std::mutex mu_;
  Histogram ttft_, itl_, tpot_, e2e_;
  std::map<std::string, uint64_t> finished_;
  std::vector<std::pair<double, double>> recent_ttft_, recent_tpot_;
  double start_;
};

}  // namespace serval
