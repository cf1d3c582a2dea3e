// Engine settings as command-line flags, shared by `serve` and `bench-serving`.
#pragma once
#include <CLI/CLI.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "base/error.h"
#include "engine/engine.h"
#include "engine/heads.h"
#include "engine/speculative.h"
#include "quant/quantize_model.h"

namespace serval::cli {

// Speculative decoding flags, shared by `generate`, `bench`, `serve` and `bench-serving`.
struct SpecFlags {
  std::vector<std::string> method;  // METHOD, or `heads FILE`
  std::string model_draft, heads_file, draft_kv_memory = "256MiB";
  int64_t draft_vocab = 0;  // the draft model's logits: the vocabulary's first N tokens (0: all)
  std::string draft_quantization;  // the draft's matrices requantized to this type at load ("": as in its file)
  SpeculativeConfig config;
  std::unique_ptr<Model> draft;           // loaded by load()
  std::unique_ptr<DecodingHeads> heads;   // loaded by load_heads()

  void add_to(CLI::App* cmd) {
    cmd->add_option("--spec", method,
                    "speculative decoding: none (default), ngram (prompt lookup), suffix (suffix tree over the prompt, output "
                    "and earlier outputs), draft, heads FILE, or ngram+draft / ngram+heads FILE / suffix+draft / suffix+heads FILE "
                    "(lookup first)")
        ->expected(1, 2);
    cmd->add_option("--spec-heads", heads_file, "decoding heads file (serval train-heads) for --spec heads (implies it)");
    cmd->add_option("--model-draft,--md", model_draft, "draft model for --spec draft (implies it): same vocabulary");
    cmd->add_option("--draft-max,--draft", config.draft_max, "tokens proposed per step at most (default 8)");
    cmd->add_option("--draft-min", config.draft_min, "shorter proposals are dropped (default 1)");
    cmd->add_option("--draft-p-min", config.draft_p_min,
                    "the draft model stops at a guess it gives less than this probability (default 0.8)");
    cmd->add_option("--spec-ngram-min", config.ngram_min, "prompt lookup: shortest n-gram matched; also suffix speculation's shortest match in front of a draft model or heads (default 1; 3 with ngram+/suffix+draft or heads)");
    cmd->add_option("--spec-ngram-max", config.ngram_max, "prompt lookup: longest n-gram matched (default 4)");
    cmd->add_option("--spec-max-running", config.max_running,
                    "no speculation while more requests than this run (default 4)");
    cmd->add_option("--draft-kv-memory", draft_kv_memory, "KV cache of the draft model (default 256MiB)");
    cmd->add_option("--draft-quantization", draft_quantization,
                    "requantize the draft model's matrices to this type as it loads, e.g. q4_0 (vLLM's "
                    "speculative_config quantization; the bytes of serval quantize --allow-requantize --pure)");
    cmd->add_option("--draft-vocab", draft_vocab,
                    "the draft model computes logits for the vocabulary's first N tokens only, its most frequent "
                    "in a BPE vocabulary (FR-Spec's reduced head; default 0: all)");
    cmd->add_option("--spec-tree-width", config.tree_width,
                    "heads: candidates per head in a token tree; suffix: children per node (default 1: one chain)");
    cmd->add_option("--spec-heads-p-min", config.heads_p_min,
                    "heads: a chain stops at a guess whose path probability is below this (default 0.3)");
    cmd->add_option("--spec-suffix-depth", config.suffix_depth, "suffix: longest match looked for (default 24)");
    cmd->add_option("--spec-suffix-factor", config.suffix_factor,
                    "suffix: tokens proposed per matched token, at most (default 1.0)");
    cmd->add_option("--spec-suffix-p-min", config.suffix_p_min,
                    "suffix: a guess needs this share of the matches' votes (default 0.1)");
    cmd->add_option("--spec-suffix-cache", config.suffix_cache,
                    "suffix: finished requests whose outputs are kept to match against (default 1000)");
    cmd->add_option("--draft-backoff", config.draft_backoff_max,
                    "after an empty draft the draft model skips the request for 1, 2, 4 ... steps, at most this "
                    "many (default 8; 0: never)");
  }

  // Loads the draft model (if any) and returns the configuration; throws Error for bad values.
  // load_heads() must have run first when heads are wanted (they need the target model).
  SpeculativeConfig load() {
    SpeculativeConfig c = config;
    c.set_method(method_name());
    c.heads = heads.get();
    if (c.method == SpecMethod::Draft) {
      check(!model_draft.empty(), "--spec {} needs a draft model (--model-draft FILE)", c.method_name());
      check(draft_vocab >= 0, "--draft-vocab must be 0 (all) or more (got {})", draft_vocab);
      if (!draft) {  // once, however often asked
        LoadOptions o;
        o.logit_rows = draft_vocab;
        if (!draft_quantization.empty()) o.requant = parse_tensor_type(draft_quantization);
        draft = Model::load(resolve_model_path(model_draft), o);
      }
      c.draft_model = draft.get();
      c.draft_kv_bytes = kv_budget_from_string(draft_kv_memory);
    }
    c.validate();
    return c;
  }

  std::string method_name() const {
    // `--spec` takes one or two values, so `--spec ngram MODEL` would swallow a positional MODEL.
    check(method.size() < 2 || method[0].ends_with("heads"),
          "--spec {} takes no second value (got '{}'); only 'heads' takes a file (put the model first)",
          method.empty() ? "" : method[0], method.size() > 1 ? method[1] : "");
    if (!method.empty()) return method[0];
    if (!heads_file.empty()) return "heads";
    return model_draft.empty() ? "none" : "draft";
  }

  // Loads the heads file for `target` when the method is heads (once).
  void load_heads(const Model& target) {
    if (!method_name().ends_with("heads") || heads) return;
    const std::string file = method.size() == 2 ? method[1] : heads_file;
    check(!file.empty(), "--spec {0} needs a heads file (--spec {0} FILE; serval train-heads makes one)", method_name());
    heads = std::make_unique<DecodingHeads>(DecodingHeads::load(file, target));
  }
};

struct EngineFlags {
  std::string kv_memory, cache_type = "f16";
  int block_size = 16, max_seqs = 64;
  int64_t max_batched_tokens = 512, max_model_len = 0;
  int64_t ctx_tokens = 0;  // -c on serve: the KV cache in tokens (0: from --kv-cache-memory)
  bool no_prefix_caching = false, priority = false;
  mutable SpecFlags spec;  // config() loads the draft model once

  explicit EngineFlags(std::string default_kv_memory) : kv_memory(std::move(default_kv_memory)) {}

  // Registers the flags on `cmd` (without --max-seqs where the command sets it another way).
  void add_to(CLI::App* cmd, bool with_max_seqs = true) {
    cmd->add_option("--kv-cache-memory", kv_memory,
                    "KV budget: bytes (512MiB, 2GB) or a fraction of free memory (default " + kv_memory + ")");
    cmd->add_option("--cache-type,--cache-type-k,--kv-cache-dtype", cache_type, kKvCacheTypeHelp);
    cmd->add_option("--block-size", block_size, "tokens per KV block (default 16)");
    cmd->add_option("--max-batched-tokens,--max-num-batched-tokens", max_batched_tokens,
                    "tokens per engine step (default 512)");
    if (with_max_seqs)
      cmd->add_option("--max-seqs,--max-num-seqs,--parallel", max_seqs,
                      "running requests at most (default 64; vLLM's --max-num-seqs, llama-server's -np)");
    cmd->add_option("--max-model-len", max_model_len, "context length (default: the model's)");
    cmd->add_flag("--no-prefix-caching", no_prefix_caching, "disable prefix caching");
    cmd->add_flag("--priority-scheduling", priority, "serve by request 'priority' (lower first), then arrival");
    spec.add_to(cmd);
  }

  // `-c/--ctx-size N` (llama-server's): the KV cache holds N tokens over all requests, in place of the
  // --kv-cache-memory budget. llama-server splits N over its -np slots; here the requests share the
  // paged cache, and one request may use all of it (up to --max-model-len).
  void add_ctx_size(CLI::App* cmd) {
    cmd->add_option("-c,--ctx-size", ctx_tokens,
                    "KV cache size in tokens, shared by all requests (llama-server's -c; default: from --kv-cache-memory)")
        ->check(CLI::NonNegativeNumber);
  }

  // The engine configuration the flags describe (loading the draft model, if any); throws Error.
  EngineConfig config() const {
    EngineConfig ec;
    ec.block_size = block_size;
    ec.kv_cache_bytes = kv_budget_from_string(kv_memory);
    if (ctx_tokens > 0) {
      check(block_size > 0, "--block-size must be positive (got {})", block_size);
      ec.num_blocks = int32_t(std::min<int64_t>((ctx_tokens + block_size - 1) / block_size, INT32_MAX));
    }
    ec.kv_type = parse_cache_type(cache_type);
    ec.max_model_len = max_model_len;
    ec.prefix_caching = !no_prefix_caching;
    ec.scheduler.max_batched_tokens = max_batched_tokens;
    ec.scheduler.max_seqs = max_seqs;
    ec.scheduler.policy = priority ? SchedulingPolicy::Priority : SchedulingPolicy::Fcfs;
    ec.spec = spec.load();
    return ec;
  }
};

// The median of a sample (the upper one for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace serval::cli
