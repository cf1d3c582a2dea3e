#include "dist/step.h"

#include <cstring>

#include "base/error.h"

namespace serval::dist {
namespace {

// A flat message of int32 words: scalars, and vectors as their size then their elements.
class Writer {
 public:
  void put(int64_t v) {
    words_.push_back(int32_t(v & 0xffffffff));
    words_.push_back(int32_t(v >> 32));
  }
  template <class T>
  void put_vec(const std::vector<T>& v) {
    put(int64_t(v.size()));
    for (T x : v) words_.push_back(int32_t(x));
  }
  std::vector<int32_t>& words() { return words_; }

 private:
  std::vector<int32_t> words_;
};

class Reader {
 public:
  explicit Reader(const std::vector<int32_t>& w) : w_(w) {}
  int64_t get() {
    check(pos_ + 2 <= w_.size(), "truncated step message");
    const int64_t v = int64_t(uint32_t(w_[pos_])) | (int64_t(w_[pos_ + 1]) << 32);
    pos_ += 2;
    return v;
  }
  template <class T>
  std::vector<T> get_vec() {
    const int64_t n = get();
    check(n >= 0 && pos_ + size_t(n) <= w_.size(), "truncated step message");
    std::vector<T> v(w_.begin() + pos_, w_.begin() + pos_ + size_t(n));
    pos_ += size_t(n);
    return v;
  }

 private:
  const std::vector<int32_t>& w_;
  size_t pos_ = 0;
};

void put_batch(Writer& w, const Batch& b) {
  w.put(b.n_groups());
  w.put(b.block_size);
  w.put_vec(b.tokens), w.put_vec(b.positions), w.put_vec(b.seq_ids), w.put_vec(b.want_logits);
  w.put_vec(b.table_block_size);
  for (int g = 0; g < b.n_groups(); ++g) {
    w.put_vec(b.slots[size_t(g)]);
    w.put(int64_t(b.block_tables[size_t(g)].size()));
    for (const auto& table : b.block_tables[size_t(g)]) w.put_vec(table);
  }
}

Batch get_batch(Reader& r) {
  Batch b(int(r.get()));
  b.block_size = int32_t(r.get());
  b.tokens = r.get_vec<int32_t>(), b.positions = r.get_vec<int32_t>(), b.seq_ids = r.get_vec<int32_t>();
  b.want_logits = r.get_vec<uint8_t>();
  b.table_block_size = r.get_vec<int32_t>();
  for (int g = 0; g < b.n_groups(); ++g) {
    b.slots[size_t(g)] = r.get_vec<int32_t>();
    b.block_tables[size_t(g)].resize(size_t(r.get()));
    for (auto& table : b.block_tables[size_t(g)]) table = r.get_vec<int32_t>();
  }
  return b;
}

}  // namespace

Step make_step(const Batch& batch, KvCache& kv, bool want_hidden) {
  Step s;
  s.stop = false;
  s.want_hidden = want_hidden;
  s.cache_id = uint64_t(reinterpret_cast<uintptr_t>(&kv));
  s.kv_type = kv.type();
  for (int g = 0; g < kv.n_groups(); ++g) s.n_slots.push_back(kv.n_slots(g));
  s.copies = kv.take_copies();
  s.batch = batch;
  return s;
}

void send_step(Comm& comm, const Step& s) {
  Writer w;
  w.put(s.stop), w.put(s.want_hidden), w.put(int64_t(s.cache_id)), w.put(int64_t(s.kv_type));
  w.put_vec(s.n_slots);
  w.put(int64_t(s.copies.size()));
  for (const auto& c : s.copies) w.put(c.group), w.put(c.from), w.put(c.to);
  if (!s.stop) put_batch(w, s.batch);
  int64_t n = int64_t(w.words().size());
  comm.broadcast(&n, sizeof n, 0);
  comm.broadcast(w.words().data(), size_t(n) * 4, 0);
}

Step recv_step(Comm& comm) {
  int64_t n = 0;
  comm.broadcast(&n, sizeof n, 0);
  std::vector<int32_t> words(static_cast<size_t>(n));
  comm.broadcast(words.data(), size_t(n) * 4, 0);
  Reader r(words);
  Step s;
  s.stop = r.get() != 0, s.want_hidden = r.get() != 0;
  s.cache_id = uint64_t(r.get()), s.kv_type = DType(r.get());
  s.n_slots = r.get_vec<int64_t>();
  s.copies.resize(size_t(r.get()));
  for (auto& c : s.copies) c.group = int32_t(r.get()), c.from = int32_t(r.get()), c.to = int32_t(r.get());
  if (!s.stop) s.batch = get_batch(r);
  return s;
}

}  // namespace serval::dist
