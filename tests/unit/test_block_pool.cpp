// Block pool and KV manager bookkeeping: exact block ids, reference counts, prefix-cache hits,
// eviction order, sliding-window freeing; the pool is whole again after every scenario.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace serval
