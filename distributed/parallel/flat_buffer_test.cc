// FlatBuffer: offsets and padding for sizes that do not divide by the world
// size, the pieces of each shard against a brute-force element map, views
// and adopted parameters sharing the buffer, release/restore, and the two
// collectives across 2-4 real processes against values computed locally.
#include "distributed/parallel/flat_buffer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "distributed/comm/backends.h"
#include "distributed/comm/process_group.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;

// 7 + 5 + 1 = 13 elements: divisible by none of 2, 3, 4.
std::vector<std::pair<std::string, Shape>> layout() { return {{"a.weight", {7}}, {"b.weight", {5}}, {"c.bias", {1}}}; }

Tensor iota(int64_t n, double start) {
  std::vector<double> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(start + static_cast<double>(i));
  return Tensor::from_vector(v, {n});
}

TEST(FlatBuffer, OffsetsAndPaddingToTheWorldSize) {
  for (int ws : {1, 2, 3, 4, 5}) {
    FlatBuffer fb(layout(), {DType::Float32}, ws);
    EXPECT_EQ(fb.numel(), 13);
    EXPECT_EQ(fb.padded_numel() % ws, 0) << ws;
    EXPECT_GE(fb.padded_numel(), 13);
    EXPECT_LT(fb.padded_numel() - 13, ws);
    EXPECT_EQ(fb.shard_numel() * ws, fb.padded_numel());
    EXPECT_EQ(fb.entries()[1].offset, 7);
    EXPECT_EQ(fb.entries()[2].offset, 12);
    EXPECT_EQ(*fb.find("c.bias"), 2u);
    EXPECT_FALSE(fb.find("nope").has_value());
    // Every element of every entry lies in exactly one piece of one shard,
    // at the place the layout says; padding in none.
    std::vector<int> owner(static_cast<size_t>(fb.padded_numel()), -1);
    for (int r = 0; r < ws; ++r)
      for (const auto& p : fb.pieces(r)) {
        const FlatEntry& e = fb.entries()[p.entry];
        EXPECT_EQ(e.offset + p.entry_offset, r * fb.shard_numel() + p.shard_offset);
        EXPECT_LE(p.entry_offset + p.numel, e.numel);
        for (int64_t k = 0; k < p.numel; ++k) {
          int& o = owner[static_cast<size_t>(e.offset + p.entry_offset + k)];
          EXPECT_EQ(o, -1) << "element owned twice";
          o = r;
        }
      }
    for (int64_t i = 0; i < fb.padded_numel(); ++i)
      EXPECT_EQ(owner[static_cast<size_t>(i)] >= 0, i < 13) << "world " << ws << " element " << i;
  }
}

TEST(FlatBuffer, ViewsAndAdoptedParametersShareTheBuffer) {
  Tensor w = iota(6, 1).view({2, 3}).requires_grad_();
  Tensor b = iota(2, 10).requires_grad_();
  const TensorImpl* identity = w.impl_ptr().get();
  FlatBuffer fb = FlatBuffer::from_tensors({{"w", w}, {"b", b}}, 3);
  EXPECT_EQ(fb.padded_numel(), 9);
  EXPECT_EQ(fb.flat().to_vector(), std::vector<double>({1, 2, 3, 4, 5, 6, 10, 11, 0}));
  fb.adopt({w, b});
  EXPECT_EQ(w.impl_ptr().get(), identity);
  EXPECT_TRUE(w.shares_storage(fb.flat()) && b.shares_storage(fb.flat()));
  {
    NoGradGuard g;
    Tensor s = fb.shard(1);
    s.fill_(-1);  // elements 3..5: w's second row
  }
  EXPECT_EQ(w.to_vector(), std::vector<double>({1, 2, 3, -1, -1, -1}));
  // Release: the memory goes, the handles stay; restore brings the size back.
  fb.release();
  EXPECT_TRUE(w.storage_freed() && fb.released());
  EXPECT_THROW((void)w.to_vector(), Error);
  fb.restore();
  {
    NoGradGuard g;
    fb.copy_from({ones({2, 3}), ones({2})});
  }
  EXPECT_EQ(w.to_vector(), std::vector<double>(6, 1.0));
  EXPECT_TRUE(w.requires_grad() && w.is_leaf());
}

// A channels-last entry's view has a channels-last tensor's strides over
// its slice (NHWC memory order), beside contiguous entries; values copied
// in land in that order; view_in gives the same layout in another buffer.
TEST(FlatBuffer, ChannelsLastEntriesLayTheirSliceOutNhwc) {
  const Shape w{3, 2, 2, 2};  // [O, C, H, W]
  FlatBuffer fb({{"bias", {3}}, {"conv.weight", w}, {"fc.weight", {2, 4}}}, {DType::Float32}, 1,
                {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast, MemoryFormat::Contiguous});
  EXPECT_EQ(fb.entries()[1].format, MemoryFormat::ChannelsLast);
  const Tensor& v = fb.view(1);
  EXPECT_EQ(v.sizes(), w);
  EXPECT_EQ(v.strides(), Tensor::empty(w, {}, MemoryFormat::ChannelsLast).strides());
  EXPECT_EQ(v.storage_offset(), 3);
  EXPECT_TRUE(v.shares_storage(fb.flat()));
  Tensor value = iota(24, 0).view(w);  // element (o, c, h, k) = ((o*2 + c)*2 + h)*2 + k
  fb.copy_from({zeros({3}), value, zeros({2, 4})});
  const std::vector<double> flat = fb.flat().to_vector();
  for (int64_t o = 0; o < 3; ++o)
    for (int64_t c = 0; c < 2; ++c)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t k = 0; k < 2; ++k)  // NHWC: ((o*H + h)*W + k)*C + c
          EXPECT_EQ(flat[static_cast<size_t>(3 + ((o * 2 + h) * 2 + k) * 2 + c)], ((o * 2 + c) * 2 + h) * 2 + k);
  EXPECT_EQ(v.to_vector(), value.to_vector());
  Tensor other = zeros({fb.padded_numel()});
  Tensor ov = fb.view_in(other, 1);
  EXPECT_EQ(ov.strides(), v.strides());
  EXPECT_TRUE(ov.shares_storage(other));
  EXPECT_EQ(fb.view_in(other, 2).sizes(), (Shape{2, 4}));
}

TEST(FlatBuffer, ErrorsNameTheEntry) {
  auto expect_error = [](auto&& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "expected an error containing " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([] { FlatBuffer({{"x", {2}}, {"x", {3}}}, {DType::Float32}); }, "'x' appears twice");
  expect_error([] { FlatBuffer({{"x", {2}}}, {DType::Float32}, 0); }, "world_size");
  expect_error(
      [] {
        FlatBuffer::from_tensors({{"x", zeros({2})}, {"y", zeros({2}, DType::Float64)}});
      },
      "'y' is float64");
  FlatBuffer fb(layout(), {DType::Float32}, 2);
  expect_error([&] { fb.copy_from({zeros({7}), zeros({4}), zeros({1})}); }, "'b.weight' has shape [5]");
  expect_error([&] { (void)fb.shard(2); }, "rank 2 out of range");
  expect_error(
      [] {
        FlatBuffer({{"w", {2, 2, 1, 1}}}, {DType::Float32}, 2, {MemoryFormat::ChannelsLast});
      },
      "'w' is channels-last in a buffer sharded 2 ways");
  expect_error(
      [] {
        FlatBuffer({{"b", {2}}}, {DType::Float32}, 1, {MemoryFormat::ChannelsLast});
      },
      "'b' [2] cannot be channels-last");
  expect_error(
      [] {
        FlatBuffer({{"b", {2}}}, {DType::Float32}, 1, {MemoryFormat::Contiguous, MemoryFormat::Contiguous});
      },
      "2 formats for 1 entries");
  expect_error([&] { (void)fb.view_in(zeros({3}), 0); }, "view_in: buffer [3] is not laid out as this one");
}

// Rank r's shard holds r*100 + its flat index; after all_gather every rank
// holds the whole buffer. Then every rank fills the whole buffer with
// (rank+1) * index and reduce_scatter averages into its shard.
EMBER_WORKER(flat_collectives) {
  auto pg = make_gloo_group(env.store(), env.rank, env.world_size);
  const int ws = env.world_size, rank = env.rank;
  FlatBuffer fb(layout(), {DType::Float32}, ws);
  const int64_t n = fb.shard_numel();
  // Gathering in place: this rank's shard is the input.
  {
    NoGradGuard g;
    Tensor mine = fb.shard(rank);
    mine.copy_(iota(n, rank * n) + 100.0 * rank);
  }
  fb.all_gather(*pg, fb.shard(rank))->wait();
  std::vector<double> got = fb.flat().to_vector();
  for (int64_t i = 0; i < fb.padded_numel(); ++i)
    WCHECK(got[i] == static_cast<double>(i + 100 * (i / n)), "rank ", rank, " element ", i, " = ", got[i]);
  // Into a separate local shard too.
  Tensor local = iota(n, 0);
  fb.all_gather(*pg, local)->wait();
  got = fb.flat().to_vector();
  for (int64_t i = 0; i < fb.padded_numel(); ++i) WCHECK(got[i] == static_cast<double>(i % n), "element ", i);
  {
    NoGradGuard g;
    Tensor flat = fb.flat();
    flat.copy_(iota(fb.padded_numel(), 0) * static_cast<double>(rank + 1));
  }
  Tensor out = zeros({n});
  fb.reduce_scatter(*pg, out, ReduceOp::Avg)->wait();
  const double mean_factor = (ws + 1) / 2.0;
  std::vector<double> o = out.to_vector();
  for (int64_t k = 0; k < n; ++k)
    WCHECK(std::abs(o[k] - mean_factor * static_cast<double>(rank * n + k)) < 1e-4, "rank ", rank, " k ", k, " ", o[k]);
  // A layout for another world size is refused, naming both.
  bool refused = false;
  try {
    FlatBuffer other(layout(), {DType::Float32}, ws + 1);
    other.all_gather(*pg, other.shard(0));
  } catch (const Error& e) {
    refused = std::string(e.what()).find("laid out for") != std::string::npos;
  }
  WCHECK(refused, "a layout for another world size was not refused");
}

TEST(FlatBuffer, GatherAndReduceScatterAcrossRanks) {
  for (int ws : {2, 3, 4}) {
    EMBER_EXPECT_RANKS("flat_collectives", ws);
  }
}

}  // namespace
}  // namespace ember::distributed
