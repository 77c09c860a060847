// DeviceMesh across real processes: coordinates and each dimension's group
// against the row-major layout worked out by hand, collectives over every
// dimension (each rank's sum is the sum over the members the layout
// predicts), sub-meshes, global ranks of sub-groups, and the errors: ranks
// asking for different meshes (named by dimension, on every rank), a shape
// that does not match the world, unknown and repeated names.
#include "distributed/device_mesh.h"

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
using ::testing::HasSubstr;

// Sum of (global rank + 1) over the group's members, by a collective.
double group_sum(ProcessGroup& pg, int global_rank) {
  Tensor t = Tensor::from_vector({double(global_rank + 1)}, {1});
  pg.allreduce(t)->wait();
  return t.to_vector()[0];
}

// Rank r of a 2x2 (dp, tp) mesh lies at (r / 2, r % 2): tp groups are
// {0,1} {2,3}, dp groups {0,2} {1,3}.
EMBER_WORKER(mesh_2x2) {
  mp::init_world(env);
  const int r = env.rank;
  auto mesh = DeviceMesh::create({2, 2}, {"dp", "tp"});
  WCHECK(mesh->to_string() == "DeviceMesh(dp=2, tp=2)", mesh->to_string());
  WCHECK(mesh->size() == 4 && mesh->size("tp") == 2 && mesh->ndim() == 2, mesh->size());
  WCHECK(mesh->coordinate("dp") == r / 2 && mesh->coordinate("tp") == r % 2, "rank ", r);
  WCHECK(mesh->global_rank() == r, mesh->global_rank());
  WCHECK(mesh->rank_at({1, 0}) == 2, mesh->rank_at({1, 0}));
  const std::vector<int> tp_members = {r / 2 * 2, r / 2 * 2 + 1}, dp_members = {r % 2, r % 2 + 2};
  WCHECK(mesh->group("tp")->global_ranks() == tp_members, "tp members");
  WCHECK(mesh->group("dp")->global_ranks() == dp_members, "dp members");
  WCHECK(mesh->group("tp")->rank() == r % 2 && mesh->group("dp")->rank() == r / 2, "group ranks");
  WCHECK(mesh->group("tp")->group_rank_of(tp_members[1]) == 1 && mesh->group("tp")->group_rank_of((r + 2) % 4) == -1,
         "group_rank_of");
  const double tp_sum = tp_members[0] + tp_members[1] + 2, dp_sum = dp_members[0] + dp_members[1] + 2;
  WCHECK(group_sum(*mesh->group("tp"), r) == tp_sum, group_sum(*mesh->group("tp"), r), " vs ", tp_sum);
  WCHECK(group_sum(*mesh->group("dp"), r) == dp_sum, "dp sum");
  // Sub-meshes reuse the groups and keep this rank's other coordinates.
  auto tp = mesh->submesh({"tp"});
  WCHECK(tp->ndim() == 1 && tp->group() == mesh->group("tp") && tp->ranks() == tp_members, tp->to_string());
  auto swapped = mesh->submesh({"tp", "dp"});
  WCHECK(swapped->rank_at({1, 0}) == 1, "swapped rank_at");
  WCHECK(swapped->ranks() == (std::vector<int>{0, 2, 1, 3}), "swapped ranks");
  // Misuse, the same on every rank.
  std::string e = error_of([&] { mesh->group("pp"); });
  WCHECK(e.find("has no dimension 'pp' (its dimensions: 'dp', 'tp')") != std::string::npos, e);
  e = error_of([&] { mesh->group(); });
  WCHECK(e.find("has 2 dimensions: name the one") != std::string::npos, e);
  e = error_of([&] { mesh->submesh({"tp", "tp"}); });
  WCHECK(e.find("dimension 'tp' is named twice") != std::string::npos, e);
  e = error_of([&] { DeviceMesh::create({2, 3}, {"dp", "tp"}); });
  WCHECK(e.find("DeviceMesh(dp=2, tp=3) has 6 ranks but the world has 4") != std::string::npos, e);
  e = error_of([&] { DeviceMesh::create({2, 2}, {"dp", "dp"}); });
  WCHECK(e.find("dimension name 'dp' is used twice") != std::string::npos, e);
  // A 1-D mesh over the whole world is the default group itself.
  auto flat = DeviceMesh::create({4}, {"dp"});
  WCHECK(flat->group() == default_group(), "1-D mesh reuses the world");
  WCHECK(group_sum(*flat->group(), r) == 10, "world sum");
  // A mesh over an existing group: its members, no new group.
  auto over_tp = DeviceMesh::from_group(mesh->group("tp"), "tp");
  WCHECK(over_tp->group() == mesh->group("tp") && over_tp->ranks() == tp_members &&
             over_tp->coordinate("tp") == r % 2 && over_tp->global_rank() == r,
         over_tp->to_string());
  // Three dimensions, one of size 1.
  auto three = DeviceMesh::create({2, 1, 2}, {"pp", "dp", "tp"});
  WCHECK(three->group("dp")->size() == 1 && group_sum(*three->group("dp"), r) == r + 1, "size-1 dimension");
  WCHECK(three->group("pp")->global_ranks() == dp_members, "pp members of 2x1x2");
  default_group()->barrier()->wait();
}

// Rank 1 asks for (dp=1, tp=2), rank 0 for (dp=2, tp=1): both fail naming
// dimension 0, at once rather than at a timeout.
EMBER_WORKER(mesh_mismatch) {
  mp::init_world(env);
  const std::vector<int> shape = env.rank == 0 ? std::vector<int>{2, 1} : std::vector<int>{1, 2};
  const std::string e = error_of([&] { DeviceMesh::create(shape, {"dp", "tp"}); });
  WCHECK(e.find("the ranks disagree on the mesh: dimension 0: rank 1 asked for dp=1, rank 0 for dp=2") !=
             std::string::npos,
         e);
  const std::string b = error_of([&] { DeviceMesh::create({2}, {"dp"}, env.rank == 0 ? "" : "gloo"); });
  WCHECK(b.find("rank 1 asked for backend=gloo, rank 0 for backend=") != std::string::npos, b);
  default_group()->barrier()->wait();
}

TEST(DeviceMesh, TwoByTwoCoordinatesGroupsAndSubmeshes) { EMBER_EXPECT_RANKS("mesh_2x2", 4); }

TEST(DeviceMesh, RanksAskingForDifferentMeshesFailByDimension) { EMBER_EXPECT_RANKS("mesh_mismatch", 2); }

TEST(DeviceMesh, ShapeChecks) {
  EXPECT_THAT(error_of([] { check_mesh_shape({}, {}, 1); }), HasSubstr("the shape is empty"));
  EXPECT_THAT(error_of([] { check_mesh_shape({2, 2}, {"dp"}, 4); }), HasSubstr("2 sizes but 1 dimension names"));
  EXPECT_THAT(error_of([] {
                check_mesh_shape({2, 0}, {"dp", "tp"}, 4);
              }),
              HasSubstr("dimension 'tp' has size 0 in DeviceMesh(dp=2, tp=0)"));
  EXPECT_THAT(error_of([] { check_mesh_shape({4}, {""}, 4); }), HasSubstr("dimension 0 has an empty name"));
  EXPECT_EQ(error_of([] { check_mesh_shape({2, 2, 2}, {"pp", "dp", "tp"}, 8); }), "");
}

}  // namespace
}  // namespace ember::distributed
