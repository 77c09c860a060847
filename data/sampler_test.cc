// Sampler semantics: DistributedSampler against PyTorch's rules over world
// sizes 1..5 and dataset sizes divisible or not, with and without drop_last
// and shuffle; reproducibility from (seed, epoch); checkpointable state.
#include "data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/exception.h"
#include "data/random.h"

namespace ember::data {
namespace {

using Indices = std::vector<int64_t>;

std::vector<Indices> all_ranks(int64_t n, int64_t world, bool shuffle, bool drop_last, uint64_t seed, int64_t epoch) {
  std::vector<Indices> out;
  for (int64_t r = 0; r < world; ++r) {
    DistributedSampler s(n, world, r, shuffle, seed, drop_last);
    s.set_epoch(epoch);
    Indices idx = s.indices();
    EXPECT_EQ(static_cast<int64_t>(idx.size()), s.size());
    out.push_back(idx);
  }
  return out;
}

TEST(DistributedSampler, PartitionsOverWorldSizesAndDatasetSizes) {
  for (int64_t world = 1; world <= 5; ++world)
    for (int64_t n : {0, 1, 2, 3, 4, 5, 7, 10, 11, 12, 13, 17, 60, 101})
      for (bool drop_last : {false, true})
        for (bool shuffle : {false, true}) {
          SCOPED_TRACE(testing::Message() << "world " << world << " n " << n << " drop_last " << drop_last
                                          << " shuffle " << shuffle);
          std::vector<Indices> ranks = all_ranks(n, world, shuffle, drop_last, 7, 3);
          const int64_t expect = drop_last ? n / world : (n + world - 1) / world;
          std::map<int64_t, int> seen;
          for (const Indices& r : ranks) {
            ASSERT_EQ(static_cast<int64_t>(r.size()), expect);  // equal counts on every rank
            for (int64_t i : r) {
              ASSERT_GE(i, 0);
              ASSERT_LT(i, n);
              seen[i]++;
            }
          }
          const int64_t total = expect * world;
          if (drop_last) {
            // Disjoint, and only the tail (n % world examples) is left out.
            for (auto& [i, c] : seen) ASSERT_EQ(c, 1) << "index " << i;
            EXPECT_EQ(static_cast<int64_t>(seen.size()), total);
            EXPECT_EQ(n - total, n % world);
          } else {
            // Covering; the padding repeats total - n indices once each
            // (more than once only when n < world).
            EXPECT_EQ(static_cast<int64_t>(seen.size()), n);
            int64_t repeats = 0;
            for (auto& [i, c] : seen) repeats += c - 1;
            EXPECT_EQ(repeats, total - n);
            if (n >= world) {
              for (auto& [i, c] : seen) ASSERT_LE(c, 2);
            }
          }
        }
}

TEST(DistributedSampler, PyTorchLayoutWithoutShuffle) {
  // torch: indices = range(10) + [0, 1] (padding from the start); rank r
  // takes indices[r:12:3].
  std::vector<Indices> ranks = all_ranks(10, 3, false, false, 0, 0);
  EXPECT_EQ(ranks[0], (Indices{0, 3, 6, 9}));
  EXPECT_EQ(ranks[1], (Indices{1, 4, 7, 0}));
  EXPECT_EQ(ranks[2], (Indices{2, 5, 8, 1}));
  ranks = all_ranks(10, 3, false, true, 0, 0);
  EXPECT_EQ(ranks[0], (Indices{0, 3, 6}));
  EXPECT_EQ(ranks[1], (Indices{1, 4, 7}));
  EXPECT_EQ(ranks[2], (Indices{2, 5, 8}));
  // n < world: the list wraps as often as needed.
  ranks = all_ranks(2, 5, false, false, 0, 0);
  EXPECT_EQ(ranks, (std::vector<Indices>{{0}, {1}, {0}, {1}, {0}}));
  EXPECT_EQ(all_ranks(2, 5, false, true, 0, 0), std::vector<Indices>(5));
}

TEST(DistributedSampler, ShuffledPaddingRepeatsThePermutationsStart) {
  RandomSampler perm(10, 5);
  perm.set_epoch(2);
  Indices p = perm.indices();  // the same permutation: seed + epoch
  std::vector<Indices> ranks = all_ranks(10, 4, true, false, 5, 2);
  Indices list(p);
  list.push_back(p[0]);
  list.push_back(p[1]);
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(ranks[r][k], list[r + 4 * k]);
}

TEST(DistributedSampler, EpochsAndSeeds) {
  std::vector<Indices> e0 = all_ranks(100, 3, true, false, 11, 0);
  EXPECT_EQ(e0, all_ranks(100, 3, true, false, 11, 0));  // same seed + epoch: identical
  EXPECT_NE(e0, all_ranks(100, 3, true, false, 11, 1));  // next epoch: another order
  EXPECT_NE(e0, all_ranks(100, 3, true, false, 12, 0));
  // PyTorch seeds with seed + epoch, so these coincide there too.
  EXPECT_EQ(all_ranks(100, 3, true, false, 11, 1), all_ranks(100, 3, true, false, 12, 0));
  // Without shuffle every epoch is the same.
  EXPECT_EQ(all_ranks(100, 3, false, false, 11, 0), all_ranks(100, 3, false, false, 11, 5));
}

TEST(DistributedSampler, StateRoundTripsThroughACheckpoint) {
  DistributedSampler s(50, 2, 1, true, 123);
  s.set_epoch(4);
  SamplerState saved = s.state();
  EXPECT_EQ(saved, (SamplerState{123, 4}));
  DistributedSampler fresh(50, 2, 1, true, 0);
  EXPECT_NE(fresh.indices(), s.indices());
  fresh.load_state(saved);
  EXPECT_EQ(fresh.epoch(), 4);
  EXPECT_EQ(fresh.seed(), 123u);
  EXPECT_EQ(fresh.indices(), s.indices());
}

TEST(DistributedSampler, BadArguments) {
  try {
    DistributedSampler(10, 4, 4);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid rank 4, rank should be in the interval [0, 3]"), std::string::npos);
  }
  EXPECT_THROW(DistributedSampler(10, 0, 0), Error);
  EXPECT_THROW(DistributedSampler(10, 2, -1), Error);
}

TEST(RandomSampler, PermutationPerEpochAndUniform) {
  RandomSampler s(1000, 3);
  Indices a = s.indices();
  Indices sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  s.set_epoch(1);
  EXPECT_NE(s.indices(), a);
  s.set_epoch(0);
  EXPECT_EQ(s.indices(), a);
  // All 6 orders of 3 elements, each about 1/6 of the time.
  std::map<Indices, int> counts;
  RandomSampler three(3, 9);
  for (int64_t e = 0; e < 6000; ++e) {
    three.set_epoch(e);
    counts[three.indices()]++;
  }
  ASSERT_EQ(counts.size(), 6u);
  for (auto& [perm, c] : counts) EXPECT_NEAR(c, 1000, 150);
}

TEST(SequentialSampler, InOrder) {
  SequentialSampler s(4);
  s.set_epoch(3);
  EXPECT_EQ(s.indices(), (Indices{0, 1, 2, 3}));
  EXPECT_EQ(s.size(), 4);
}

TEST(RandomStream, StreamsAreIndependentAndReproducible) {
  RandomStream a(1, StreamKind::Transform, 0, 5), b(1, StreamKind::Transform, 0, 5);
  RandomStream c(1, StreamKind::Transform, 0, 6), d(1, StreamKind::Transform, 1, 5);
  RandomStream e(1, StreamKind::Shuffle, 0, 5), f(2, StreamKind::Transform, 0, 5);
  std::set<uint64_t> firsts;
  for (RandomStream* s : {&c, &d, &e, &f}) firsts.insert(s->next_u64());
  uint64_t x = a.next_u64();
  EXPECT_EQ(x, b.next_u64());
  EXPECT_EQ(firsts.size(), 4u);
  EXPECT_EQ(firsts.count(x), 0u);
  for (int i = 0; i < 1000; ++i) {
    uint64_t v = a.uniform_int(7);
    ASSERT_LT(v, 7u);
    double u = a.uniform01();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

}  // namespace
}  // namespace ember::data
