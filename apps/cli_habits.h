// What users of llama.cpp and vLLM type, made to work on every subcommand (README, "Commands"):
// llama.cpp's multi-letter single-dash flags, the GPU-layers flag on a CPU build, and the nearest
// known flag named when an argument is not known.
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace serval::cli {

// The arguments with llama.cpp's multi-letter single-dash flags spelled as their long names
// ("-ngl 99" -> "--n-gpu-layers 99", "-np=4" -> "--parallel=4"). CLI11 reads a single dash as one
// letter and its value ("-ngl 99" as "-n gl"), so these are rewritten before parsing. Every flag of
// llama.cpp's of that form is in the table, including those Serval has no use for: those then fail as
// their long name, which the unknown-flag message can match. argv[0] is kept.
std::vector<std::string> rewrite_llama_cpp_flags(int argc, const char* const* argv);

// Adds `-ngl/--n-gpu-layers N` (llama.cpp's; `--gpu-layers` too) to `cmd`: accepted on this CPU-only
// build, with a note on standard error when N > 0 that every layer runs on the CPU.
void add_gpu_layers_flag(CLI::App* cmd);

// For an argument that `app`'s parsed subcommand does not know: "did you mean '--x'?" naming the
// nearest of its flags (edit distance at most a third of the argument's length, at least 2), or "".
std::string suggest_flag(const CLI::App& app, const std::string& arg);

// The arguments CLI11 left unmatched (the app's and its parsed subcommands'), after a refused parse.
std::vector<std::string> unknown_arguments(const CLI::App& app);

// `serval --version`: version, compiler, and the CPU kernels' level on this machine.
std::string version_text();

}  // namespace serval::cli
