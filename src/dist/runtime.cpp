#include "dist/runtime.h"

#include <fmt/core.h>

#include <cstdlib>
#include <exception>
#include <map>
#include <thread>

#include "base/error.h"
#include "dist/step.h"

namespace serval::dist {
namespace {

// ShardIo over a Comm: TP peers are the ranks of this stage, pipeline neighbours the same TP rank
// of the previous / next stage.
class Channel : public ShardIo {
 public:
  Channel(Comm& comm, const ShardLayout& s) : comm_(comm), s_(s) {
    for (int r = 0; r < s.tp; ++r) tp_group_.push_back(s.stage * s.tp + r);
  }
  void tp_sum(float* x, int64_t n) override { comm_.allreduce_sum(x, n, tp_group_); }
  void recv_prev(float* x, int64_t n) override { comm_.recv(s_.rank() - s_.tp, x, size_t(n) * 4); }
  void send_next(const float* x, int64_t n) override { comm_.send(s_.rank() + s_.tp, x, size_t(n) * 4); }

 private:
  Comm& comm_;
  ShardLayout s_;
  std::vector<int> tp_group_;
};

int64_t count_outputs(const Batch& b) {
  int64_t n = 0;
  for (uint8_t w : b.want_logits) n += w;
  return n;
}

void print_stats(const Comm& comm) {
  if (!std::getenv("SERVAL_COMM_STATS")) return;
  const auto& st = comm.stats();
  fmt::print(stderr, "comm: rank {}: sent {} bytes in {} messages, {:.3f} s in communication calls, {:.3f} s waiting "
             "for steps\n", comm.rank(), st.bytes_sent, st.messages, st.seconds, st.idle_seconds);
}

// Rank 0's forward: send the step, run its share, gather the logits rows of the last stage's ranks.
class LeaderDriver : public ForwardDriver {
 public:
  LeaderDriver(const Model& model, Comm& comm, std::shared_ptr<LocalHub> hub, std::vector<std::thread> threads)
      : model_(model), comm_(comm), io_(comm, model.config().shard), hub_(std::move(hub)), threads_(std::move(threads)) {}
  // Stops the other ranks, unless a step failed half-way (they wait inside it: main then ends them
  // with MPI_Abort, or the process exits past the detached threads).
  ~LeaderDriver() override {
    try {
      if (!in_step_) send_step(comm_, Step{});
    } catch (const std::exception&) {
      in_step_ = true;
    }
    for (auto& t : threads_) in_step_ ? t.detach() : t.join();
    print_stats(comm_);
  }

  void forward(const Batch& batch, KvCache& kv, std::vector<float>& logits, std::vector<float>* hidden) override {
    in_step_ = true;
    send_step(comm_, make_step(batch, kv, hidden != nullptr));
    std::vector<float> part;
    model_.forward_shard(batch, kv, &io_, part, hidden);
    gather(count_outputs(batch), part, logits, hidden);
    in_step_ = false;
  }

 private:
  void gather(int64_t n_out, std::vector<float>& part, std::vector<float>& logits, std::vector<float>* hidden) {
    const auto& c = model_.config();
    const ShardLayout& me = c.shard;
    logits.assign(size_t(n_out * c.n_vocab), 0.0f);
    if (n_out == 0) return;
    for (int r = 0; r < me.tp; ++r) {
      const ShardLayout s = make_shard_layout(c, me.tp, me.pp, r, me.pp - 1);
      const int64_t width = s.vocab_end - s.vocab_begin;
      if (s.rank() != 0) {
        part.resize(size_t(n_out * width));
        comm_.recv(s.rank(), part.data(), part.size() * 4);
      }
      for (int64_t t = 0; t < n_out; ++t)
        std::copy_n(part.data() + t * width, width, logits.data() + t * c.n_vocab + s.vocab_begin);
    }
    const int last = (me.pp - 1) * me.tp;
    if (hidden && last != 0) {
      hidden->resize(size_t(n_out * c.n_embd));
      comm_.recv(last, hidden->data(), hidden->size() * 4);
    }
  }

  const Model& model_;
  Comm& comm_;
  Channel io_;
  std::shared_ptr<LocalHub> hub_;
  std::vector<std::thread> threads_;
  bool in_step_ = false;
};

// The worker's KV caches, one per cache of rank 0 (by its id), rebuilt when the shape changes.
class WorkerCaches {
 public:
  KvCache& get(const Model& model, const Step& st) {
    auto& kv = caches_[st.cache_id];
    const bool same = kv && kv->type() == st.kv_type && kv->n_groups() == int(st.n_slots.size()) && same_slots(*kv, st);
    if (!same) kv = std::make_unique<KvCache>(model.config(), st.n_slots, st.kv_type);
    KvCache& current = *kv;
    if (caches_.size() > 8) caches_.erase(caches_.begin()->first == st.cache_id ? std::next(caches_.begin()) : caches_.begin());
    return current;
  }

 private:
  static bool same_slots(const KvCache& kv, const Step& st) {
    for (int g = 0; g < kv.n_groups(); ++g)
      if (kv.n_slots(g) != st.n_slots[size_t(g)]) return false;
    return true;
  }
  std::map<uint64_t, std::unique_ptr<KvCache>> caches_;
};

// A rank > 0's share of one step: replay the slot copies, run the layers, send the logits rows.
void worker_step(const Model& model, Comm& comm, Channel& io, KvCache& kv, const Step& st) {
  for (const auto& cp : st.copies) kv.copy_slot(cp.group, cp.from, cp.to);
  std::vector<float> logits, hidden;
  if (!model.forward_shard(st.batch, kv, &io, logits, st.want_hidden ? &hidden : nullptr)) return;
  if (count_outputs(st.batch) == 0) return;
  comm.send(0, logits.data(), logits.size() * 4);
  if (st.want_hidden && model.config().shard.tp_rank == 0) comm.send(0, hidden.data(), hidden.size() * 4);
}

LoadOptions rank_options(LoadOptions o, int tp, int pp, int rank) {
  o.tp = tp, o.pp = pp, o.tp_rank = rank % tp, o.stage = rank / tp;
  return o;
}

}  // namespace

void run_worker(const Model& model, Comm& comm) {
  Channel io(comm, model.config().shard);
  WorkerCaches caches;
  for (;;) {
    const Step st = recv_step(comm);
    if (st.stop) break;
    worker_step(model, comm, io, caches.get(model, st), st);
  }
  print_stats(comm);
}

bool is_worker_rank(int tp, int pp) { return tp * pp > 1 && launched_by_mpi() && mpi_world().rank() != 0; }

std::unique_ptr<Model> load_model(const std::string& path, LoadOptions options, int tp, int pp) {
  check(tp >= 1 && pp >= 1, "--tp and --pp must be at least 1");
  const int n = tp * pp;
  const char* world = std::getenv("OMPI_COMM_WORLD_SIZE");
  check(n > 1 || !world || std::atoi(world) <= 1,
        "mpirun started {} ranks: split the model over them with --tp T --pp P (T x P = {})", world ? world : "", world ? world : "");
  if (n == 1) return Model::load(path, options);
  if (launched_by_mpi()) {
    Comm& comm = mpi_world();
    check(comm.size() == n, "--tp {} x --pp {} needs {} ranks, but mpirun started {}", tp, pp, n, comm.size());
    auto model = Model::load(path, rank_options(options, tp, pp, comm.rank()));
    if (comm.rank() != 0) {
      run_worker(*model, comm);
      throw WorkerExit{};
    }
    model->set_driver(std::make_shared<LeaderDriver>(*model, comm, nullptr, std::vector<std::thread>{}));
    return model;
  }
  auto hub = LocalHub::create(n);
  std::vector<std::thread> threads;
  for (int r = 1; r < n; ++r)
    threads.emplace_back([hub, path, o = rank_options(options, tp, pp, r), r] {
      try {
        run_worker(*Model::load(path, o), hub->comm(r));
      } catch (const std::exception& e) {
        hub->comm(r).abort(e.what());
      }
    });
  std::unique_ptr<Model> model;
  try {
    model = Model::load(path, rank_options(options, tp, pp, 0));
  } catch (const std::exception& e) {
    hub->comm(0).abort(e.what());  // the other ranks wait for steps: end the process
  }
  model->set_driver(std::make_shared<LeaderDriver>(*model, hub->comm(0), hub, std::move(threads)));
  return model;
}

}  // namespace serval::dist
