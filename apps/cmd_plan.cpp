// `serval plan`: how much memory weights and KV take and how many sequences fit, from a model file,
// a preset or hyperparameters given as flags.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "base/error.h"
#include "engine/capacity.h"
#include "engine/engine.h"
#include "model/model.h"

namespace serval::cli {
namespace {

struct PlanOptions {
  std::string model, preset, memory = "80GiB", kv_dtype = "f16";
  double params = 0, weight_bits = 0;
  int64_t layers = 0, kv_heads = 0, head_dim = 0, context = 8192, users = 0;
  bool json = false;
  int tp = 1, pp = 1;
};

std::string human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  return fmt::format("{:.2f} {}", bytes, units[u]);
}

// Memory of each rank of the model split over --tp x --pp: its share of the weights (each share loaded
// in turn, as that rank binds it) and of the KV cache.
void print_ranks(const PlanOptions& o, const PlanInput& in) {
  const std::string path = resolve_model_path(o.model);
  fmt::print("\nper rank (--tp {} --pp {}):\n", o.tp, o.pp);
  fmt::print("| rank | stage | tp rank | layers | heads | KV heads | weights | KV per token | KV per sequence | sequences that fit |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n");
  for (int r = 0; r < o.tp * o.pp; ++r) {
    LoadOptions lo;
    lo.tp = o.tp, lo.pp = o.pp, lo.tp_rank = r % o.tp, lo.stage = r / o.tp;
    const auto m = Model::load(path, lo);
    const ShardLayout& s = m->config().shard;
    const uint64_t w = m->weights().weight_bytes;
    const uint64_t kv_tok = uint64_t(m->config().local_kv_bytes_per_token(in.kv_dtype_bytes));
    const uint64_t kv_seq = kv_tok * uint64_t(in.context);
    const uint64_t fit = in.memory_bytes > w && kv_seq ? (in.memory_bytes - w) / kv_seq : 0;
    fmt::print("| {} | {} | {} | {}-{} | {} | {} | {} | {} | {} | {} |\n", r, s.stage, s.tp_rank, s.layer_begin,
               s.layer_end - 1, s.head_end - s.head_begin, s.kv_head_end - s.kv_head_begin, human(double(w)),
               human(double(kv_tok)), human(double(kv_seq)), fit);
  }
}

// The same for a model given by its shape only (a preset or flags): every rank an even share of the
// weights (layers over the stages, then over the TP ranks), KV heads split over the TP ranks (each
// rank keeps one when there are fewer KV heads than ranks), layers over the stages as a file's are.
void print_ranks_estimated(const PlanOptions& o, const PlanInput& in, const PlanResult& r) {
  fmt::print("\nper rank (--tp {} --pp {}; estimated from the shape: no file):\n", o.tp, o.pp);
  fmt::print("| stage | layers | weights per rank | KV heads per rank | KV per token | KV per sequence | sequences that fit |\n"
             "|---|---|---|---|---|---|---|\n");
  const int64_t kv_heads = std::max<int64_t>(1, in.n_kv_heads / o.tp);
  for (int stage = 0; stage < o.pp; ++stage) {
    const int64_t first = stage * in.n_layers / o.pp, end = (stage + 1) * in.n_layers / o.pp;
    const double w = double(r.weight_bytes) * double(end - first) / double(in.n_layers) / o.tp;
    const uint64_t kv_tok = uint64_t(std::llround(double(in.kv_rows) * double(end - first) * double(kv_heads * in.d_head) * in.kv_dtype_bytes));
    const uint64_t kv_seq = kv_tok * uint64_t(in.context);
    const uint64_t fit = double(in.memory_bytes) > w && kv_seq ? uint64_t((double(in.memory_bytes) - w) / double(kv_seq)) : 0;
    fmt::print("| {} | {}-{} | {} | {} | {} | {} | {} |\n", stage, first, end - 1, human(w), kv_heads, human(double(kv_tok)),
               human(double(kv_seq)), fit);
  }
}

void run_plan(const PlanOptions& o) {
  check(o.tp >= 1 && o.pp >= 1, "--tp and --pp must be at least 1");
  PlanInput in;
  if (!o.model.empty()) {
    auto m = Model::load(resolve_model_path(o.model));
    const auto& c = m->config();
    in.name = o.model;
    in.n_layers = c.n_layer, in.n_kv_heads = c.n_head_kv, in.d_head = c.d_head, in.kv_rows = c.kv_rows();
    in.weight_bytes = m->weights().weight_bytes;
  } else if (!o.preset.empty()) {
    check(plan_preset(o.preset, in), "unknown preset '{}' (llama3-8b, llama3-70b, llama3-405b, llama2-7b, qwen2.5-0.5b, "
          "qwen2.5-1.5b, qwen2.5-7b, gemma3-270m, mistral-7b, qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, olmoe-1b-7b, qwen1.5-moe-a2.7b, deepseek-v2-lite, deepseek-v2)", o.preset);
  }
  if (o.params > 0) in.n_params = o.params, in.weight_bytes.reset();
  if (o.weight_bits > 0) {
    in.weight_bits = o.weight_bits;
    if (in.n_params > 0) in.weight_bytes.reset();
  }
  if (o.layers > 0) in.n_layers = o.layers;
  if (o.kv_heads > 0) in.n_kv_heads = o.kv_heads;
  if (o.head_dim > 0) in.d_head = o.head_dim;
  in.context = o.context;
  in.users = o.users;
  in.kv_dtype_bytes = kv_dtype_bytes(o.kv_dtype);
  in.memory_bytes = kv_budget_from_string(o.memory);
  const PlanResult r = plan_capacity(in);
  if (o.json) {
    nlohmann::json j{{"model", in.name}, {"weight_bytes", r.weight_bytes}, {"kv_bytes_per_token", r.kv_bytes_per_token},
                     {"kv_bytes_per_sequence", r.kv_bytes_per_sequence}, {"max_sequences", r.max_sequences},
                     {"weights_fit", r.weights_fit}, {"memory_bytes", in.memory_bytes}, {"context", in.context}};
    if (in.users > 0) j["kv_bytes_for_users"] = r.kv_bytes_for_users, j["users_fit"] = r.users_fit;
    fmt::print("{}\n", j.dump());
    return;
  }
  fmt::print("model:                 {}\n", in.name.empty() ? "(from flags)" : in.name);
  fmt::print("weights:               {} ({} bytes)\n", human(double(r.weight_bytes)), r.weight_bytes);
  if (in.kv_rows == 1)
    fmt::print("KV per token:          {} ({} layers x {} latent + rotary key values x {} bytes: MLA)\n",
               human(double(r.kv_bytes_per_token)), in.n_layers, in.n_kv_heads * in.d_head, in.kv_dtype_bytes);
  else
    fmt::print("KV per token:          {} (2 x {} layers x {} KV heads x {} d_head x {} bytes)\n",
               human(double(r.kv_bytes_per_token)), in.n_layers, in.n_kv_heads, in.d_head, in.kv_dtype_bytes);
  fmt::print("KV per sequence:       {} at {} tokens\n", human(double(r.kv_bytes_per_sequence)), in.context);
  fmt::print("device memory:         {}\n", human(double(in.memory_bytes)));
  if (!r.weights_fit) fmt::print("weights do not fit in the device memory\n");
  else fmt::print("sequences that fit:    {}\n", r.max_sequences);
  if (in.users > 0)
    fmt::print("{} users:             {} of KV ({})\n", in.users, human(double(r.kv_bytes_for_users)),
               r.users_fit ? "fits" : "does not fit");
  if (o.tp * o.pp > 1 && !o.model.empty()) print_ranks(o, in);
  else if (o.tp * o.pp > 1) print_ranks_estimated(o, in, r);
}

}  // namespace

void add_plan(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan", "Capacity calculator: weight and KV memory, sequences that fit");
  auto o = std::make_shared<PlanOptions>();
  cmd->add_option("model,-m,--model", o->model, "GGUF file or cached model name (optional)");
  cmd->add_option("--preset", o->preset, "known model shape, e.g. llama3-8b, llama3-70b");
  cmd->add_option("--params", o->params, "number of weights, e.g. 70.6e9");
  cmd->add_option("--weight-bits", o->weight_bits, "bits per weight (16 for BF16, 4 for Q4)");
  cmd->add_option("--layers", o->layers, "transformer layers");
  cmd->add_option("--kv-heads", o->kv_heads, "KV heads");
  cmd->add_option("--head-dim", o->head_dim, "head dimension");
  cmd->add_option("-c,--context", o->context, "tokens per sequence (default 8192)");
  cmd->add_option("--memory", o->memory, "device memory, e.g. 80GiB, 48GB (default 80GiB)");
  cmd->add_option("--kv-dtype", o->kv_dtype,
                  "KV dtype, as --cache-type: f16 (default), f32, bf16, q8_0 (34 bytes per 32 values), fp8_e4m3 "
                  "(alias fp8); also int8 (1 byte)");
  cmd->add_option("--users", o->users, "concurrent sequences to size for");
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->add_option("--tp", o->tp, "also show each rank's memory with the model split over this many TP ranks");
  cmd->add_option("--pp", o->pp, "... and this many pipeline stages");
  cmd->callback([o] { run_plan(*o); });
}

}  // namespace serval::cli
