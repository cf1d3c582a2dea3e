#include "kv/kv_manager.h"

#include <xxhash.h>

#include <algorithm>

#include "base/error.h"

namespace serval {

KvAllocation::KvAllocation(KvAllocation&& o) noexcept { *this = std::move(o); }

KvAllocation& KvAllocation::operator=(KvAllocation&& o) noexcept {
  if (this != &o) {
    release();
    manager_ = o.manager_;
    tables_ = std::move(o.tables_);
    window_begin_ = std::move(o.window_begin_);
    n_held_ = o.n_held_;
    serial_ = o.serial_;
    n_registered_ = o.n_registered_;
    last_hash_ = o.last_hash_;
    o.manager_ = nullptr;
    o.tables_.clear();
    o.window_begin_.clear();
    o.n_held_ = 0;
    o.serial_ = 0;
    o.n_registered_ = 0;
    o.last_hash_ = 0;
  }
  return *this;
}

KvAllocation::~KvAllocation() { release(); }

void KvAllocation::release() {
  if (manager_) manager_->free_blocks(tables_);
  manager_ = nullptr;
  tables_.clear();
  window_begin_.clear();
  n_held_ = 0;
  serial_ = 0;
  n_registered_ = 0;
  last_hash_ = 0;
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

void KvManager::hash_blocks(std::span<const int32_t> tokens, std::vector<uint64_t>& chain, uint64_t salt) const {
  if (!config_.prefix_caching) return;
  const int64_t bs = config_.block_size;
  for (int64_t b = int64_t(chain.size()); (b + 1) * bs <= int64_t(tokens.size()); ++b)
    chain.push_back(block_hash(chain.empty() ? salt : chain.back(), tokens.subspan(b * bs, bs)));
}

PrefixHit KvManager::find_prefix(std::span<const int32_t> tokens) const {
  if (!config_.prefix_caching || tokens.empty()) return find_prefix_hashed({}, int64_t(tokens.size()));
  const int64_t bs = config_.block_size;
  const int64_t max_blocks = int64_t(tokens.size() - 1) / bs;  // keep at least one token to compute
  // Hash chain of the prompt's full blocks, cut at the first block group 0 does not hold.
  std::vector<uint64_t> hashes;
  for (int64_t b = 0; b < max_blocks; ++b) {
    const uint64_t h = block_hash(hashes.empty() ? 0 : hashes.back(), tokens.subspan(b * bs, bs));
    if (!config_.window_per_group[0] && !pools_[0].lookup(h)) break;
    hashes.push_back(h);
  }
  return find_prefix_hashed(hashes, int64_t(tokens.size()));
}

PrefixHit KvManager::find_prefix_hashed(std::span<const uint64_t> chain, int64_t n_tokens) const {
  PrefixHit hit;
  hit.blocks.resize(n_groups());
  if (!config_.prefix_caching || n_tokens <= 0) return hit;
  const int64_t bs = config_.block_size;
  // Keep at least one token to compute; cut at the first block group 0 does not hold (without a window).
  int64_t n_max = std::min<int64_t>((n_tokens - 1) / bs, int64_t(chain.size()));
  if (!config_.window_per_group[0])
    for (int64_t b = 0; b < n_max; ++b)
      if (!pools_[0].lookup(chain[b])) n_max = b;
  if (n_max == 0) return hit;
  // Per group, the cached block of each hash (-1: none) and the running count of misses, so that the
  // blocks a prefix of n blocks needs (all of them, or for a windowed group those in its window) are
  // checked in O(1) per n.
  std::vector<std::vector<int32_t>> found(n_groups(), std::vector<int32_t>(n_max));
  std::vector<std::vector<int32_t>> misses(n_groups(), std::vector<int32_t>(n_max + 1, 0));
  for (int g = 0; g < n_groups(); ++g)
    for (int64_t b = 0; b < n_max; ++b) {
      const auto block = pools_[g].lookup(chain[b]);
      found[g][b] = block ? *block : -1;
      misses[g][b + 1] = misses[g][b] + !block;
    }
  auto first_needed = [&](int g, int64_t n) {
    const int64_t window = config_.window_per_group[g];
    return window ? std::max<int64_t>(0, (n * bs - window) / bs) : 0;
  };
  for (int64_t n = n_max; n > 0; --n) {
    bool ok = true;
    for (int g = 0; g < n_groups() && ok; ++g) ok = misses[g][n] == misses[g][first_needed(g, n)];
    if (!ok) continue;
    hit.n_tokens = n * bs;
    hit.hashes.assign(chain.begin(), chain.begin() + n);
    for (int g = 0; g < n_groups(); ++g) {
      const int64_t first = first_needed(g, n);
      for (int64_t b = 0; b < n; ++b) hit.blocks[g].push_back(b < first ? -1 : found[g][b]);
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
  a.serial_ = next_serial_++;
  a.tables_.resize(n_groups());
  a.window_begin_.assign(n_groups(), 0);
  a.n_registered_ = int64_t(hit.hashes.size());
  a.last_hash_ = hit.hashes.empty() ? 0 : hit.hashes.back();
  for (int g = 0; g < n_groups(); ++g)
    for (int32_t b : hit.blocks[g]) {
      if (b >= 0) pools_[g].ref(b), ++a.n_held_;
      a.tables_[g].push_back(b);
    }
  grow(a, n_tokens);
  return a;
}

void KvManager::grow(KvAllocation& a, int64_t n_tokens) {
  check(a.manager_ == this, "internal: allocation belongs to another KV manager");
  for (int g = 0; g < n_groups(); ++g)
    while (int64_t(a.tables_[g].size()) < blocks_for(n_tokens)) a.tables_[g].push_back(pools_[g].allocate()), ++a.n_held_;
}

void KvManager::register_block(KvAllocation& a, uint64_t h, std::span<const int32_t> tokens) {
  const int64_t b = a.n_registered_++;
  const uint64_t parent = a.last_hash_;
  a.last_hash_ = h;
  for (int g = 0; g < n_groups(); ++g) {
    if (a.tables_[g][b] < 0) continue;
    const bool added = pools_[g].set_hash(a.tables_[g][b], h);
    if (g == 0 && added && events_on_) record_stored(parent, b == 0, h, tokens);
  }
}

void KvManager::record_stored(uint64_t parent, bool first, uint64_t h, std::span<const int32_t> tokens) {
  // A block continuing the last stored run joins it (one event per run of a sequence's blocks).
  KvEvent* last = events_.empty() ? nullptr : &events_.back();
  if (!first && last && last->kind == KvEvent::Kind::BlockStored && last->block_hashes.back() == parent) {
    last->block_hashes.push_back(h);
  } else {
    events_.push_back({KvEvent::Kind::BlockStored, {h}, first ? std::nullopt : std::optional(parent), {}});
    last = &events_.back();
  }
  last->token_ids.insert(last->token_ids.end(), tokens.begin(), tokens.end());
}

void KvManager::record_removed(uint64_t h) {
  if (events_.empty() || events_.back().kind != KvEvent::Kind::BlockRemoved)
    events_.push_back({KvEvent::Kind::BlockRemoved, {}, std::nullopt, {}});
  events_.back().block_hashes.push_back(h);
}

void KvManager::enable_events() {
  events_on_ = true;
  pools_[0].set_on_drop([this](uint64_t h) { record_removed(h); });
}

std::vector<KvEvent> KvManager::take_events() {
  std::vector<KvEvent> out;
  out.swap(events_);
  return out;
}

void KvManager::commit(KvAllocation& a, std::span<const int32_t> tokens, int64_t n_computed) {
  const int64_t bs = config_.block_size;
  if (config_.prefix_caching)
    while ((a.n_registered_ + 1) * bs <= n_computed)
      register_block(a, block_hash(a.last_hash_, tokens.subspan(a.n_registered_ * bs, bs)),
                     tokens.subspan(a.n_registered_ * bs, bs));
  free_window_blocks(a, n_computed);
}

void KvManager::commit_hashed(KvAllocation& a, std::span<const uint64_t> chain, int64_t n_computed,
                              std::span<const int32_t> tokens) {
  const int64_t bs = config_.block_size;
  if (config_.prefix_caching) {
    check(int64_t(chain.size()) >= n_computed / bs, "internal: the hash chain is shorter than the computed tokens");
    while ((a.n_registered_ + 1) * bs <= n_computed) {
      const int64_t b = a.n_registered_;
      const auto block_tokens = int64_t(tokens.size()) >= (b + 1) * bs ? tokens.subspan(b * bs, bs) : std::span<const int32_t>{};
      register_block(a, chain[b], block_tokens);
    }
  }
  free_window_blocks(a, n_computed);
}

void KvManager::free_window_blocks(KvAllocation& a, int64_t n_computed) {
  const int64_t bs = config_.block_size;
  for (int g = 0; g < n_groups(); ++g) {
    const int64_t window = config_.window_per_group[g];
    if (!window) continue;
    // Future tokens (positions >= n_computed) attend to positions >= n_computed - window + 1.
    const int64_t first_needed = std::max<int64_t>(0, n_computed - window + 1);
    auto& table = a.tables_[g];
    int64_t b = a.window_begin_[g];  // blocks before it are already free
    for (; (b + 1) * bs <= first_needed && b < int64_t(table.size()); ++b) {
      if (table[b] < 0) continue;
      pools_[g].unref(table[b]);
      table[b] = -1;
      --a.n_held_;
    }
    a.window_begin_[g] = b;
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
  const size_t mark = events_.size();
  for (auto& p : pools_) p.reset_cache();
  if (events_on_ && pools_[0].cached_hashes().empty()) {
    events_.resize(mark);  // the removals the reset just recorded
    events_.push_back({KvEvent::Kind::AllBlocksCleared, {}, std::nullopt, {}});
  }
}

double KvManager::usage() const {
  int64_t used = 0, total = 0;
  for (const auto& p : pools_) used += p.n_blocks() - p.n_free(), total += p.n_blocks();
  return total ? double(used) / double(total) : 0.0;
}

}  // namespace serval
