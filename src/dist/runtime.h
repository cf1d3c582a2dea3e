// A model split over ranks (docs/scale-out.md): rank 0 runs the command (scheduler, sampling) and its
// share of every forward pass, after sending the step (batch plan, KV slot copies) to the other
// ranks; they run their shares in run_worker until rank 0 stops them.
#pragma once
#include <memory>
#include <string>

#include "dist/comm.h"
#include "model/model.h"

namespace serval::dist {

// Thrown on ranks > 0 once rank 0 has stopped them: main ends the process normally.
struct WorkerExit {};

// Loads `path` split over `tp` x `pp` ranks. Under mpirun (with tp x pp ranks): rank 0 returns its
// share, driving the others through forward(); any other rank serves rank 0 here and then throws
// WorkerExit. In one process (no mpirun): the other ranks run as threads over an in-process hub, with
// the same arithmetic (the one-process run that splits its sums as the ranks do). tp x pp == 1: a
// plain Model::load.
std::unique_ptr<Model> load_model(const std::string& path, LoadOptions options, int tp, int pp);

// Whether this process is a rank > 0 of a model split over tp x pp MPI ranks (it only serves rank 0:
// a command should load the model before starting anything else, such as a listening socket).
bool is_worker_rank(int tp, int pp);

// The loop of a rank > 0: runs its share of each step rank 0 sends until rank 0 stops it.
void run_worker(const Model& model, Comm& comm);

}  // namespace serval::dist
