#include "apps/cli_habits.h"

#include <algorithm>
#include <fmt/format.h>
#include <iostream>
#include <string_view>
#include <utility>

#include "kernels/isa.h"

#ifndef SERVAL_VERSION
#define SERVAL_VERSION "unknown"
#endif

namespace serval::cli {
namespace {

// llama.cpp's (common/arg.cpp) multi-letter single-dash flags and their long names. Kept whole: a
// flag Serval does not take becomes its long name, which fails clearly instead of as "-n gl".
constexpr std::pair<std::string_view, std::string_view> kLlamaCppShortFlags[] = {
    {"-ngl", "--n-gpu-layers"},   {"-ngld", "--n-gpu-layers-draft"}, {"-np", "--parallel"},
    {"-md", "--model-draft"},     {"-ctk", "--cache-type-k"},        {"-ctv", "--cache-type-v"},
    {"-ctkd", "--cache-type-k-draft"}, {"-ctvd", "--cache-type-v-draft"}, {"-fa", "--flash-attn"},
    {"-ub", "--ubatch-size"},     {"-cb", "--cont-batching"},        {"-nocb", "--no-cont-batching"},
    {"-tb", "--threads-batch"},   {"-td", "--threads-draft"},        {"-tbd", "--threads-batch-draft"},
    {"-cd", "--ctx-size-draft"},  {"-nkvo", "--no-kv-offload"},      {"-sm", "--split-mode"},
    {"-ts", "--tensor-split"},    {"-mg", "--main-gpu"},             {"-dev", "--device"},
    {"-hf", "--hf-repo"},         {"-hff", "--hf-file"},             {"-mu", "--model-url"},
    {"-cnv", "--conversation"},   {"-no-cnv", "--no-conversation"},  {"-sp", "--special"},
    {"-lv", "--verbosity"},       {"-dt", "--defrag-thold"},         {"-nr", "--no-repack"},
    {"-kvu", "--kv-unified"},     {"-cram", "--cache-ram"},          {"-ot", "--override-tensor"},
    {"-cmoe", "--cpu-moe"},       {"-ncmoe", "--n-cpu-moe"},         {"-jf", "--json-schema-file"},
    {"-mli", "--multiline-input"}, {"-rea", "--reasoning"},
};

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// Every name a user can type for the flags and subcommands of `app`: "--long", "-s", "sub".
std::vector<std::string> names_of(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::Option* opt : app.get_options()) {
    for (const std::string& l : opt->get_lnames()) names.push_back("--" + l);
    for (const std::string& s : opt->get_snames()) names.push_back("-" + s);
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
  return names;
}

// The subcommand the user chose, or the app itself when none was parsed.
const CLI::App& chosen(const CLI::App& app) {
  const std::vector<const CLI::App*> parsed = app.get_subcommands([](const CLI::App* s) { return s->parsed(); });
  return parsed.empty() ? app : *parsed.front();
}

}  // namespace

std::vector<std::string> rewrite_llama_cpp_flags(int argc, const char* const* argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--") break;  // what follows is not flags
    const std::string_view a = args[i];
    const std::string_view flag = a.substr(0, a.find('='));
    for (const auto& [shorthand, long_name] : kLlamaCppShortFlags)
      if (flag == shorthand) {
        args[i] = std::string(long_name) + std::string(a.substr(flag.size()));
        break;
      }
  }
  return args;
}

void add_gpu_layers_flag(CLI::App* cmd) {
  cmd->add_option_function<int>(
         "--n-gpu-layers,--gpu-layers",
         [](int n) {
           if (n > 0)
             std::cerr << "note: -ngl/--n-gpu-layers " << n
                       << ": this build of Serval has no GPU backend; every layer runs on the CPU\n";
         },
         "layers to offload to a GPU (llama.cpp's -ngl): accepted; this build computes on the CPU")
      ->type_name("N");
}

std::string suggest_flag(const CLI::App& app, const std::string& arg) {
  const std::string typed = arg.substr(0, arg.find('='));
  const CLI::App& cmd = chosen(app);
  std::string best;
  size_t best_d = std::max<size_t>(2, typed.size() / 3) + 1;
  for (const std::string& name : names_of(cmd)) {
    if (typed.starts_with('-') != name.starts_with('-')) continue;  // a flag for a flag, a word for a word
    const size_t d = edit_distance(typed, name);
    if (d < best_d) best_d = d, best = name;
  }
  return best.empty() ? "" : fmt::format("did you mean '{}'?", best);
}

std::vector<std::string> unknown_arguments(const CLI::App& app) {
  std::vector<std::string> out = app.remaining(/*recurse=*/true);
  out.erase(std::remove(out.begin(), out.end(), "--"), out.end());
  return out;
}

std::string version_text() {
#if defined(__clang__)
  const std::string compiler = fmt::format("clang {}.{}.{}", __clang_major__, __clang_minor__, __clang_patchlevel__);
#elif defined(__GNUC__)
  const std::string compiler = fmt::format("gcc {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
#else
  const std::string compiler = "an unknown compiler";
#endif
  return fmt::format("serval {}\nbuilt with {}; CPU kernels on this machine: {}; GPU backends: none",
                     SERVAL_VERSION, compiler, cpu::isa_name(cpu::active_isa()));
}

}  // namespace serval::cli
