// DTensor on real processes: redistribute between every pair of placements
// (Replicate, Shard(0), Shard(1), Partial(sum)) on a 1-D mesh of 3 ranks
// (sizes that do not divide, and a shard that is empty) and on a 2x2 mesh
// (two mesh dimensions sharding one tensor dimension), forward and
// backward. The reference is the global tensor every rank can compute: a
// layout's local part is its chunk-rule box of it (Partial: addends that
// sum to it), the loss <W, y> of one global weight W has the gradient W
// restricted to the source's box. Also distribute_tensor's broadcast,
// from_local's shape check, grad_placements (Megatron's identity /
// all-reduce pair) and the errors.
#include "distributed/tensor/dtensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using ::ember::testing::error_of;

Tensor pattern(const Shape& shape, double a, double b) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<double> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(std::sin(a * static_cast<double>(i) + b) + 0.1 * b);
  return Tensor::from_vector(v, shape, DType::Float64);
}

Tensor box_of(const Tensor& whole, const Box& box) {
  Tensor t = whole;
  for (size_t d = 0; d < box.offsets.size(); ++d) t = t.narrow(static_cast<int64_t>(d), box.offsets[d], box.lengths[d]);
  return t.contiguous();
}

// This rank's local part of `global` under `placements`: the chunk-rule
// box, and along a Partial dimension an addend (global / k plus noise that
// sums to zero over the dimension's ranks).
Tensor local_of(const Tensor& global, const DeviceMesh& mesh, const std::vector<Placement>& placements) {
  Tensor x = global;
  for (int i = 0; i < mesh.ndim(); ++i) {
    const int k = mesh.shape()[i], c = mesh.coordinate()[i];
    if (placements[i].is_shard()) {
      // Split the current box, not the whole: nested shards split chunks.
      const int d = placements[i].dim;
      const Box cur = chunk_region(x.sizes(), {k}, {c}, {placements[i]}).box;
      x = x.narrow(d, cur.offsets[d], cur.lengths[d]);
    } else if (placements[i].is_partial()) {
      x = x * (1.0 / k) + pattern(x.sizes(), 0.3 + i, 1.0) * (c - (k - 1) / 2.0);
    }
  }
  return x.contiguous();
}

// Every pair of `options` per mesh dimension, for tensors of `shape`.
void all_pairs(const std::shared_ptr<DeviceMesh>& mesh, const Shape& shape) {
  const std::vector<Placement> one = {Replicate(), Shard(0), Shard(1), Partial()};
  std::vector<std::vector<Placement>> layouts = {{}};
  for (int i = 0; i < mesh->ndim(); ++i) {
    std::vector<std::vector<Placement>> next;
    for (const auto& l : layouts)
      for (const Placement& p : one) {
        next.push_back(l);
        next.back().push_back(p);
      }
    layouts = next;
  }
  const Tensor global = pattern(shape, 0.37, 0.5), W = pattern(shape, 0.23, 2.0);
  for (const auto& src : layouts) {
    for (const auto& tgt : layouts) {
      const std::string what = placements_string(src) + " -> " + placements_string(tgt) + " of " + shape_str(shape) +
                               " on " + mesh->to_string();
      Tensor x = local_of(global, *mesh, src).clone().requires_grad_();
      DTensor d = from_local(x, mesh, src, shape);
      DTensor y = d.redistribute(tgt);
      WCHECK(y.placements() == tgt, what);
      bool partial = false;
      for (const Placement& p : tgt) partial = partial || p.is_partial();
      if (partial)
        mp::check_close(y.full_tensor(), global, what + " (full tensor)", 1e-9);
      else
        mp::check_close(y.to_local(), local_of(global, *mesh, tgt), what, 1e-9);
      // The loss <W, y>: each rank weighs its local part by its box of W
      // (a Partial output's addends each by the whole W).
      Tensor w = box_of(W, y.spec()->region.box);
      sum(y.to_local() * w).backward();
      mp::check_close(x.grad(), box_of(W, d.spec()->region.box), what + " gradient", 1e-9);
    }
  }
}

EMBER_WORKER(pairs_1d) {
  mp::init_world(env);
  auto mesh = DeviceMesh::from_group(default_group(), "tp");
  all_pairs(mesh, {5, 7});  // chunks of 2, 2, 1 and 3, 3, 1
  all_pairs(mesh, {2, 7});  // the last shard of dimension 0 is empty
  default_group()->barrier()->wait();
}

EMBER_WORKER(pairs_2d) {
  mp::init_world(env);
  auto mesh = DeviceMesh::create({2, 2}, {"dp", "tp"});
  all_pairs(mesh, {5, 3});  // Shard(0) twice: 5 -> 3, 2 -> 2, 1 | 1, 1
  default_group()->barrier()->wait();
}

TEST(DTensor, RedistributeEveryPairOnThreeRanks) { EMBER_EXPECT_RANKS("pairs_1d", 3); }

TEST(DTensor, RedistributeEveryPairOnATwoByTwoMesh) { EMBER_EXPECT_RANKS("pairs_2d", 4); }

EMBER_WORKER(api) {
  mp::init_world(env);
  const int r = env.rank;
  auto mesh = DeviceMesh::from_group(default_group(), "tp");
  // distribute_tensor: rank 0's values win; the local part is its chunk.
  Tensor mine = pattern({7, 2}, 0.5, r);
  DTensor d = distribute_tensor(mine, mesh, {Shard(0)});
  const Tensor root = pattern({7, 2}, 0.5, 0);
  mp::check_close(d.to_local(), box_of(root, d.spec()->region.box), "distribute_tensor", 1e-9);
  mp::check_close(d.full_tensor(), root, "full_tensor", 1e-9);
  WCHECK(d.to_string() ==
             "DTensor([7,2] [Shard(0)] on DeviceMesh(tp=3), local " + std::string(r == 2 ? "[1,2]" : "[3,2]") + ")",
         d.to_string());
  // src_data_rank -1 keeps each rank's own values.
  DTensor own = distribute_tensor(mine, mesh, {Replicate()}, -1);
  mp::check_close(own.to_local(), mine, "src_data_rank -1", 1e-9);
  // A local part the chunk rule does not give names the rank and shapes.
  const std::string e = error_of([&] { from_local(zeros({3, 2}), mesh, {Shard(0)}, Shape{7, 2}); });
  if (r == 2)
    WCHECK(e.find("rank 2 holds a local tensor of [3,2]") != std::string::npos, e);
  else
    WCHECK(e.empty(), e);
  WCHECK(error_of([&] { d.redistribute({Shard(0), Replicate()}); }).find("2 placements") != std::string::npos, "count");
  WCHECK(
      error_of([&] { d.redistribute({Shard(2)}); }).find("Shard(2) of a tensor of 2 dimensions") != std::string::npos,
      "dim");
  WCHECK(error_of([&] { as_dtensor(zeros({2})); }).find("carries no distributed-tensor spec") != std::string::npos,
         "as_dtensor");
  // Shard(-1) is the last dimension; an annotated tensor is a DTensor again.
  DTensor cols = from_local(zeros({4, 2}), mesh, {Shard(-1)});
  WCHECK(cols.placements()[0] == Shard(1) && cols.shape() == Shape({4, 6}), cols.to_string());
  Tensor annotated = cols.as_annotated_tensor();
  WCHECK(is_dtensor(annotated) && as_dtensor(annotated).shape() == Shape({4, 6}), "annotated");
  // A grouped shard (q, k, v stacked, each split by heads): rank r holds
  // row r of each block of 3, and the gradient comes back to those rows.
  Tensor qkv = pattern({9, 2}, 0.4, 0).requires_grad_();
  DTensor g3 = distribute_tensor(qkv, mesh, {Shard(0, 3)});
  WCHECK(g3.to_local().sizes() == Shape({3, 2}) && g3.spec()->parts.size() == 3 &&
             g3.spec()->parts[2].box.offsets == Shape({6 + r, 0}),
         g3.spec()->to_string());
  for (int b = 0; b < 3; ++b)
    mp::check_close(g3.to_local().narrow(0, b, 1), qkv.detach().narrow(0, 3 * b + r, 1), "grouped local", 1e-9);
  Tensor g3l = g3.to_local().detach().clone().requires_grad_();
  Tensor g3full = from_local(g3l, mesh, {Shard(0, 3)}, Shape{9, 2}).full_tensor();
  mp::check_close(g3full, qkv.detach(), "grouped full_tensor", 1e-9);
  sum(g3full * pattern({9, 2}, 0.1, 3)).backward();
  Tensor gw = pattern({9, 2}, 0.1, 3);
  mp::check_close(g3l.grad(), cat({gw.narrow(0, r, 1), gw.narrow(0, 3 + r, 1), gw.narrow(0, 6 + r, 1)}, 0),
                  "grouped gradient", 1e-9);
  DTensor g2 = distribute_tensor(pattern({6, 2}, 0.4, 0), mesh, {Shard(0, 3)});
  WCHECK(g2.to_local().size(0) == (r == 2 ? 0 : 3), g2.to_string());
  mp::check_close(g2.full_tensor(), pattern({6, 2}, 0.4, 0), "grouped, uneven full_tensor", 1e-9);
  // grad_placements: Replicate -> Replicate with a Partial gradient is the
  // identity forward and an all-reduce backward (Megatron's f); the
  // reverse pair (Partial -> Replicate) all-reduces forward, and its
  // gradient passes through (g).
  Tensor x = pattern({3}, 0.2, 1.0).requires_grad_();
  DTensor f = from_local(x, mesh, {Replicate()}).redistribute({Replicate()}, std::vector<Placement>{Partial()});
  mp::check_close(f.to_local(), pattern({3}, 0.2, 1.0), "f forward", 1e-9);
  sum(f.to_local() * pattern({3}, 0.3, r)).backward();
  Tensor want = pattern({3}, 0.3, 0) + pattern({3}, 0.3, 1) + pattern({3}, 0.3, 2);
  mp::check_close(x.grad(), want, "f backward: the sum of every rank's gradient", 1e-9);
  Tensor p = pattern({3}, 0.2, r).requires_grad_();
  DTensor g = from_local(p, mesh, {Partial()}).redistribute({Replicate()});
  mp::check_close(g.to_local(), pattern({3}, 0.2, 0) + pattern({3}, 0.2, 1) + pattern({3}, 0.2, 2), "g forward", 1e-9);
  sum(g.to_local() * pattern({3}, 0.3, 7)).backward();
  mp::check_close(p.grad(), pattern({3}, 0.3, 7), "g backward: the replicated gradient", 1e-9);
  default_group()->barrier()->wait();
}

TEST(DTensor, DistributeFromLocalGradPlacementsAndErrors) { EMBER_EXPECT_RANKS("api", 3); }

}  // namespace
}  // namespace ember::distributed
