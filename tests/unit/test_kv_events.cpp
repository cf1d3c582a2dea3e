// KV cache events: replaying them must rebuild the prefix-cache index of group 0 exactly, after every
// operation of a random workload (shared prefixes, evictions, windows, resets); every BlockStored's
// hashes follow from its parent and tokens by the chain hash.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "kv/kv_manager.h"

namespace serval {
namespace {

// A router's view: the hashes announced and not yet removed.
struct Replayed {
  std::set<uint64_t> hashes;
  int64_t stored_events = 0, removed_events = 0, cleared = 0;

  void apply(const std::vector<KvEvent>& events, int32_t block_size) {
    for (const auto& e : events) switch (e.kind) {
        case KvEvent::Kind::BlockStored: {
          ++stored_events;
          ASSERT_EQ(e.token_ids.size(), e.block_hashes.size() * size_t(block_size));
          uint64_t parent = e.parent_hash.value_or(0);
          for (size_t i = 0; i < e.block_hashes.size(); ++i) {
            const std::span<const int32_t> toks(e.token_ids.data() + i * block_size, size_t(block_size));
            ASSERT_EQ(e.block_hashes[i], KvManager::block_hash(parent, toks)) << "hash " << i << " of a stored run";
            ASSERT_TRUE(hashes.insert(e.block_hashes[i]).second) << "stored twice without a removal";
            parent = e.block_hashes[i];
          }
          break;
        }
        case KvEvent::Kind::BlockRemoved:
          ++removed_events;
          for (uint64_t h : e.block_hashes) ASSERT_EQ(hashes.erase(h), 1u) << "removed a hash never stored";
          break;
        case KvEvent::Kind::AllBlocksCleared:
          ++cleared;
          hashes.clear();
          break;
      }
  }
};

std::set<uint64_t> index_of(const KvManager& m) {
  const auto v = m.pool(0).cached_hashes();
  return {v.begin(), v.end()};
}

TEST(KvEvents, OffByDefault) {
  KvManager m({4, {8}, {}, true});
  std::vector<int32_t> toks = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto a = m.allocate(m.find_prefix(toks), 9);
  m.commit(a, toks, 9);
  EXPECT_TRUE(m.take_events().empty());
}

TEST(KvEvents, StoredRunsCarryParentAndTokens) {
  KvManager m({2, {8}, {}, true});
  m.enable_events();
  std::vector<int32_t> toks = {5, 6, 7, 8, 9, 10, 11};
  auto a = m.allocate(m.find_prefix(toks), 7);
  m.commit(a, toks, 3);  // one full block
  auto ev = m.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_FALSE(ev[0].parent_hash.has_value());
  EXPECT_EQ(ev[0].token_ids, (std::vector<int32_t>{5, 6}));
  const uint64_t first = ev[0].block_hashes[0];
  m.commit(a, toks, 7);  // two more, in one event after the first
  ev = m.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].parent_hash, first);
  EXPECT_EQ(ev[0].block_hashes.size(), 2u);
  EXPECT_EQ(ev[0].token_ids, (std::vector<int32_t>{7, 8, 9, 10}));
  EXPECT_TRUE(m.take_events().empty()) << "taken events are gone";
  std::vector<int32_t> other = {5, 6, 1, 1, 1};  // shares the first block only
  auto b = m.allocate(m.find_prefix(other), 5);
  m.commit(b, other, 5);
  m.commit(a, toks, 7);
  ev = m.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].parent_hash, first);
  EXPECT_EQ(ev[0].token_ids, (std::vector<int32_t>{1, 1})) << "the shared block is not stored again";
  b.release();
  a.release();
  m.reset_prefix_cache();
  const auto cleared = m.take_events();
  ASSERT_EQ(cleared.size(), 1u);
  EXPECT_EQ(cleared[0].kind, KvEvent::Kind::AllBlocksCleared);
}

// Random requests over a small pool (so blocks are evicted), with prompts drawn from a few shared
// prefixes; commit_hashed as the engine calls it. After every operation the replayed events equal
// the index.
void random_workload(std::vector<int32_t> blocks_per_group, std::vector<int64_t> windows, uint32_t seed) {
  const int32_t bs = 4;
  KvManager m({bs, blocks_per_group, windows, true});
  m.enable_events();
  Replayed r;
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prefixes(3);
  for (auto& p : prefixes)
    for (int i = 0; i < 12; ++i) p.push_back(int32_t(rng() % 50));
  struct Live {
    KvAllocation alloc;
    std::vector<int32_t> tokens;
    std::vector<uint64_t> chain;
    int64_t computed = 0;
  };
  std::vector<Live> live;
  auto check_index = [&](const char* what, int step) {
    r.apply(m.take_events(), bs);
    ASSERT_EQ(r.hashes, index_of(m)) << what << " at step " << step;
  };
  for (int step = 0; step < 600; ++step) {
    const uint32_t op = rng() % 10;
    if (op < 4) {  // a new request
      std::vector<int32_t> toks = prefixes[rng() % prefixes.size()];
      toks.resize(size_t(4 + rng() % 12));
      for (int i = 0, n = int(rng() % 10); i < n; ++i) toks.push_back(int32_t(rng() % 50));
      const PrefixHit hit = m.find_prefix(toks);
      if (!m.can_allocate(nullptr, &hit, int64_t(toks.size()))) continue;
      Live l{m.allocate(hit, int64_t(toks.size())), toks, {}, hit.n_tokens};
      live.push_back(std::move(l));
      check_index("allocate", step);
    } else if (op < 8 && !live.empty()) {  // compute some tokens, maybe generate one
      Live& l = live[rng() % live.size()];
      if (l.computed == int64_t(l.tokens.size())) {  // a generated token: its block first
        if (!m.can_allocate(&l.alloc, nullptr, int64_t(l.tokens.size()) + 1)) continue;
        m.grow(l.alloc, int64_t(l.tokens.size()) + 1);
        l.tokens.push_back(int32_t(rng() % 50));
      }
      l.computed = std::min<int64_t>(int64_t(l.tokens.size()), l.computed + 1 + rng() % 6);
      m.hash_blocks(l.tokens, l.chain);
      m.commit_hashed(l.alloc, l.chain, l.computed, l.tokens);
      check_index("commit", step);
    } else if (op < 9 && !live.empty()) {  // a request ends
      live.erase(live.begin() + rng() % live.size());
      check_index("release", step);
    } else {
      m.reset_prefix_cache();
      check_index("reset", step);
    }
  }
  live.clear();
  m.reset_prefix_cache();
  check_index("final reset", 0);
  EXPECT_GT(r.stored_events, 20);
  EXPECT_GT(r.removed_events, 5) << "the pool is small enough to evict";
  EXPECT_GT(r.cleared, 0);
}

TEST(KvEvents, ReplayEqualsTheIndex) {
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    SCOPED_TRACE(seed);
    random_workload({12}, {0}, seed);
  }
}

TEST(KvEvents, ReplayEqualsTheIndexWithAWindowedGroup) {
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    random_workload({12, 12}, {0, 6}, seed);
  }
}

}  // namespace
}  // namespace serval
