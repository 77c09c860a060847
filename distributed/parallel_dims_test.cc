// ParallelDims: "-1" resolved, every error naming the degrees, the mesh's one
// order, the planner's and the log's strings; on 8 real processes the
// meshes build_mesh makes, with each flattened view's ranks against the
// row-major layout worked out by hand and a collective over each view
// summing exactly those ranks.
#include "distributed/parallel_dims.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using ::ember::testing::error_of;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ParallelDims, ResolvesTheRest) {
  ParallelDims d = ParallelDims{.tp = 2}.resolved(8);
  EXPECT_EQ(d.dp_shard, 4);
  EXPECT_EQ(d.dp(), 4);
  EXPECT_EQ(d.world(), 8);
  d = ParallelDims{.pp = 2, .dp_replicate = -1, .dp_shard = 2}.resolved(8);
  EXPECT_EQ(d.dp_replicate, 2);
  EXPECT_TRUE(d.hsdp());
  d = ParallelDims{.dp_shard = 2, .cp = 2, .tp = 2, .ep = 4}.resolved(8);
  EXPECT_EQ(d.dp_shard_cp(), 4);
  EXPECT_EQ(d.dp_cp(), 4);
  EXPECT_EQ(ParallelDims{}.resolved(1).dp_shard, 1);
}

TEST(ParallelDims, ErrorsNameTheDegrees) {
  EXPECT_THAT(error_of([] { ParallelDims{.dp_shard = 3, .tp = 2}.resolved(8); }),
              HasSubstr("ParallelDims: dp_shard=3 x tp=2 does not divide a world of 8"));
  EXPECT_THAT(error_of([] { ParallelDims{.dp_shard = -1, .tp = -1}.resolved(8); }),
              HasSubstr("dp_shard and tp are both -1"));
  EXPECT_THAT(error_of([] { ParallelDims{.dp_shard = 0}.resolved(8); }), HasSubstr("dp_shard=0"));
  EXPECT_THAT(error_of([] { ParallelDims{.dp_shard = 2, .tp = 2}.resolved(8); }),
              HasSubstr("dp_shard=2 x tp=2 makes 4 ranks, not a world of 8"));
  EXPECT_THAT(error_of([] { ParallelDims{.dp_shard = 4, .tp = 2, .ep = 3}.resolved(8); }),
              HasSubstr("ep=3 is borrowed from dp_shard x cp = 4 and must divide it"));
  ParallelDims{.dp_shard = 2, .cp = 2, .tp = 2, .ep = 2}.validate(8);  // ep within dp_shard x cp: fine
  EXPECT_THAT(error_of([] { ParallelDims{.dp_shard = 1, .cp = 4, .tp = 2, .ep = 2}.validate(8); }),
              HasSubstr("ep=2 must be a multiple of cp=4"));
  EXPECT_THAT(error_of([] { ParallelDims{.dp_shard = -1}.validate(8); }), HasSubstr("unresolved"));
}

TEST(ParallelDims, OneOrderAndItsStrings) {
  const ParallelDims d = ParallelDims{.pp = 2, .dp_replicate = 2, .dp_shard = 2, .cp = 2, .tp = 2}.resolved(32);
  EXPECT_THAT(d.mesh_dim_names(), ElementsAre("pp", "dp_replicate", "dp_shard", "cp", "tp"));
  EXPECT_THAT(d.mesh_shape(), ElementsAre(2, 2, 2, 2, 2));
  const ParallelDims flat = ParallelDims{.tp = 2}.resolved(4);
  EXPECT_THAT(flat.mesh_dim_names(), ElementsAre("dp_replicate", "dp_shard", "tp"));
  EXPECT_EQ(flat.str(), "dp_replicate=1 dp_shard=2 tp=2 pp=1");
  EXPECT_EQ(flat.line(), "mesh dp_shard=2 tp=2");
  EXPECT_EQ(ParallelDims{}.resolved(2).line(), "mesh dp_shard=2");
  EXPECT_EQ(ParallelDims{.dp_shard = 1}.resolved(1).line(), "mesh dp_shard=1");
  const ParallelDims pp_tp = ParallelDims{.pp = 2, .dp_shard = 1, .tp = 2}.resolved(4);
  EXPECT_EQ(pp_tp.line(), "mesh pp=2 tp=2");
  EXPECT_EQ(d.str(), "dp_replicate=2 dp_shard=2 tp=2 pp=2 cp=2");
}

// Sum of (global rank + 1) over a group, by a collective.
double group_sum(ProcessGroup& pg) {
  Tensor t = Tensor::from_vector({double(pg.global_rank(pg.rank()) + 1)}, {1});
  pg.allreduce(t)->wait();
  return t.to_vector()[0];
}

void expect_view(const DeviceMesh& mesh, const std::string& name, const std::vector<int>& ranks) {
  auto view = mesh.submesh({name});
  std::string got;
  for (int r : view->ranks()) got += " " + std::to_string(r);
  WCHECK(view == mesh.flattened(name), "view ", name, " is not registered on the mesh");
  WCHECK(view->ranks() == ranks, "view ", name, " of rank ", mesh.global_rank(), " has ranks", got);
  double want = 0;
  for (int r : ranks) want += r + 1;
  WCHECK(group_sum(*view->group()) == want, "view ", name, ": the collective summed other ranks");
}

// The four layouts of 8 ranks, each rank checking its own views. Rank r's
// coordinates are row-major over the mesh's dimensions.
EMBER_WORKER(meshes_of_8) {
  mp::init_world(env);
  const int r = env.rank, t = r % 2;
  {  // pp=2 x dp_shard=2 x tp=2: (pp, dp_replicate=1, dp_shard, tp)
    const auto d = ParallelDims{.pp = 2, .tp = 2}.resolved(8);
    auto mesh = d.build_mesh();
    WCHECK(mesh->to_string() == "DeviceMesh(pp=2, dp_replicate=1, dp_shard=2, tp=2)", mesh->to_string());
    WCHECK(d.dp_rank(*mesh) == r / 2 % 2, d.dp_rank(*mesh));
    expect_view(*mesh, "dp", {r / 4 * 4 + t, r / 4 * 4 + 2 + t});
    WCHECK(d.fsdp_mesh(*mesh)->dim_names() == std::vector<std::string>{"dp_shard"}, "fsdp mesh");
  }
  {  // dp_replicate=2 x dp_shard=2 x tp=2: dp spans 2 dimensions, a group of its own
    const auto d = ParallelDims{.dp_replicate = 2, .tp = 2}.resolved(8);
    auto mesh = d.build_mesh();
    WCHECK(d.dp_rank(*mesh) == r / 2, d.dp_rank(*mesh));
    expect_view(*mesh, "dp", {t, 2 + t, 4 + t, 6 + t});
    WCHECK(d.fsdp_mesh(*mesh)->shape() == (std::vector<int>{2, 2}), "HSDP mesh");
  }
  {  // dp_shard=2 x cp=2 x tp=2 with ep=2: ep is the cp group (in_ep = 1)
    const auto d = ParallelDims{.dp_shard = 2, .cp = 2, .tp = 2, .ep = 2}.resolved(8);
    auto mesh = d.build_mesh();
    WCHECK(mesh->to_string() == "DeviceMesh(dp_replicate=1, dp_shard=2, cp=2, tp=2)", mesh->to_string());
    const int ds = r / 4;
    expect_view(*mesh, "dp_shard_cp", {t, 2 + t, 4 + t, 6 + t});
    expect_view(*mesh, "dp_cp", {t, 2 + t, 4 + t, 6 + t});
    const int c = r / 2 % 2;
    expect_view(*mesh, "dp", {c * 2 + t, 4 + c * 2 + t});
    expect_view(*mesh, "ep", {ds * 4 + t, ds * 4 + 2 + t});
    WCHECK(d.fsdp_mesh(*mesh)->ranks() == (std::vector<int>{t, 2 + t, 4 + t, 6 + t}), "FSDP over dp_shard x cp");
  }
  {  // dp_shard=4 x tp=2 with ep=2: experts over pairs of dp_shard ranks
    const auto d = ParallelDims{.tp = 2, .ep = 2}.resolved(8);
    auto mesh = d.build_mesh();
    const int pair = r / 4;
    expect_view(*mesh, "ep", {pair * 4 + t, pair * 4 + 2 + t});
    expect_view(*mesh, "dp", {t, 2 + t, 4 + t, 6 + t});
  }
}

TEST(ParallelDims, MeshesOfEightRanksAndTheirViews) { EMBER_EXPECT_RANKS("meshes_of_8", 8); }

}  // namespace
}  // namespace ember::distributed
