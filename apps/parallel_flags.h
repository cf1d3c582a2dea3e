// `--tp T --pp P`: split the model over T x P ranks (mpirun -np T*P), or, without mpirun, over T x P
// threads of one process that split their sums the same way (docs/scale-out.md). Shared by the
// commands that load a model to run it.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "dist/runtime.h"

namespace serval::cli {

struct ParallelFlags {
  int tp = 1, pp = 1;
  std::string load_format = "auto";

  void add_to(CLI::App* cmd) {
    cmd->add_option("--tp", tp, "tensor-parallel ranks: attention heads and FFN columns split over them (default 1)");
    cmd->add_option("--pp", pp, "pipeline-parallel stages: layers split over them (default 1); mpirun -np TP*PP");
    add_load_format(cmd, load_format);
  }

  // vLLM's --load-format: auto (read the weights) or dummy (generate them from the GGUF header; the
  // file may be a shape file from `serval export-shape`).
  static void add_load_format(CLI::App* cmd, std::string& format) {
    cmd->add_option("--load-format", format, "auto (read the weights) or dummy (generated from the header: a GGUF or a shape "
                                             "file of serval export-shape; for speed and sizing only)")
        ->check(CLI::IsMember({"auto", "dummy"}));
  }
  static LoadOptions with_format(LoadOptions options, const std::string& format) {
    options.dummy = format == "dummy";
    return options;
  }

  // The model, or this rank's share of it. Under mpirun, ranks other than 0 serve rank 0 inside this
  // call and then throw dist::WorkerExit (main ends them normally): call it before any output.
  std::unique_ptr<Model> load(const std::string& path, const LoadOptions& options = {}) const {
    return dist::load_model(path, with_format(options, load_format), tp, pp);
  }

  // True on MPI ranks > 0 of a split model: such a rank should call load() first thing (it never returns).
  bool worker_rank() const { return dist::is_worker_rank(tp, pp); }
};

}  // namespace serval::cli
