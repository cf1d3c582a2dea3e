// Comm over MPI's world communicator. Errors return (MPI_ERRORS_RETURN) and become Error; a rank
// that dies is noticed by mpirun, which ends the others.
#include "base/error.h"
#include "dist/comm.h"

#ifdef SERVAL_HAVE_MPI
#include <mpi.h>

#include <climits>
#include <cstdio>

namespace serval::dist {
namespace {

void check_mpi(int rc, const char* what, int rank, int peer) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail("rank {}: {} (peer rank {}) failed: {}", rank, what, peer, std::string(text, size_t(len)));
}

class MpiComm : public Comm {
 public:
  MpiComm() {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);  // serve calls from its engine thread
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~MpiComm() override { MPI_Finalize(); }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  [[noreturn]] void abort(const std::string& why) override {
    std::fprintf(stderr, "error: rank %d: %s\n", rank_, why.c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }

 protected:
  void do_send(int to, const void* data, size_t bytes) override {
    check(bytes <= size_t(INT_MAX), "message of {} bytes is too large", bytes);
    check_mpi(MPI_Send(data, int(bytes), MPI_BYTE, to, 0, MPI_COMM_WORLD), "MPI_Send", rank_, to);
  }
  void do_recv(int from, void* data, size_t bytes) override {
    check(bytes <= size_t(INT_MAX), "message of {} bytes is too large", bytes);
    MPI_Status st;
    check_mpi(MPI_Recv(data, int(bytes), MPI_BYTE, from, 0, MPI_COMM_WORLD, &st), "MPI_Recv", rank_, from);
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    check(size_t(got) == bytes, "rank {}: message of {} bytes from rank {}, expected {}", rank_, got, from, bytes);
  }
  void do_broadcast(void* data, size_t bytes, int root) override {
    check(bytes <= size_t(INT_MAX), "message of {} bytes is too large", bytes);
    check_mpi(MPI_Bcast(data, int(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast", rank_, root);
  }

 private:
  int rank_ = 0, size_ = 1;
};

std::unique_ptr<MpiComm>& world() {
  static std::unique_ptr<MpiComm> w;
  return w;
}

}  // namespace

Comm& mpi_world() {
  if (!world()) world() = std::make_unique<MpiComm>();
  return *world();
}

void shutdown() { world().reset(); }

void abort_others() {
  if (world() && world()->size() > 1) MPI_Abort(MPI_COMM_WORLD, 1);
}

}  // namespace serval::dist

#else  // built without MPI

namespace serval::dist {
Comm& mpi_world() { fail("this serval was built without MPI (install libopenmpi-dev and rebuild)"); }
void shutdown() {}
void abort_others() {}
}  // namespace serval::dist

#endif
