#include "server/metrics.h"

#include <fmt/core.h>

#include <chrono>
#include <nlohmann/json.hpp>

namespace serval {

namespace {
double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
const std::vector<double> kLatencyBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                             1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0};
}  // namespace

void Histogram::observe(double v) {
  for (size_t i = 0; i < bounds_.size(); ++i)
    if (v <= bounds_[i]) ++counts_[i];
  ++count_;
  sum_ += v;
}

std::string Histogram::render(const std::string& name, const std::string& help) const {
  std::string out = fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  for (size_t i = 0; i < bounds_.size(); ++i) out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], counts_[i]);
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name, count_);
  return out;
}

Metrics::Metrics() : ttft_(kLatencyBuckets), itl_(kLatencyBuckets), tpot_(kLatencyBuckets), e2e_(kLatencyBuckets), start_(wall_seconds()) {}

void Metrics::observe_ttft(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.observe(s);
  recent_ttft_.emplace_back(wall_seconds(), s);
  if (recent_ttft_.size() > 200) recent_ttft_.erase(recent_ttft_.begin());
}

void Metrics::observe_itl(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  itl_.observe(s);
}

void Metrics::observe_request(double e2e_s, double tpot_s, const std::string& reason, int64_t, int64_t) {
  std::lock_guard<std::mutex> lock(mu_);
  e2e_.observe(e2e_s);
  if (tpot_s > 0) {
    tpot_.observe(tpot_s);
    recent_tpot_.emplace_back(wall_seconds(), tpot_s);
    if (recent_tpot_.size() > 200) recent_tpot_.erase(recent_tpot_.begin());
  }
  ++finished_[reason];
}

std::string Metrics::recent_json() const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json j{{"ttft", nlohmann::json::array()}, {"tpot", nlohmann::json::array()}};
  for (auto& [t, v] : recent_ttft_) j["ttft"].push_back({t, v});
  for (auto& [t, v] : recent_tpot_) j["tpot"].push_back({t, v});
  return j.dump();
}

std::string vllm_aliases(const std::string& exposition) {
  std::string out;
  for (size_t at = 0, next; at < exposition.size(); at = next) {
    next = exposition.find('\n', at);
    next = next == std::string::npos ? exposition.size() : next + 1;
    std::string line = exposition.substr(at, next - at);
    for (size_t p = line.find("serval:"); p != std::string::npos; p = line.find("serval:", p)) line.replace(p, 7, "vllm:");
    out += line;
    if (line.find("vllm:kv_cache_usage_perc") != std::string::npos) {
      for (size_t p = line.find("kv_cache_usage_perc"); p != std::string::npos; p = line.find("kv_cache_usage_perc", p))
        line.replace(p, 19, "gpu_cache_usage_perc");
      out += line;
    }
  }
  return out;
}

std::string Metrics::render(const EngineStats& e, const std::string& model) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string label = fmt::format("{{model_name=\"{}\"}}", model);
  auto gauge = [&](const char* name, const char* help, double v) {
    return fmt::format("# HELP serval:{0} {1}\n# TYPE serval:{0} gauge\nserval:{0}{2} {3}\n", name, help, label, v);
  };
  auto counter = [&](const char* name, const char* help, double v) {
    return fmt::format("# HELP serval:{0} {1}\n# TYPE serval:{0} counter\nserval:{0}{2} {3}\n", name, help, label, v);
  };
  std::string out;
  out += gauge("num_requests_running", "Requests in the running batch.", double(e.running));
  out += gauge("num_requests_waiting", "Requests waiting to be scheduled.", double(e.waiting));
  out += gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", e.kv_usage);
  out += counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", double(e.prefix_queries));
  out += counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", double(e.prefix_hits));
  out += counter("prompt_tokens_total", "Prompt tokens received.", double(e.prompt_tokens));
  out += counter("generation_tokens_total", "Tokens generated.", double(e.generation_tokens));
  out += counter("num_preemptions_total", "Requests preempted (recomputed later).", double(e.preemptions));
  out += counter("spec_decode_num_drafts_total", "Speculative verification steps with proposed tokens.", double(e.spec.drafts));
  out += counter("spec_decode_num_draft_tokens_total", "Speculative tokens proposed.", double(e.spec.draft_tokens));
  out += counter("spec_decode_num_accepted_tokens_total", "Speculative tokens accepted.", double(e.spec.accepted_tokens));
  out += "# HELP serval:spec_decode_num_accepted_tokens_per_pos_total Proposals whose token at this position was "
         "accepted.\n# TYPE serval:spec_decode_num_accepted_tokens_per_pos_total counter\n";
  for (size_t i = 0; i < e.spec.accepted_per_pos.size(); ++i)
    out += fmt::format("serval:spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"{}\",position=\"{}\"}} {}\n",
                       model, i, e.spec.accepted_per_pos[i]);
  out += "# HELP serval:request_success_total Finished requests by finish reason.\n# TYPE serval:request_success_total counter\n";
  for (const char* reason : {"stop", "length", "tool_calls", "abort", "error"}) {
    auto it = finished_.find(reason);
    out += fmt::format("serval:request_success_total{{model_name=\"{}\",finished_reason=\"{}\"}} {}\n", model, reason,
                       it == finished_.end() ? 0 : it->second);
  }
  if (!e.expert_tokens.empty()) {
    out += "# HELP serval:moe_expert_tokens_total Tokens each expert ran, summed over the MoE layers.\n"
           "# TYPE serval:moe_expert_tokens_total counter\n";
    uint64_t total = 0, most = 0;
    for (size_t i = 0; i < e.expert_tokens.size(); ++i) {
      out += fmt::format("serval:moe_expert_tokens_total{{model_name=\"{}\",expert=\"{}\"}} {}\n", model, i, e.expert_tokens[i]);
      total += e.expert_tokens[i], most = std::max(most, e.expert_tokens[i]);
    }
    const double mean = double(total) / double(e.expert_tokens.size());
    out += gauge("moe_expert_load_max_over_mean", "Load of the busiest expert over the mean load (1: balanced).",
                 mean > 0 ? double(most) / mean : 0.0);
  }
  out += ttft_.render("serval:time_to_first_token_seconds", "Time to first token.");
  out += itl_.render("serval:inter_token_latency_seconds", "Time between consecutive tokens.");
  out += tpot_.render("serval:request_time_per_output_token_seconds", "Mean time per output token of a request.");
  out += e2e_.render("serval:e2e_request_latency_seconds", "Request latency from arrival to last token.");
  return out;
}

}  // namespace serval
