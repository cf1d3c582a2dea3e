#include "kv/kv_manager.h"

#include <xxhash.h>

#include <algorithm>

#include "base/error.h"

namespace serval {

KvAllocation::KvAllocation(KvAllocation&& o) noexcept
    : manager_(o.manager_), tables_(std::move(o.tables_)), hashes_(std::move(o.hashes_)) {
  o.manager_ = nullptr;
}

KvAllocation& KvAllocation::operator=(KvAllocation&& o) noexcept {
  if (this != &o) {
    release();
    manager_ = o.manager_;
    tables_ = std::move(o.tables_);
    hashes_ = std::move(o.hashes_);
    o.manager_ = nullptr;
  }
  return *this;
}

KvAllocation::~KvAllocation() { release(); }

void KvAllocation::release() {
  if (manager_) manager_->free_blocks(tables_);
  manager_ = nullptr;
  tables_.clear();
  hashes_.clear();
}

KvManager::KvManager(KvManagerConfig config) : config_(std::move(config)) {
  check(config_.block_size > 0, "block size must be positive");
  check(!config_.blocks_per_group.empty(), "KV manager needs at least one group");
  config_.window_per_group.resize(config_.blocks_per_group.size(), 0);
  for (int32_t n : config_.blocks_per_group) pools_.emplace_back(n);
}

uint64_t KvManager::block_hash(uint64_t parent, std::span<const int32_t> tokens) {
  return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), parent ^ 0x5e7a1b10c4u);
}

PrefixHit KvManager::find_prefix(std::span<const int32_t> tokens) const {
  PrefixHit hit;
  hit.blocks.resize(n_groups());
  if (!config_.prefix_caching || tokens.empty()) return hit;
  const int64_t bs = config_.block_size;
  const int64_t max_blocks = int64_t(tokens.size() - 1) / bs;  // keep at least one token to compute
  // Hash chain of the prompt's full blocks, cut at the first block group 0 does not hold.
  std::vector<uint64_t> hashes;
  for (int64_t b = 0; b < max_blocks; ++b) {
    const uint64_t h = block_hash(hashes.empty() ? 0 : hashes.back(), tokens.subspan(b * bs, bs));
    if (!config_.window_per_group[0] && !pools_[0].lookup(h)) break;
    hashes.push_back(h);
  }
  // The longest prefix every group can serve: all blocks, or for a windowed group those in its window.
  for (int64_t n = int64_t(hashes.size()); n > 0; --n) {
    bool ok = true;
    for (int g = 0; g < n_groups() && ok; ++g) {
      const int64_t window = config_.window_per_group[g];
      const int64_t first = window ? std::max<int64_t>(0, (n * bs - window) / bs) : 0;
      for (int64_t b = first; b < n && ok; ++b) ok = pools_[g].lookup(hashes[b]).has_value();
    }
    if (!ok) continue;
    hit.n_tokens = n * bs;
    hit.hashes.assign(hashes.begin(), hashes.begin() + n);
    for (int g = 0; g < n_groups(); ++g) {
      const int64_t window = config_.window_per_group[g];
      const int64_t first = window ? std::max<int64_t>(0, (n * bs - window) / bs) : 0;
      for (int64_t b = 0; b < n; ++b) hit.blocks[g].push_back(b < first ? -1 : *pools_[g].lookup(hashes[b]));
    }
    break;
  }
  return hit;
}

bool KvManager::can_allocate(const KvAllocation* alloc, const PrefixHit* hit, int64_t n_tokens) const {
  for (int g = 0; g < n_groups(); ++g) {
    int64_t have = 0, revived = 0;
    if (alloc && !alloc->empty()) have = int64_t(alloc->table(g).size());
    if (hit) {
      have = int64_t(hit->blocks[g].size());
      for (int32_t b : hit->blocks[g])
        if (b >= 0 && pools_[g].ref_count(b) == 0) ++revived;  // a free cached block leaves the free queue
    }
    const int64_t needed = std::max<int64_t>(0, blocks_for(n_tokens) - have) + revived;
    if (needed > pools_[g].n_free()) return false;
  }
  return true;
}

bool KvManager::fits_alone(int64_t n_tokens, int64_t max_chunk) const {
  for (int g = 0; g < n_groups(); ++g) {
    const int64_t window = config_.window_per_group[g];
    int64_t needed = blocks_for(n_tokens);
    if (window) needed = std::min(needed, blocks_for(window + max_chunk) + 1);
    if (needed > pools_[g].n_blocks()) return false;
  }
  return true;
}

KvAllocation KvManager::allocate(const PrefixHit& hit, int64_t n_tokens) {
  KvAllocation a;
  a.manager_ = this;
  a.tables_.resize(n_groups());
  a.hashes_ = hit.hashes;
  for (int g = 0; g < n_groups(); ++g)
    for (int32_t b : hit.blocks[g]) {
      if (b >= 0) pools_[g].ref(b);
      a.tables_[g].push_back(b);
    }
  grow(a, n_tokens);
  return a;
}

void KvManager::grow(KvAllocation& a, int64_t n_tokens) {
  check(a.manager_ == this, "internal: allocation belongs to another KV manager");
  for (int g = 0; g < n_groups(); ++g)
    while (int64_t(a.tables_[g].size()) < blocks_for(n_tokens)) a.tables_[g].push_back(pools_[g].allocate());
}

void KvManager::commit(KvAllocation& a, std::span<const int32_t> tokens, int64_t n_computed) {
  const int64_t bs = config_.block_size;
  if (config_.prefix_caching) {
    for (int64_t b = int64_t(a.hashes_.size()); (b + 1) * bs <= n_computed; ++b) {
      const uint64_t h = block_hash(a.hashes_.empty() ? 0 : a.hashes_.back(), tokens.subspan(b * bs, bs));
      a.hashes_.push_back(h);
      for (int g = 0; g < n_groups(); ++g)
        if (a.tables_[g][b] >= 0) pools_[g].set_hash(a.tables_[g][b], h);
    }
  }
  for (int g = 0; g < n_groups(); ++g) {
    const int64_t window = config_.window_per_group[g];
    if (!window) continue;
    // Future tokens (positions >= n_computed) attend to positions >= n_computed - window + 1.
    const int64_t first_needed = std::max<int64_t>(0, n_computed - window + 1);
    for (int64_t b = 0; (b + 1) * bs <= first_needed && b < int64_t(a.tables_[g].size()); ++b) {
      if (a.tables_[g][b] < 0) continue;
      pools_[g].unref(a.tables_[g][b]);
      a.tables_[g][b] = -1;
    }
  }
}

void KvManager::free_blocks(std::vector<std::vector<int32_t>>& tables) {
  // Last blocks first: a sequence's tail is the least likely to be shared, so it is evicted first.
  for (int g = 0; g < int(tables.size()); ++g)
    for (auto it = tables[g].rbegin(); it != tables[g].rend(); ++it)
      if (*it >= 0) pools_[g].unref(*it);
  tables.clear();
}

void KvManager::reset_prefix_cache() {
  for (auto& p : pools_) p.reset_cache();
}

double KvManager::usage() const {
  int64_t used = 0, total = 0;
  for (const auto& p : pools_) used += p.n_blocks() - p.n_free(), total += p.n_blocks();
  return total ? double(used) / double(total) : 0.0;
}

}  // namespace serval
