// The head-tail layout: positions by hand for cp 2, every position held by
// exactly one rank, every rank the same causal work (the reason for the
// layout, against cp plain slices which are unbalanced), shard and unshard
// inverse (values and gradients), and the named errors.
#include "distributed/parallel/cp/load_balance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "core/ops.h"
#include "core/testing/error_of.h"

namespace ember::distributed::cp {
namespace {

using ember::testing::error_of;

TEST(ContextParallelLayout, PositionsByHandAndBalancedWork) {
  // seq 8, cp 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(positions(8, 2, 0), (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(positions(8, 2, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  for (int c : {1, 2, 3, 4}) {
    const int64_t seq = 2 * c * 5;
    std::vector<int64_t> all;
    std::vector<int64_t> work;
    for (int r = 0; r < c; ++r) {
      const auto p = positions(seq, c, r);
      all.insert(all.end(), p.begin(), p.end());
      // Causal attention: a query at position t sees t + 1 keys.
      work.push_back(std::accumulate(p.begin(), p.end(), int64_t{0}) + static_cast<int64_t>(p.size()));
    }
    std::sort(all.begin(), all.end());
    std::vector<int64_t> want(static_cast<size_t>(seq));
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(all, want) << "cp " << c;
    EXPECT_EQ(*std::min_element(work.begin(), work.end()), *std::max_element(work.begin(), work.end())) << "cp " << c;
  }
  // Plain slices would not be: the last of 4 ranks does 7x the first's work.
  const int64_t first = 5 * 6 / 2 + 5, last = (15 + 16 + 17 + 18 + 19) + 5;
  EXPECT_GT(last, 4 * first);
}

TEST(ContextParallelLayout, ShardAndUnshardAreInverse) {
  manual_seed(1);
  Tensor x = randn({2, 12, 3}).requires_grad_();
  std::vector<Tensor> parts;
  for (int r = 0; r < 3; ++r) {
    parts.push_back(shard(x, 1, 3, r));
    // Each slice holds the rows of its positions.
    const auto p = positions(12, 3, r);
    for (size_t i = 0; i < p.size(); ++i)
      EXPECT_TRUE(allclose(parts[r].narrow(1, static_cast<int64_t>(i), 1), x.narrow(1, p[i], 1), 0, 0));
  }
  Tensor back = unshard(parts, 1, 3);
  EXPECT_TRUE(allclose(back, x, 0, 0));
  Tensor w = randn({2, 12, 3});
  sum(back * w).backward();
  EXPECT_TRUE(allclose(x.grad(), w, 0, 0));  // the permutation's gradient is the permutation back
}

TEST(ContextParallelLayout, NamedErrors) {
  EXPECT_NE(error_of([] { positions(10, 3, 0); }).find("the sequence length 10 must be a multiple of 2 x cp = 6"),
            std::string::npos);
  EXPECT_NE(error_of([] { positions(12, 3, 3); }).find("rank 3 is not in [0, 3)"), std::string::npos);
  EXPECT_NE(error_of([] { shard(zeros({2, 8}), 2, 2, 0); }).find("dim 2 is not a dim of [2,8]"), std::string::npos);
  EXPECT_NE(error_of([] { unshard({zeros({4}), zeros({4})}, 0, 3); }).find("2 slices for cp = 3"), std::string::npos);
  EXPECT_NE(error_of([] {
              unshard({zeros({4}), zeros({6})}, 0, 2);
            }).find("slice 1 is [6], slice 0 [4]"),
            std::string::npos);
}

}  // namespace
}  // namespace ember::distributed::cp
