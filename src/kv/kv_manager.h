// KV manager: block tables per request over one BlockPool per KV group, the prefix cache (a hash
// chain over full blocks), and sliding-window freeing. Ask first (can_allocate), then commit
// (allocate / grow); an allocation is an RAII handle that returns its blocks when dropped.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "kv/block_pool.h"

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
  // Releases the blocks now (the handle becomes empty).
  void release();

 private:
  friend class KvManager;
  KvManager* manager_ = nullptr;
  std::vector<std::vector<int32_t>> tables_;
  std::vector<uint64_t> hashes_;  // hash chain of the full blocks registered so far
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
  // Longest reusable prefix of `tokens`: whole blocks, and always fewer than all tokens (the last
  // token is computed so that logits exist). Changes nothing.
  PrefixHit find_prefix(std::span<const int32_t> tokens) const;
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
  void commit(KvAllocation& alloc, std::span<const int32_t> tokens, int64_t n_computed);
  // Drops cached prefixes no request holds.
  void reset_prefix_cache();
  // Fraction of blocks referenced by requests, over all groups.
  double usage() const;

 private:
  friend class KvAllocation;
  KvManagerConfig config_;
  std::vector<BlockPool> pools_;

  int64_t blocks_for(int64_t n_tokens) const { return (n_tokens + config_.block_size - 1) / config_.block_size; }
  void free_blocks(std::vector<std::vector<int32_t>>& tables);
};

}  // namespace serval
