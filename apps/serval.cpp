// `serval`: the command-line entry point. Every error is reported as one clear line, exit code 1.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "apps/cli_habits.h"
#include "apps/commands.h"
#include "base/cpu.h"
#include "base/error.h"
#include "base/file_util.h"
#include "tokenizer/tokenizer.h"
#include "dist/runtime.h"
#include "engine/capacity.h"

namespace serval::cli {

std::string model_cache_dir() {
  if (const char* env = std::getenv("SERVAL_MODEL_CACHE"); env && *env) return env;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/serval/models";
}

std::vector<std::vector<int32_t>> text_chunks(const Tokenizer& tok, const std::string& path, int64_t ctx,
                                              int64_t max_chunks, const char* what) {
  const std::vector<int32_t> tokens = tok.encode(read_text_file(path), /*add_special=*/true);
  int64_t n = int64_t(tokens.size()) / ctx;
  if (max_chunks >= 0) n = std::min(n, max_chunks);
  check(n > 0, "{}: {} tokens is fewer than one chunk of {} ({})", path, tokens.size(), ctx, what);
  std::vector<std::vector<int32_t>> r;
  for (int64_t c = 0; c < n; ++c) {
    r.emplace_back(tokens.begin() + c * ctx, tokens.begin() + (c + 1) * ctx);
    if (tok.vocab().add_bos && tok.vocab().bos >= 0) r.back()[0] = tok.vocab().bos;
  }
  return r;
}

std::string resolve_model_path(const std::string& name) {
  if (std::filesystem::exists(name)) return name;
  const std::string cached = model_cache_dir() + "/" + name + ".gguf";
  if (std::filesystem::exists(cached)) return cached;
  const std::string dir = model_cache_dir() + "/" + name;  // a Hugging Face directory (an encoder)
  if (name.find('/') == std::string::npos && std::filesystem::is_directory(dir)) return dir;
  fail("{}: no such file, and no model of that name in {} (try `serval pull {}`)", name, model_cache_dir(), name);
}

DType parse_cache_type(const std::string& name) { return parse_kv_cache_type(name); }

void set_threads(int n) { set_compute_threads(n); }

}  // namespace serval::cli

namespace {

// After an error: prints it and ends the other ranks of a split model (they would wait forever).
int report(const char* what) {
  std::cerr << "error: " << what << "\n";
  serval::dist::abort_others();
  return 1;
}

// CLI11's message for a command line it refused, then the nearest known flag or subcommand for each
// argument it did not know ("--max-num-seq: did you mean '--max-num-seqs'?").
int refused(CLI::App& app, const CLI::ParseError& e) {
  const int rc = app.exit(e);
  if (rc == 0) return rc;  // --help, --version
  for (const std::string& arg : serval::cli::unknown_arguments(app))
    if (const std::string hint = serval::cli::suggest_flag(app, arg); !hint.empty()) std::cerr << arg << ": " << hint << "\n";
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Serval: an LLM inference server", "serval"};
  app.require_subcommand(1);
  serval::cli::add_info(app);
  serval::cli::add_generate(app);
  serval::cli::add_perplexity(app);
  serval::cli::add_tokenize(app);
  serval::cli::add_embed(app);
  serval::cli::add_rerank(app);
  serval::cli::add_pull(app);
  serval::cli::add_bench(app);
  serval::cli::add_train_heads(app);
  serval::cli::add_quantize(app);
  serval::cli::add_quality(app);
  serval::cli::add_imatrix(app);
  serval::cli::add_convert(app);
  serval::cli::add_export_shape(app);
  serval::cli::add_score(app);
  serval::cli::add_plan(app);
  serval::cli::add_serve(app);
  serval::cli::add_template(app);
  serval::cli::add_bench_serving(app);
  // -ngl on every command that takes a model (llama.cpp users type it everywhere).
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    if (sub->get_option_no_throw("--model") != nullptr) serval::cli::add_gpu_layers_flag(sub);
  app.set_version_flag("--version", std::function<std::string()>(serval::cli::version_text));
  // llama.cpp's -ngl, -np, -md ... as their long names (CLI11 would read "-ngl 99" as "-n gl").
  std::vector<std::string> args = serval::cli::rewrite_llama_cpp_flags(argc, argv);
  args.erase(args.begin());  // CLI11 takes them without argv[0], last first
  std::reverse(args.begin(), args.end());
  try {
    serval::set_compute_threads(0);  // every command computes on the available cores unless -t says otherwise
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return refused(app, e);
  } catch (const serval::dist::WorkerExit&) {  // a rank > 0 of a split model, stopped by rank 0
  } catch (const serval::Error& e) {
    return report(e.what());
  } catch (const std::bad_alloc&) {
    return report("out of memory");
  } catch (const std::exception& e) {
    return report(e.what());
  }
  serval::dist::shutdown();
  return 0;
}
