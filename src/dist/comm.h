// The communication layer of a model split over ranks (docs/scale-out.md): point-to-point messages,
// a broadcast and a deterministic all-reduce. MPI implements it across processes (mpi_comm.cpp), an
// in-process hub across threads (local_comm.cpp: one process that splits its sums as the ranks do);
// NCCL could later. The model code sees only ShardIo (model/model.h), never this.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace serval::dist {

// What one rank has sent and how long it spent in communication calls (waiting for peers included),
// apart from the time spent receiving broadcasts (a rank > 0 idle until rank 0 sends the next step).
struct CommStats {
  uint64_t bytes_sent = 0;
  uint64_t messages = 0;
  double seconds = 0;
  double idle_seconds = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Blocking point-to-point messages; a receive must name the size sent. Messages between two ranks
  // arrive in the order sent. Errors (a peer gone) throw Error.
  void send(int to, const void* data, size_t bytes);
  void recv(int from, void* data, size_t bytes);
  // The root's `bytes` bytes at `data` on every rank (all call it with the same root and size).
  void broadcast(void* data, size_t bytes, int root);
  // x summed over `ranks` (this one among them): the first adds the others' shares in the listed order
  // (x0 + x1 + ... left to right) and sends the sum back, so every rank holds the same bits, and a
  // one-process run adding the shares in that order gets them too.
  void allreduce_sum(float* x, int64_t n, std::span<const int> ranks);
  // Ends every rank of the replica (this process included) after printing `why`.
  [[noreturn]] virtual void abort(const std::string& why) = 0;
  const CommStats& stats() const { return stats_; }

 protected:
  virtual void do_send(int to, const void* data, size_t bytes) = 0;
  virtual void do_recv(int from, void* data, size_t bytes) = 0;
  virtual void do_broadcast(void* data, size_t bytes, int root) = 0;

 private:
  CommStats stats_;
};

// `n` ranks as threads of this process: comm(r) is rank r's end (valid while the hub lives).
class LocalHub {
 public:
  static std::shared_ptr<LocalHub> create(int n);
  virtual ~LocalHub() = default;
  virtual Comm& comm(int rank) = 0;
};

// Whether this process was started by mpirun (OpenMPI, or a PMI launcher).
bool launched_by_mpi();
// MPI's world, initialized on first use; throws Error when Serval was built without MPI.
Comm& mpi_world();
// Finalizes MPI when it was initialized (call once, at the end of main).
void shutdown();
// After an error on this rank: ends the other ranks when MPI runs with more than one (no-op otherwise).
void abort_others();

}  // namespace serval::dist
