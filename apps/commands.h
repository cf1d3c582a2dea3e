// Subcommands of the `serval` CLI.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "io/ggml_types.h"

namespace serval {
class Tokenizer;
}

namespace serval::cli {

// Each registers its subcommand on `app`; the callback runs it.
void add_info(CLI::App& app);
void add_generate(CLI::App& app);
void add_perplexity(CLI::App& app);
void add_tokenize(CLI::App& app);
void add_embed(CLI::App& app);
void add_rerank(CLI::App& app);
void add_pull(CLI::App& app);
void add_bench(CLI::App& app);
void add_score(CLI::App& app);
void add_plan(CLI::App& app);
void add_serve(CLI::App& app);
void add_template(CLI::App& app);
void add_bench_serving(CLI::App& app);
void add_train_heads(CLI::App& app);
void add_quantize(CLI::App& app);
void add_quality(CLI::App& app);
void add_imatrix(CLI::App& app);
void add_convert(CLI::App& app);
void add_export_shape(CLI::App& app);

// A model argument is a path, or the name of a model in the cache (~/.cache/serval/models/NAME.gguf).
std::string resolve_model_path(const std::string& name_or_path);
// Directory of the model cache (SERVAL_MODEL_CACHE overrides ~/.cache/serval/models).
std::string model_cache_dir();
// The tokens of text file `path` cut into chunks of `ctx` (at most `max_chunks`; negative: all), each
// starting with BOS when the tokenizer adds one (llama.cpp's imatrix and perplexity convention); throws
// Error when the text is shorter than one chunk (`what` names the option that sets ctx).
std::vector<std::vector<int32_t>> text_chunks(const Tokenizer& tok, const std::string& path, int64_t ctx,
                                              int64_t max_chunks, const char* what);
// A --cache-type / --kv-cache-dtype value (f32, f16, bf16, q8_0, fp8_e4m3 or fp8) to a KV cache type;
// throws Error otherwise.
DType parse_cache_type(const std::string& name);
inline constexpr const char* kKvCacheTypeHelp =
    "KV cache type for K and V: f16 (default, as llama.cpp), f32, bf16, q8_0 (32 values in 34 bytes), "
    "fp8_e4m3 (alias fp8; 1 byte, a fixed scale per layer and KV head)";
// Sets the process-wide compute thread count (base/cpu.h): n > 0 that many, otherwise the cores
// available to the process. Applied to the calling thread and to every EngineLoop thread.
void set_threads(int n);

}  // namespace serval::cli
