// Fixed-size KV blocks: reference counts, a free queue in LRU order, and the prefix-cache index
// (hash of a full block -> block). Pure bookkeeping: no tensors here.
#pragma once
#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

namespace serval {

class BlockPool {
 public:
  // A pool of `n_blocks` blocks, all free.
  explicit BlockPool(int32_t n_blocks);

  int32_t n_blocks() const { return int32_t(blocks_.size()); }
  // Blocks that can be handed out now: unreferenced ones, cached or not.
  int32_t n_free() const { return int32_t(free_.size()); }
  // Unreferenced blocks that still hold a cached prefix.
  int32_t n_cached_free() const { return n_cached_free_; }
  int32_t ref_count(int32_t block) const { return blocks_[block].ref_count; }
  std::optional<uint64_t> hash_of(int32_t block) const;

  // Takes the least recently freed block (evicting its cached prefix, if any); ref count becomes 1.
  // Requires n_free() > 0.
  int32_t allocate();
  // The block holding the full block with this hash, if cached (referenced or free).
  std::optional<int32_t> lookup(uint64_t hash) const;
  // Adds a reference (a cache hit takes a free block out of the free queue).
  void ref(int32_t block);
  // Drops a reference; at zero the block joins the free queue's tail, keeping its cached contents.
  void unref(int32_t block);
  // Registers a full block's hash for prefix caching; false (and no change) if another block
  // already holds that hash or this block already has one.
  bool set_hash(int32_t block, uint64_t hash);
  // Drops every cached prefix that no request references (the cache is emptied, blocks stay free).
  void reset_cache();
  // Free blocks, head (next to be evicted) first: for tests and the engine view.
  std::vector<int32_t> free_order() const;
  // Every hash in the prefix-cache index (any order).
  std::vector<uint64_t> cached_hashes() const;
  // Called with each hash that leaves the index (eviction or reset), when set.
  void set_on_drop(std::function<void(uint64_t)> fn) { on_drop_ = std::move(fn); }

 private:
  struct Block {
    int32_t ref_count = 0;
    bool has_hash = false;
    uint64_t hash = 0;
    std::list<int32_t>::iterator free_pos;
    bool in_free = false;
  };
  std::vector<Block> blocks_;
  std::list<int32_t> free_;  // LRU: head is evicted first
  std::unordered_map<uint64_t, int32_t> by_hash_;
  int32_t n_cached_free_ = 0;
  std::function<void(uint64_t)> on_drop_;

  void drop_hash(int32_t block);
};

}  // namespace serval
