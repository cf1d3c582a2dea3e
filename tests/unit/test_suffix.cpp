// Suffix speculation: drafts worked out by hand from the definition (longest match, votes of its
// occurrences, best first above p_min, depth factor x match, width per node), the store of earlier
// outputs (matching, eviction), and the proposer preferring the better-scoring source.
#include <gtest/gtest.h>

#include "engine/suffix.h"

namespace serval {
namespace {

SuffixParams params(float factor = 1.0f, float p_min = 0.1f, int32_t width = 1) {
  SuffixParams p;
  p.factor = factor, p.p_min = p_min, p.width = width;
  return p;
}

using V = std::vector<int32_t>;

// ... 1 2 3 | 9 ... 1 2 3 | 8 ... 1 2 3: two occurrences of the longest match (3 tokens; the tokens
// before them, 5 and 7, differ from the end's 4), one vote each for 9 and for 8.
const V kTwo = {5, 1, 2, 3, 9, 7, 1, 2, 3, 8, 4, 1, 2, 3};

TEST(SuffixDraft, AChainFollowsTheLatestOfEquallyVotedContinuations) {
  const SuffixDraft d = suffix_draft(kTwo, params(), 8);
  EXPECT_EQ(d.match, 3);
  EXPECT_EQ(d.tokens, (V{8, 4, 1})) << "depth 1.0 x 3; 8 came from the later occurrence";
  EXPECT_EQ(d.parents, (V{-1, 0, 1}));
  EXPECT_FLOAT_EQ(d.score, 1.5f) << "three nodes with half the votes each";
  EXPECT_EQ(suffix_draft(kTwo, params(2.0f), 8).tokens, (V{8, 4, 1, 2, 3})) << "depth 6, cut by the text's end";
  EXPECT_EQ(suffix_draft(kTwo, params(), 2).tokens, (V{8, 4})) << "the limit";
  EXPECT_TRUE(suffix_draft(kTwo, params(1.0f, 0.6f), 8).tokens.empty()) << "half the votes is under 0.6";
}

TEST(SuffixDraft, ATreeTakesBothBranchesBestFirst) {
  const SuffixDraft d = suffix_draft(kTwo, params(1.0f, 0.1f, 2), 8);
  EXPECT_EQ(d.tokens, (V{8, 4, 1, 9, 7, 1}));
  EXPECT_EQ(d.parents, (V{-1, 0, 1, -1, 3, 4}));
  EXPECT_FLOAT_EQ(d.score, 3.0f);
  const SuffixDraft cut = suffix_draft(kTwo, params(1.0f, 0.1f, 2), 4);
  EXPECT_EQ(cut.tokens, (V{8, 4, 1, 9}));
  EXPECT_EQ(cut.parents, (V{-1, 0, 1, -1}));
}

TEST(SuffixDraft, VotesDecideAmongOccurrencesOfTheLongestMatchOnly) {
  // "4 2" ends the text; 2 occurs after 4 twice (continued by 6, then 6) and after 1 once (7):
  // the longest match is "4 2" (2 tokens), whose two occurrences both vote 6 then 5.
  const V t = {4, 2, 6, 5, 1, 2, 7, 4, 2, 6, 5, 3, 4, 2};
  const SuffixDraft d = suffix_draft(t, params(), 8);
  EXPECT_EQ(d.match, 2);
  EXPECT_EQ(d.tokens, (V{6, 5}));
  EXPECT_FLOAT_EQ(d.score, 2.0f) << "both occurrences agree";
  // Three occurrences voting 6, 6, 7 for the next token: 7 has a third of the votes.
  const V u = {8, 6, 1, 8, 6, 2, 8, 7, 3, 8};
  EXPECT_EQ(suffix_draft(u, params(1.0f, 0.1f, 2), 8).tokens, (V{6, 7}));
  EXPECT_EQ(suffix_draft(u, params(1.0f, 0.4f, 2), 8).tokens, (V{6})) << "1/3 < 0.4";
}

TEST(SuffixDraft, NothingWithoutARepeat) {
  EXPECT_TRUE(suffix_draft(V{1, 2, 3}, params(), 8).tokens.empty());
  EXPECT_TRUE(suffix_draft(V{7}, params(), 8).tokens.empty());
  EXPECT_TRUE(suffix_draft(V{}, params(), 8).tokens.empty());
  EXPECT_TRUE(suffix_draft(kTwo, params(), 0).tokens.empty());
  SuffixParams shallow = params(4.0f);
  shallow.depth = 1;  // matches count one token at most: 4 x 1 deep
  EXPECT_EQ(suffix_draft(kTwo, shallow, 8).tokens, (V{8, 4, 1, 2}));
}

TEST(SuffixStore, MatchesEarlierOutputsAndForgetsTheOldest) {
  SuffixStore s(2);
  s.add(V{10, 11, 12, 13, 14});
  const SuffixDraft d = s.draft(V{9, 11, 12}, params(), 8);
  EXPECT_EQ(d.match, 2) << "9 differs from the stored 10";
  EXPECT_EQ(d.tokens, (V{13, 14}));
  EXPECT_EQ(s.draft(V{9, 11, 12}, params(), 1).tokens, (V{13}));
  EXPECT_EQ(s.draft(V{10, 11, 12}, params(2.0f), 8).tokens, (V{13, 14})) << "match 3, the document's end";
  EXPECT_TRUE(s.draft(V{11, 13}, params(), 8).tokens.empty()) << "no stored pair 11 13";
  EXPECT_TRUE(s.draft(V{13, 14}, params(), 8).tokens.empty()) << "nothing follows the match";
  s.add(V{20, 11, 12, 15});  // newer: its 15 wins the tie with 13
  EXPECT_EQ(s.draft(V{9, 11, 12}, params(1.0f, 0.1f, 2), 8).tokens, (V{15, 13, 14}));
  s.add(V{30, 31, 32});  // a third document: the first is dropped
  EXPECT_EQ(s.docs(), 2);
  EXPECT_EQ(s.tokens(), 7);
  EXPECT_EQ(s.draft(V{9, 11, 12}, params(1.0f, 0.1f, 2), 8).tokens, (V{15}));
  s.add(V{1, 2});  // too short to hold a pair with a continuation: not kept
  EXPECT_EQ(s.docs(), 2);
  SuffixStore off(0);
  off.add(V{1, 2, 3});
  EXPECT_EQ(off.docs(), 0);
}

TEST(SuffixStore, ManyDocumentsKeepOnlyTheNewest) {
  SuffixStore s(3);
  for (int32_t i = 0; i < 50; ++i) s.add(V{1, 2, 100 + i, 3});
  EXPECT_EQ(s.docs(), 3);
  // The three kept documents vote 147, 148, 149 (then 3 each); the newest wins the tie, and on ties
  // the node made first (the newest document's, then its child) comes first.
  EXPECT_EQ(s.draft(V{0, 1, 2}, params(1.0f, 0.1f, 1), 8).tokens, (V{149, 3}));
  EXPECT_EQ(s.draft(V{0, 1, 2}, params(1.0f, 0.1f, 4), 8).tokens, (V{149, 3, 148, 3, 147, 3}));
  EXPECT_TRUE(s.draft(V{0, 1, 2}, params(1.0f, 0.4f, 4), 8).tokens.empty()) << "a third of the votes each";
}

TEST(SuffixStore, ATokenBudgetDropsTheOldestButNeverTheNewest) {
  SuffixStore s(100, 8);
  s.add(V{1, 2, 3, 4, 5});
  s.add(V{6, 2, 3, 7});  // 9 tokens: the first document goes
  EXPECT_EQ(s.docs(), 1);
  EXPECT_EQ(s.tokens(), 4);
  EXPECT_EQ(s.draft(V{0, 2, 3}, params(), 8).tokens, (V{7}));
  s.add(V{10, 11, 12, 13, 14, 15, 16, 17, 18, 19});  // over the budget alone: kept, the one before goes
  EXPECT_EQ(s.docs(), 1);
  EXPECT_EQ(s.tokens(), 10);
  EXPECT_TRUE(s.draft(V{0, 2, 3}, params(), 8).tokens.empty());
  EXPECT_EQ(s.draft(V{9, 11, 12}, params(), 8).tokens, (V{13, 14}));
}

TEST(SuffixStore, StaleOffsetsAreClearedSoTheIndexStaysNearTheTokensKept) {
  SuffixStore s(1000, 16);
  for (int32_t d = 0; d < 200; ++d) {
    V doc(10);
    for (int32_t i = 0; i < 10; ++i) doc[size_t(i)] = 1000 * d + i;  // every pair new
    s.add(doc);
    ASSERT_LE(s.tokens(), 16);
    // Live pairs plus at most as many stale ones as live tokens, plus the document just added.
    ASSERT_LE(s.index_entries(), 2 * s.tokens() + 10) << "after document " << d;
  }
  EXPECT_EQ(s.draft(V{0, 199001, 199002}, params(), 8).tokens, (V{199003, 199004})) << "the newest still matches";
}

TEST(SuffixProposer, InFrontOfAFallbackOnlyLongMatchesCountFromEitherSource) {
  SpeculativeConfig c;
  c.set_method("suffix+draft");
  c.suffix_factor = 4;
  GenerationParams gp;
  Request done(1, V{50}, gp, nullptr, 0);
  done.tokens.insert(done.tokens.end(), {1, 2, 3, 4, 5, 6, 7, 8});
  const int32_t limits[] = {8};
  for (int32_t min_match : {1, 3}) {
    SuffixProposer p(c, min_match);
    p.finished(done);
    // Its own text matches "7 1 2" (3 tokens: 9 7 1 2, score 4); the store "1 2" (2 tokens: 3 .. 8, score 6).
    Request r(2, V{7, 1, 2, 9, 7, 1, 2}, gp, nullptr, 0);
    Request* rs[] = {&r};
    p.propose(rs, limits);
    if (min_match == 1) EXPECT_EQ(r.draft, (V{3, 4, 5, 6, 7, 8})) << "the store scores higher";
    else EXPECT_EQ(r.draft, (V{9, 7, 1, 2})) << "the store's 2-token match is below the minimum";
    Request shortonly(3, V{2, 9, 1, 2}, gp, nullptr, 0);  // own match 1, store match 2
    Request* ss[] = {&shortonly};
    p.propose(ss, limits);
    EXPECT_EQ(shortonly.draft.empty(), min_match == 3) << "nothing long enough: left to the fallback";
  }
}

TEST(SuffixProposer, TakesTheBetterScoringOfTheRequestAndTheStore) {
  SpeculativeConfig c;
  c.method = SpecMethod::Suffix;
  c.draft_max = 8;
  SuffixProposer p(c);
  GenerationParams gp;
  Request done(1, V{50, 51, 52, 53, 54}, gp, nullptr, 0);  // prompt 5 tokens
  done.tokens.insert(done.tokens.end(), {1, 2, 3, 4, 5, 6});
  p.finished(done);
  EXPECT_EQ(p.store().docs(), 1);
  EXPECT_EQ(p.store().tokens(), 6) << "the output only";
  // The request's own text matches "2" once (followed by 9); the store matches "1 2" (followed by 3 4).
  Request r(2, V{2, 9, 1, 2}, gp, nullptr, 0);
  Request* rs[] = {&r};
  const int32_t limits[] = {8};
  p.propose(rs, limits);
  EXPECT_EQ(r.draft, (V{3, 4})) << "score 2 from the store beats 1 from the request";
  EXPECT_TRUE(r.draft_parents.empty()) << "a chain: no parents";
  Request q(3, V{7, 1, 2, 8, 7, 1, 2}, gp, nullptr, 0);  // its own "7 1 2" (3 tokens, score 3) beats the store's 2
  Request* qs[] = {&q};
  p.propose(qs, limits);
  EXPECT_EQ(q.draft, (V{8, 7, 1}));
}

}  // namespace
}  // namespace serval
