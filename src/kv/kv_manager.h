// KV manager: block tables per request over one BlockPool per KV group, the prefix cache (a hash
// chain over full blocks), and sliding-window freeing. Ask first (can_allocate), then commit
// (allocate / grow); an allocation is an RAII handle that returns its blocks when dropped.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "kv/block_pool.h"
#include "kv/kv_events.h"

namespace serval {

class KvManager;

// The blocks a request holds: one table per KV group (-1 where a sliding window freed a block).
class KvAllocation {
 public:
  KvAllocation() = default;
  KvAllocation(KvAllocation&& other) noexcept;
  KvAllocation& operator=(KvAllocation&& other) noexcept;
  KvAllocation(const KvAllocation&) = delete;
  KvAllocation& operator=(const KvAllocation&) = delete;
  ~KvAllocation();  // returns every block to the pool

  bool empty() const { return manager_ == nullptr; }
  const std::vector<int32_t>& table(int group) const { return tables_[group]; }
  // Blocks before this one in table(group) are all -1 (left a sliding window, or never held).
  int64_t first_live_block(int group) const { return window_begin_[group]; }
  // Blocks held (entries >= 0), over all groups.
  int64_t blocks_held() const { return n_held_; }
  // Unique to this allocation among the manager's (0 when empty): a copy of the tables taken under
  // the same serial stays a prefix of them, except for blocks that left a window since.
  uint64_t serial() const { return serial_; }
  // Releases the blocks now (the handle becomes empty).
  void release();

 private:
  friend class KvManager;
  KvManager* manager_ = nullptr;
  std::vector<std::vector<int32_t>> tables_;
  std::vector<int64_t> window_begin_;  // per group, see first_live_block
  int64_t n_held_ = 0;
  uint64_t serial_ = 0;
  int64_t n_registered_ = 0;  // full blocks registered in the prefix cache so far
  uint64_t last_hash_ = 0;    // hash of block n_registered_ - 1
};

struct KvManagerConfig {
  int32_t block_size = 16;
  std::vector<int32_t> blocks_per_group;  // one entry per KV group
  std::vector<int64_t> window_per_group;  // sliding window of each group, 0 for none
  bool prefix_caching = true;
};

struct PrefixHit {
  int64_t n_tokens = 0;                        // tokens whose KV is reused
  std::vector<std::vector<int32_t>> blocks;    // per group, -1 for blocks outside a window
  std::vector<uint64_t> hashes;                // hash chain of the reused blocks
};

class KvManager {
 public:
  explicit KvManager(KvManagerConfig config);

  int32_t block_size() const { return config_.block_size; }
  int n_groups() const { return int(pools_.size()); }
  const BlockPool& pool(int group) const { return pools_[group]; }
  const KvManagerConfig& config() const { return config_; }

  // Hash of a full block given its parent's hash (0 for the first block) and its tokens.
  static uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens);
  // Extends `chain`, the hash chain of the full blocks of a growing token sequence, to every full
  // block of `tokens` (which extends the sequence hashed so far): only new blocks are hashed. Does
  // nothing when prefix caching is off (nothing reads the hashes then).
  // `salt` starts the chain (0: plain tokens); requests whose KV differs for the same tokens (a LoRA
  // adapter) salt their chains so that they never share blocks with other requests.
  void hash_blocks(std::span<const int32_t> tokens, std::vector<uint64_t>& chain, uint64_t salt = 0) const;
  // Longest reusable prefix of `tokens`: whole blocks, and always fewer than all tokens (the last
  // token is computed so that logits exist). Changes nothing.
  PrefixHit find_prefix(std::span<const int32_t> tokens) const;
  // The same from the hash chain of the tokens' full blocks (hash_blocks): block lookups only.
  PrefixHit find_prefix_hashed(std::span<const uint64_t> chain, int64_t n_tokens) const;
  // Whether a request holding `alloc` (or a new one starting from `hit`) can grow to `n_tokens`.
  bool can_allocate(const KvAllocation* alloc, const PrefixHit* hit, int64_t n_tokens) const;
  // Whether a request of `n_tokens` could ever fit (alone, in the empty pool).
  bool fits_alone(int64_t n_tokens, int64_t max_chunk) const;
  // A new allocation: the hit's blocks referenced, grown to `n_tokens`. Requires can_allocate.
  KvAllocation allocate(const PrefixHit& hit, int64_t n_tokens);
  // Grows `alloc` to `n_tokens`. Requires can_allocate.
  void grow(KvAllocation& alloc, int64_t n_tokens);
  // After the first `n_computed` of `tokens` have KV: registers newly full blocks in the prefix
  // cache and frees blocks that every future token's window has left.
  // Work proportional to the blocks that became full or left a window since the last commit.
  void commit(KvAllocation& alloc, std::span<const int32_t> tokens, int64_t n_computed);
  // The same from the tokens' hash chain (hash_blocks; it covers at least n_computed tokens). `tokens`
  // (the same sequence) is only read for the events' token ids.
  void commit_hashed(KvAllocation& alloc, std::span<const uint64_t> chain, int64_t n_computed,
                     std::span<const int32_t> tokens = {});
  // Drops cached prefixes no request holds. With events on, an index left empty is announced as
  // AllBlocksCleared (instead of one removal per hash).
  void reset_prefix_cache();
  // Records how group 0's prefix-cache index changes (kv_events.h) from now on; the first group is the
  // one every prefix hit needs. Off by default.
  void enable_events();
  bool events_enabled() const { return events_on_; }
  // The events since the last call, oldest first.
  std::vector<KvEvent> take_events();
  // Fraction of blocks referenced by requests, over all groups.
  double usage() const;

 private:
  friend class KvAllocation;
  KvManagerConfig config_;
  std::vector<BlockPool> pools_;
  uint64_t next_serial_ = 1;
  bool events_on_ = false;
  std::vector<KvEvent> events_;

  int64_t blocks_for(int64_t n_tokens) const { return (n_tokens + config_.block_size - 1) / config_.block_size; }
  void free_blocks(std::vector<std::vector<int32_t>>& tables);
  // `tokens`: the block's tokens (read for events only; may be empty).
  void register_block(KvAllocation& alloc, uint64_t hash, std::span<const int32_t> tokens);
  void record_stored(uint64_t parent, bool first, uint64_t hash, std::span<const int32_t> tokens);
  void record_removed(uint64_t hash);
  void free_window_blocks(KvAllocation& alloc, int64_t n_computed);
};

}  // namespace serval
