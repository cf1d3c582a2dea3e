#include "dist/comm.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

#include "base/error.h"

namespace serval::dist {
namespace {

using Clock = std::chrono::steady_clock;

// Adds the seconds since its construction to `total`.
struct Timer {
  double& total;
  Clock::time_point t0 = Clock::now();
  ~Timer() { total += std::chrono::duration<double>(Clock::now() - t0).count(); }
};

}  // namespace

void Comm::send(int to, const void* data, size_t bytes) {
  Timer t{stats_.seconds};
  do_send(to, data, bytes);
  stats_.bytes_sent += bytes;
  ++stats_.messages;
}

void Comm::recv(int from, void* data, size_t bytes) {
  Timer t{stats_.seconds};
  do_recv(from, data, bytes);
}

void Comm::broadcast(void* data, size_t bytes, int root) {
  Timer t{rank() == root ? stats_.seconds : stats_.idle_seconds};
  do_broadcast(data, bytes, root);
  if (rank() == root) stats_.bytes_sent += bytes * size_t(size() - 1), stats_.messages += size_t(size() - 1);
}

void Comm::allreduce_sum(float* x, int64_t n, std::span<const int> ranks) {
  if (ranks.size() < 2) return;
  const size_t bytes = size_t(n) * sizeof(float);
  if (rank() != ranks[0]) {
    send(ranks[0], x, bytes);
    return recv(ranks[0], x, bytes);
  }
  std::vector<float> share(static_cast<size_t>(n));
  for (size_t i = 1; i < ranks.size(); ++i) {
    recv(ranks[i], share.data(), bytes);
    for (int64_t j = 0; j < n; ++j) x[j] += share[j];
  }
  for (size_t i = 1; i < ranks.size(); ++i) send(ranks[i], x, bytes);
}

namespace {

// FIFO mailboxes per (from, to) pair, shared by the ranks of one process.
class Hub : public LocalHub, public std::enable_shared_from_this<Hub> {
 public:
  explicit Hub(int n) {
    for (int r = 0; r < n; ++r) ends_.push_back(std::make_unique<End>(*this, r, n));
  }
  Comm& comm(int rank) override { return *ends_.at(size_t(rank)); }

 private:
  class End : public Comm {
   public:
    End(Hub& hub, int rank, int size) : hub_(hub), rank_(rank), size_(size) {}
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    [[noreturn]] void abort(const std::string& why) override {
      std::fprintf(stderr, "error: rank %d: %s\n", rank_, why.c_str());
      std::_Exit(1);  // the ranks are threads of this process: it ends them all
    }

   protected:
    void do_send(int to, const void* data, size_t bytes) override {
      std::vector<uint8_t> msg(bytes);
      if (bytes) std::memcpy(msg.data(), data, bytes);
      std::lock_guard lock(hub_.mu_);
      hub_.box_[{rank_, to}].push_back(std::move(msg));
      hub_.cv_.notify_all();
    }
    void do_recv(int from, void* data, size_t bytes) override {
      std::unique_lock lock(hub_.mu_);
      auto& box = hub_.box_[{from, rank_}];
      hub_.cv_.wait(lock, [&] { return !box.empty(); });
      check(box.front().size() == bytes, "rank {}: message of {} bytes from rank {}, expected {}", rank_,
            box.front().size(), from, bytes);
      if (bytes) std::memcpy(data, box.front().data(), bytes);
      box.pop_front();
    }
    void do_broadcast(void* data, size_t bytes, int root) override {
      if (rank_ != root) return do_recv(root, data, bytes);
      for (int r = 0; r < size_; ++r)
        if (r != root) do_send(r, data, bytes);
    }

   private:
    Hub& hub_;
    int rank_, size_;
  };

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int, int>, std::deque<std::vector<uint8_t>>> box_;
  std::vector<std::unique_ptr<End>> ends_;
};

}  // namespace

std::shared_ptr<LocalHub> LocalHub::create(int n) { return std::make_shared<Hub>(n); }

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (const char* s = std::getenv(v); s && *s) return true;
  return false;
}

}  // namespace serval::dist
