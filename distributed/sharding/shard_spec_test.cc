// The sharding vocabulary against references computed element by element:
// torch.chunk's sizes, nested Shard placements, flat runs as regions, and
// the overlap copy of random regions (boxes and runs in 0-3 dimensions)
// against a walk over every element of the tensor.
#include "distributed/sharding/shard_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/testing/coords.h"
#include "core/testing/error_of.h"

namespace ember::distributed {
namespace {

using ::ember::testing::all_coords;
using ::ember::testing::error_of;
using ::testing::HasSubstr;

// The row-major index within `r`'s run of the element at global `coord`,
// or -1 when `r` does not hold it.
int64_t index_in(const Region& r, const Shape& coord) {
  int64_t flat = 0;
  for (size_t d = 0; d < coord.size(); ++d) {
    const int64_t x = coord[d] - r.box.offsets[d];
    if (x < 0 || x >= r.box.lengths[d]) return -1;
    flat = flat * r.box.lengths[d] + x;
  }
  return flat >= r.begin && flat < r.begin + r.numel ? flat - r.begin : -1;
}

TEST(Placement, Names) {
  EXPECT_EQ(placements_string({Shard(1), Replicate(), Partial()}), "[Shard(1), Replicate(), Partial(sum)]");
  EXPECT_EQ(Partial(Placement::Reduce::Avg).to_string(), "Partial(avg)");
  EXPECT_EQ(Shard(0), Shard(0));
  EXPECT_NE(Shard(0), Shard(1));
  EXPECT_NE(Shard(0), Replicate());
}

// torch.chunk(arange(n), k) sizes: ceil(n / k) each, the last short, the
// ones past the end empty.
TEST(ChunkRegion, TorchChunkSizes) {
  auto lengths = [](int64_t n, int k) {
    std::vector<int64_t> out;
    for (int c = 0; c < k; ++c) out.push_back(chunk_region({n}, {k}, {c}, {Shard(0)}).box.lengths[0]);
    return out;
  };
  EXPECT_EQ(lengths(10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(lengths(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(lengths(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(lengths(8, 2), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(chunk_region({5}, {4}, {3}, {Shard(0)}).box.offsets[0], 5);  // empty, at the end
}

TEST(ChunkRegion, MeshDimensionsInOrder) {
  // Two Shard(0): mesh dimension 0 halves the rows, dimension 1 halves each half.
  Region r = chunk_region({8, 6}, {2, 2}, {1, 1}, {Shard(0), Shard(0)});
  EXPECT_EQ(r.box.to_string(), "[6:8, 0:6]");
  r = chunk_region({8, 6}, {2, 2}, {1, 0}, {Shard(0), Shard(1)});
  EXPECT_EQ(r.box.to_string(), "[4:8, 0:3]");
  EXPECT_EQ(r.begin, 0);
  EXPECT_EQ(r.numel, 12);
  r = chunk_region({8, 6}, {2, 2}, {1, 1}, {Replicate(), Shard(1)});
  EXPECT_EQ(r.box.to_string(), "[0:8, 3:6]");
  EXPECT_THAT(error_of([] { chunk_region({8}, {2}, {0}, {Shard(1)}); }), HasSubstr("Shard(1) of a tensor of 1"));
}

// A flat run as the rows it touches and the run within them, checked
// element by element against the run itself.
TEST(RunRegion, HoldsExactlyTheRun) {
  const Shape shape = {5, 3, 2};
  const int64_t n = 30;
  for (int64_t b = 0; b <= n; ++b)
    for (int64_t len = 0; b + len <= n; ++len) {
      const Region r = run_region(shape, b, len);
      check_region(shape, r, "run_region");
      int64_t flat = 0;
      for (const Shape& c : all_coords(shape)) {
        const int64_t i = index_in(r, c);
        const bool in_run = flat >= b && flat < b + len;
        ASSERT_EQ(i >= 0, in_run) << "begin " << b << " numel " << len << " element " << flat;
        if (in_run) ASSERT_EQ(i, flat - b);
        ++flat;
      }
    }
}

Region random_region(std::mt19937& g, const Shape& shape) {
  Region r;
  for (int64_t s : shape) {
    const int64_t lo = std::uniform_int_distribution<int64_t>(0, s)(g);
    const int64_t hi = std::uniform_int_distribution<int64_t>(lo, s)(g);
    r.box.offsets.push_back(lo);
    r.box.lengths.push_back(hi - lo);
  }
  const int64_t n = r.box.numel();
  r.begin = std::uniform_int_distribution<int64_t>(0, n)(g);
  r.numel = std::uniform_int_distribution<int64_t>(0, n - r.begin)(g);
  // Often the whole box or whole rows, as real layouts are.
  if (g() % 3 == 0) r.begin = 0, r.numel = n;
  return r;
}

TEST(CopyOverlap, RandomRegionsMatchAnElementWalk) {
  std::mt19937 g(7);
  for (int trial = 0; trial < 3000; ++trial) {
    Shape shape;
    const int dims = trial % 4;
    for (int d = 0; d < dims; ++d) shape.push_back(std::uniform_int_distribution<int64_t>(1, 5)(g));
    Region a = random_region(g, shape), b = random_region(g, shape);
    if (trial % 5 == 0) b.box = a.box;  // same layout, different runs
    if (trial % 7 == 0) a.box = whole_box(shape), b.box = whole_box(shape);
    // Values: a's element k is 1000 + k; b starts at -1.
    std::vector<float> va(a.numel), vb(b.numel, -1.f), expect(b.numel, -1.f);
    for (int64_t k = 0; k < a.numel; ++k) va[k] = 1000.f + k;
    int64_t common = 0;
    for (const Shape& c : all_coords(shape)) {
      const int64_t ia = index_in(a, c), ib = index_in(b, c);
      if (ia >= 0 && ib >= 0) {
        expect[ib] = va[ia];
        ++common;
      }
    }
    ASSERT_EQ(overlap(shape, a, b), common) << a.to_string() << " vs " << b.to_string();
    ASSERT_EQ(copy_overlap(shape, a, va.data(), b, vb.data(), sizeof(float)), common);
    ASSERT_EQ(vb, expect) << "shape dims " << dims << ": " << a.to_string() << " -> " << b.to_string();
  }
}

// A region from an untrusted index may name a box of 2^30 rows with a run of
// two elements: the walk costs the rows the runs share, not the box's (this
// test would take minutes otherwise).
TEST(CopyOverlap, HugeBoxesCostTheirRunsNotTheirRows) {
  const int64_t rows = int64_t{1} << 30;
  const Shape shape = {rows, 1, 2};
  const Region a{{{0, 0, 0}, {rows, 1, 2}}, 0, 2};     // elements (0,0,0), (0,0,1)
  const Region b{{{0, 0, 1}, {rows, 1, 1}}, 0, rows};  // column 1 of every row
  EXPECT_EQ(overlap(shape, a, b), 1);
  const Region tail{{{0, 0, 0}, {rows, 1, 2}}, 2 * rows - 2, 2};  // the last row
  EXPECT_EQ(overlap(shape, tail, b), 1);
  const Region b_head{{{0, 0, 1}, {rows, 1, 1}}, 0, 5};  // column 1 of rows 0..4
  EXPECT_EQ(overlap(shape, tail, b_head), 0);
  float src[2] = {7.f, 8.f}, dst = 0.f;
  EXPECT_EQ(copy_overlap(shape, tail, src, Region{{{rows - 1, 0, 1}, {1, 1, 1}}, 0, 1}, &dst, sizeof(float)), 1);
  EXPECT_EQ(dst, 8.f);
}

TEST(ShardSpec, AttachedToTheParameterAndKeptThroughSetData) {
  Tensor p = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(shard_spec(p), nullptr);
  auto spec = std::make_shared<ShardSpec>();
  spec->global_shape = {4, 3};
  spec->mesh_dims = {"dp"};
  spec->mesh_shape = {2};
  spec->coord = {1};
  spec->placements = {Shard(0)};
  spec->region = chunk_region({4, 3}, {2}, {1}, {Shard(0)});
  set_shard_spec(p, spec);
  Tensor alias_handle = p;  // shares the TensorImpl
  ASSERT_NE(shard_spec(alias_handle), nullptr);
  EXPECT_EQ(shard_spec(p)->to_string(), "[Shard(0)] on (dp=2) at (1): [2:4, 0:3] elements 0..6");
  p.set_data(Tensor::from_vector({0, 0, 0, 0, 0, 0}, {2, 3}));
  ASSERT_NE(shard_spec(p), nullptr);           // the parameter object keeps it
  EXPECT_EQ(shard_spec(p.detach()), nullptr);  // a new handle does not
  EXPECT_TRUE(local_shard(p).is_same(p));
  set_shard_spec(p, nullptr);
  EXPECT_EQ(shard_spec(p), nullptr);

  auto bad = std::make_shared<ShardSpec>(*spec);
  bad->region.box.lengths = {3, 3};
  EXPECT_THAT(error_of([&] { set_shard_spec(p, bad); }),
              HasSubstr("region [2:5, 0:3] elements 0..6 is outside the tensor's dimension 0 (size 4)"));
  bad = std::make_shared<ShardSpec>(*spec);
  bad->placements = {};
  EXPECT_THAT(error_of([&] { set_shard_spec(p, bad); }), HasSubstr("0 placements for a mesh of 1 dimensions"));
}

}  // namespace
}  // namespace ember::distributed
