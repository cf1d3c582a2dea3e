// Block pool and KV manager bookkeeping: exact block ids, reference counts, prefix-cache hits,
// eviction order, sliding-window freeing; the pool is whole again after every scenario.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "base/error.h"
#include "kv/block_pool.h"
#include "kv/kv_manager.h"

namespace serval {
namespace {

void expect_whole(const BlockPool& p) {
  EXPECT_EQ(p.n_free(), p.n_blocks()) << "leaked blocks";
  for (int32_t b = 0; b < p.n_blocks(); ++b) EXPECT_EQ(p.ref_count(b), 0) << "block " << b;
}

TEST(BlockPool, AllocatesInOrderAndEvictsLeastRecentlyFreed) {
  BlockPool p(4);
  EXPECT_EQ(p.allocate(), 0);
  EXPECT_EQ(p.allocate(), 1);
  EXPECT_EQ(p.allocate(), 2);
  EXPECT_EQ(p.n_free(), 1);
  p.unref(1);
  p.unref(0);
  EXPECT_EQ(p.free_order(), (std::vector<int32_t>{3, 1, 0}));
  EXPECT_EQ(p.allocate(), 3);
  EXPECT_EQ(p.allocate(), 1);  // freed before 0
  p.unref(2);
  p.unref(3);
  p.unref(1);
  expect_whole(p);
}

TEST(BlockPool, HashesSurviveFreeingUntilEviction) {
  BlockPool p(3);
  const int32_t a = p.allocate(), b = p.allocate();
  EXPECT_TRUE(p.set_hash(a, 111));
  EXPECT_FALSE(p.set_hash(b, 111)) << "a hash belongs to one block";
  EXPECT_TRUE(p.set_hash(b, 222));
  EXPECT_EQ(p.lookup(111), a);
  p.unref(a);
  EXPECT_EQ(p.n_cached_free(), 1);
  EXPECT_EQ(p.lookup(111), a) << "a freed block keeps its cached prefix";
  p.ref(a);  // a cache hit revives it
  EXPECT_EQ(p.ref_count(a), 1);
  EXPECT_EQ(p.n_cached_free(), 0);
  p.ref(a);  // shared by a second request
  EXPECT_EQ(p.ref_count(a), 2);
  p.unref(a);
  p.unref(a);
  p.unref(b);
  EXPECT_EQ(p.free_order(), (std::vector<int32_t>{2, 0, 1}));
  EXPECT_EQ(p.allocate(), 2);
  EXPECT_EQ(p.allocate(), 0);  // evicts hash 111
  EXPECT_FALSE(p.lookup(111).has_value());
  EXPECT_EQ(p.lookup(222), b);
  p.unref(0);
  p.unref(2);
  expect_whole(p);
  p.reset_cache();
  EXPECT_FALSE(p.lookup(222).has_value());
  EXPECT_EQ(p.n_cached_free(), 0);
}

TEST(BlockPool, DoubleFreeIsAnError) {
  BlockPool p(1);
  const int32_t a = p.allocate();
  p.unref(a);
  EXPECT_THROW(p.unref(a), Error);
}

KvManager make_manager(int32_t blocks, int32_t block_size = 4, std::vector<int64_t> windows = {0}) {
  KvManagerConfig c;
  c.block_size = block_size;
  c.blocks_per_group.assign(windows.size(), blocks);
  c.window_per_group = windows;
  return KvManager(c);
}

std::vector<int32_t> iota_tokens(int n, int start = 100) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = start + i;
  return t;
}

TEST(KvManager, PrefixSharingByReferenceCount) {
  KvManager m = make_manager(8);
  const auto prompt = iota_tokens(10);  // blocks [0..3] [4..7] [8, 9]
  EXPECT_EQ(m.find_prefix(prompt).n_tokens, 0);
  KvAllocation a = m.allocate(m.find_prefix(prompt), 10);
  EXPECT_EQ(a.table(0), (std::vector<int32_t>{0, 1, 2}));
  m.commit(a, prompt, 10);  // two full blocks become cacheable
  EXPECT_TRUE(m.pool(0).hash_of(0) && m.pool(0).hash_of(1));
  EXPECT_FALSE(m.pool(0).hash_of(2));
  // A second request with the same first 9 tokens reuses both full blocks.
  auto other = prompt;
  other[9] = 7;
  const PrefixHit hit = m.find_prefix(other);
  EXPECT_EQ(hit.n_tokens, 8);
  EXPECT_EQ(hit.blocks[0], (std::vector<int32_t>{0, 1}));
  KvAllocation b = m.allocate(hit, 10);
  EXPECT_EQ(b.table(0), (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(m.pool(0).ref_count(0), 2);
  EXPECT_EQ(m.pool(0).ref_count(1), 2);
  a.release();
  EXPECT_EQ(m.pool(0).ref_count(0), 1);
  b.release();
  expect_whole(m.pool(0));
  // After both finished, the prefix is still cached in free blocks.
  EXPECT_EQ(m.find_prefix(prompt).n_tokens, 8);
}

TEST(KvManager, AtLeastOneTokenIsComputed) {
  KvManager m = make_manager(8);
  const auto prompt = iota_tokens(8);  // exactly two blocks
  KvAllocation a = m.allocate(m.find_prefix(prompt), 8);
  m.commit(a, prompt, 8);
  a.release();
  EXPECT_EQ(m.find_prefix(prompt).n_tokens, 4) << "the last block is recomputed so logits exist";
  expect_whole(m.pool(0));
}

TEST(KvManager, DifferentPrefixesDoNotCollide) {
  KvManager m = make_manager(8);
  auto p1 = iota_tokens(9), p2 = iota_tokens(9);
  p2[0] = 1;  // same second block, different first block: the hash chain differs
  KvAllocation a = m.allocate(m.find_prefix(p1), 9);
  m.commit(a, p1, 9);
  EXPECT_EQ(m.find_prefix(p2).n_tokens, 0);
  a.release();
  expect_whole(m.pool(0));
}

TEST(KvManager, AskBeforeCommitCountsRevivedBlocks) {
  KvManager m = make_manager(3);
  const auto prompt = iota_tokens(9);
  KvAllocation a = m.allocate(m.find_prefix(prompt), 9);
  m.commit(a, prompt, 9);
  a.release();  // blocks 0, 1 cached and free; 2 free
  const PrefixHit hit = m.find_prefix(prompt);
  ASSERT_EQ(hit.n_tokens, 8);
  EXPECT_TRUE(m.can_allocate(nullptr, &hit, 12));   // 2 revived + 1 new = 3
  EXPECT_FALSE(m.can_allocate(nullptr, &hit, 13));  // would need a 4th
  EXPECT_FALSE(m.can_allocate(nullptr, nullptr, 13));
  EXPECT_TRUE(m.fits_alone(12, 64));
  EXPECT_FALSE(m.fits_alone(13, 64));
  expect_whole(m.pool(0));
}

TEST(KvManager, SlidingWindowGroupFreesBlocksThatLeftTheWindow) {
  // Group 0 global, group 1 with a window of 6 tokens; block size 4.
  KvManager m = make_manager(8, 4, {0, 6});
  const auto tokens = iota_tokens(16);
  KvAllocation a = m.allocate(m.find_prefix(tokens), 16);
  m.commit(a, tokens, 16);
  // Next token (position 16) attends to positions 11..16: blocks 0 and 1 (positions 0..7) are free.
  EXPECT_EQ(a.table(0), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(a.table(1), (std::vector<int32_t>{-1, -1, 2, 3}));
  EXPECT_EQ(m.pool(1).n_free(), 6);
  EXPECT_EQ(m.pool(0).n_free(), 4);
  // A repeat of the prompt can reuse the global blocks and the window's blocks.
  const PrefixHit hit = m.find_prefix(tokens);
  EXPECT_EQ(hit.n_tokens, 12);
  EXPECT_EQ(hit.blocks[1], (std::vector<int32_t>{-1, 1, 2}));  // block 1 is free but still cached
  a.release();
  expect_whole(m.pool(0));
  expect_whole(m.pool(1));
}

// The longest-prefix search as first written (a scan over every candidate length), from the tokens.
PrefixHit reference_prefix(const KvManager& m, std::span<const int32_t> tokens) {
  PrefixHit hit;
  hit.blocks.resize(m.n_groups());
  if (!m.config().prefix_caching || tokens.empty()) return hit;
  const int64_t bs = m.block_size();
  const int64_t max_blocks = int64_t(tokens.size() - 1) / bs;
  std::vector<uint64_t> hashes;
  for (int64_t b = 0; b < max_blocks; ++b) {
    const uint64_t h = KvManager::block_hash(hashes.empty() ? 0 : hashes.back(), tokens.subspan(b * bs, bs));
    if (!m.config().window_per_group[0] && !m.pool(0).lookup(h)) break;
    hashes.push_back(h);
  }
  auto first_needed = [&](int g, int64_t n) {
    const int64_t window = m.config().window_per_group[g];
    return window ? std::max<int64_t>(0, (n * bs - window) / bs) : 0;
  };
  for (int64_t n = int64_t(hashes.size()); n > 0; --n) {
    bool ok = true;
    for (int g = 0; g < m.n_groups() && ok; ++g)
      for (int64_t b = first_needed(g, n); b < n && ok; ++b) ok = m.pool(g).lookup(hashes[b]).has_value();
    if (!ok) continue;
    hit.n_tokens = n * bs;
    hit.hashes.assign(hashes.begin(), hashes.begin() + n);
    for (int g = 0; g < m.n_groups(); ++g)
      for (int64_t b = 0; b < n; ++b) hit.blocks[g].push_back(b < first_needed(g, n) ? -1 : *m.pool(g).lookup(hashes[b]));
    break;
  }
  return hit;
}

void expect_same_hit(const PrefixHit& got, const PrefixHit& want, const std::string& what) {
  EXPECT_EQ(got.n_tokens, want.n_tokens) << what;
  EXPECT_EQ(got.blocks, want.blocks) << what;
  EXPECT_EQ(got.hashes, want.hashes) << what;
}

// Requests come and go, with prefill chunks, decoded tokens and sliding windows: the hashed forms
// (a hash chain extended block by block; lookups from it; commits from it) agree with the direct
// ones and with the first-written search, and each allocation's counters match its tables.
TEST(KvManager, IncrementalHashingAndLookupMatchTheDirectForms) {
  std::mt19937 rng(11);
  for (const auto& windows : std::vector<std::vector<int64_t>>{{0}, {0, 6}, {10, 0}, {0, 9, 5}}) {
    KvManager m = make_manager(48, 4, windows);
    struct Live {
      std::vector<int32_t> tokens;
      std::vector<uint64_t> chain;
      KvAllocation alloc;
      int64_t computed = 0;
    };
    std::vector<Live> live;
    const std::vector<std::vector<int32_t>> bases = {iota_tokens(40), iota_tokens(40, 7), iota_tokens(40, 300)};
    int hits = 0;
    for (int op = 0; op < 3000; ++op) {
      const std::string what = "windows " + std::to_string(windows.size()) + " op " + std::to_string(op);
      const unsigned kind = rng() % 10;
      if (kind < 3 || live.empty()) {  // a new request
        Live r;
        const auto& base = bases[rng() % bases.size()];
        r.tokens.assign(base.begin(), base.begin() + 1 + rng() % base.size());
        for (int k = int(rng() % 3); k > 0; --k) r.tokens.push_back(int32_t(rng() % 5));
        m.hash_blocks(r.tokens, r.chain);
        ASSERT_EQ(int64_t(r.chain.size()), int64_t(r.tokens.size()) / m.block_size());
        const PrefixHit hit = m.find_prefix_hashed(r.chain, int64_t(r.tokens.size()));
        expect_same_hit(hit, reference_prefix(m, r.tokens), what);
        expect_same_hit(m.find_prefix(r.tokens), hit, what);
        hits += hit.n_tokens > 0;
        const int64_t target = std::min<int64_t>(int64_t(r.tokens.size()), hit.n_tokens + 1 + rng() % 8);
        if (!m.can_allocate(nullptr, &hit, target)) continue;
        r.alloc = m.allocate(hit, target);
        r.computed = hit.n_tokens;
        live.push_back(std::move(r));
      } else if (kind < 8) {  // a step: a chunk of the known tokens, or a decoded token
        Live& r = live[rng() % live.size()];
        if (r.computed == int64_t(r.tokens.size())) r.tokens.push_back(int32_t(rng() % 5));
        const int64_t n = std::min<int64_t>(int64_t(r.tokens.size()), r.computed + 1 + rng() % 6);
        if (!m.can_allocate(&r.alloc, nullptr, n)) continue;
        m.grow(r.alloc, n);
        const int64_t registered_before = r.computed / m.block_size();
        r.computed = n;
        if (rng() % 2) {
          m.hash_blocks(r.tokens, r.chain);
          m.commit_hashed(r.alloc, r.chain, n);
        } else {
          m.commit(r.alloc, r.tokens, n);
          m.hash_blocks(r.tokens, r.chain);
        }
        for (int64_t b = registered_before; b < n / m.block_size(); ++b)  // newly full: now cached
          for (int g = 0; g < m.n_groups(); ++g)
            if (r.alloc.table(g)[b] >= 0) {
              EXPECT_TRUE(m.pool(g).lookup(r.chain[b]).has_value()) << what;
            }
      } else {  // finished
        live.erase(live.begin() + rng() % live.size());
      }
      for (const Live& r : live) {
        int64_t held = 0;
        for (int g = 0; g < m.n_groups(); ++g) {
          const auto& t = r.alloc.table(g);
          for (int64_t b = 0; b < int64_t(t.size()); ++b) {
            held += t[b] >= 0;
            if (b < r.alloc.first_live_block(g)) {
              ASSERT_EQ(t[b], -1) << what;
            }
          }
        }
        ASSERT_EQ(r.alloc.blocks_held(), held) << what;
      }
    }
    EXPECT_GT(hits, 100) << "the scenario should exercise the prefix cache";
    live.clear();
    for (int g = 0; g < m.n_groups(); ++g) expect_whole(m.pool(g));
  }
}

TEST(KvManager, SerialsTellAllocationsApart) {
  KvManager m = make_manager(8);
  KvAllocation a = m.allocate(m.find_prefix(iota_tokens(5)), 5);
  KvAllocation b = m.allocate(m.find_prefix(iota_tokens(5, 50)), 5);
  EXPECT_NE(a.serial(), 0u);
  EXPECT_NE(a.serial(), b.serial());
  EXPECT_EQ(a.blocks_held(), 2);
  const uint64_t serial = a.serial();
  KvAllocation moved = std::move(a);
  EXPECT_EQ(moved.serial(), serial);
  EXPECT_EQ(moved.blocks_held(), 2);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): moved-from handles are empty
  EXPECT_EQ(a.serial(), 0u);
  EXPECT_EQ(a.blocks_held(), 0);
  moved.release();
  EXPECT_EQ(moved.serial(), 0u);
  b.release();
  expect_whole(m.pool(0));
}

// Edges found by mutation testing (docs/testing.md): the error of an empty or negative pool, a
// reference taken on a never-used free block, and usage summed over several groups.
TEST(BlockPool, AnEmptyOrNegativePoolIsAClearError) {
  for (int32_t n : {0, -1, -100}) {
    try {
      BlockPool p(n);
      ADD_FAILURE() << n << " blocks were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the KV pool needs at least one block"), std::string::npos) << e.what();
    }
  }
}

TEST(BlockPool, AReferenceTakesEvenAFreshBlockOutOfTheFreeQueue) {
  BlockPool p(3);
  p.ref(1);
  EXPECT_EQ(p.n_free(), 2);
  EXPECT_EQ(p.free_order(), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(p.allocate(), 0);
  EXPECT_EQ(p.allocate(), 2) << "a referenced block must not be handed out";
  p.unref(0);
  p.unref(1);
  p.unref(2);
  expect_whole(p);
}

TEST(KvManager, ABlockSizeOfZeroIsAClearError) {
  for (int32_t bs : {0, -4}) {
    KvManagerConfig c;
    c.block_size = bs;
    c.blocks_per_group = {8};
    try {
      KvManager m(c);
      ADD_FAILURE() << "block size " << bs << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("block size must be positive"), std::string::npos) << e.what();
    }
  }
}

TEST(KvManager, UsageCountsEveryGroup) {
  KvManager m = make_manager(8, 4, {0, 8});  // a full group and a sliding-window group, 8 blocks each
  EXPECT_EQ(m.usage(), 0.0);
  KvAllocation a = m.allocate(m.find_prefix(iota_tokens(10)), 10);  // 3 blocks in each group
  EXPECT_DOUBLE_EQ(m.usage(), (3.0 + 3.0) / (8.0 + 8.0));
  a.release();
  EXPECT_EQ(m.usage(), 0.0);
}

}  // namespace
}  // namespace serval
