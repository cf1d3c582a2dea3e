#include "kv/block_pool.h"

#include "base/error.h"

namespace serval {

namespace {

// Checked before the blocks are sized (a negative count would otherwise reach std::vector).
size_t positive_blocks(int32_t n_blocks) {
  check(n_blocks > 0, "the KV pool needs at least one block (got {})", n_blocks);
  return size_t(n_blocks);
}

}  // namespace

BlockPool::BlockPool(int32_t n_blocks) : blocks_(positive_blocks(n_blocks)) {
  for (int32_t b = 0; b < n_blocks; ++b) {
    blocks_[b].free_pos = free_.insert(free_.end(), b);
    blocks_[b].in_free = true;
  }
}

std::optional<uint64_t> BlockPool::hash_of(int32_t block) const {
  const auto& b = blocks_[block];
  return b.has_hash ? std::optional(b.hash) : std::nullopt;
}

void BlockPool::drop_hash(int32_t block) {
  auto& b = blocks_[block];
  if (!b.has_hash) return;
  by_hash_.erase(b.hash);
  b.has_hash = false;
  if (b.in_free) --n_cached_free_;
  if (on_drop_) on_drop_(b.hash);
}

int32_t BlockPool::allocate() {
  check(!free_.empty(), "internal: KV block pool is empty");
  const int32_t id = free_.front();
  free_.pop_front();
  auto& b = blocks_[id];
  drop_hash(id);
  b.in_free = false;
  b.ref_count = 1;
  return id;
}

std::optional<int32_t> BlockPool::lookup(uint64_t hash) const {
  auto it = by_hash_.find(hash);
  return it == by_hash_.end() ? std::nullopt : std::optional(it->second);
}

void BlockPool::ref(int32_t block) {
  auto& b = blocks_[block];
  if (b.in_free) {
    free_.erase(b.free_pos);
    b.in_free = false;
    if (b.has_hash) --n_cached_free_;
  }
  ++b.ref_count;
}

void BlockPool::unref(int32_t block) {
  auto& b = blocks_[block];
  check(b.ref_count > 0, "internal: block {} released more often than referenced", block);
  if (--b.ref_count > 0) return;
  b.free_pos = free_.insert(free_.end(), block);
  b.in_free = true;
  if (b.has_hash) ++n_cached_free_;
}

bool BlockPool::set_hash(int32_t block, uint64_t hash) {
  auto& b = blocks_[block];
  if (b.has_hash || by_hash_.count(hash)) return false;
  b.has_hash = true;
  b.hash = hash;
  by_hash_[hash] = block;
  if (b.in_free) ++n_cached_free_;
  return true;
}

void BlockPool::reset_cache() {
  for (int32_t id : free_) drop_hash(id);
}

std::vector<int32_t> BlockPool::free_order() const { return {free_.begin(), free_.end()}; }

std::vector<uint64_t> BlockPool::cached_hashes() const {
  std::vector<uint64_t> out;
  out.reserve(by_hash_.size());
  for (const auto& [hash, block] : by_hash_) out.push_back(hash);
  return out;
}

}  // namespace serval
