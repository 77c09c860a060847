// Expert parallelism (expert_parallel.h): the split of the stacked expert
// weights and the all-to-all dispatch installed on each MoE layer.
#include "distributed/parallel/ep/expert_parallel.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/autograd_hook.h"
#include "core/cuda_graph.h"
#include "core/exception.h"
#include "core/ops.h"
#include "distributed/comm/functional_collectives.h"
#include "distributed/tensor/dtensor.h"
#include "nn/moe.h"

namespace ember::distributed {

namespace {

// The padded dispatch (a capacity of C rows per expert): rows [E C, dim] in
// expert order, so rank r's experts are one contiguous block of El C rows;
// even splits. Received as [source q][expert e][C], run as [e][q][C] (each
// local expert's n C rows one batch), sent back in the source's order.
// Every ep rank must pad to the same C (the same tokens per forward), or
// the exchange's splits would not match (a hang, or rows cut short): an
// eager forward checks it every time (an all-gather of C, read on the
// host); a captured one cannot read, and needs no check when its C was
// checked in the warm-up (`agreed`): a replay runs the captured shapes,
// whatever its inputs.
Tensor dispatch_padded(nn::GroupedExperts& ex, const Tensor& rows, int64_t C, const std::shared_ptr<ProcessGroup>& pg,
                       std::set<int64_t>& agreed) {
  const int n = pg->size();
  const int64_t E = ex.num_experts, El = E / n, dim = rows.size(1);
  EMBER_INTERNAL_ASSERT(El * n == E && rows.size(0) == E * C, "expert_parallel: rows ", shape_str(rows.sizes()),
                        " for ", E, " experts of ", C);
  if (cuda_graph_capturing()) {
    EMBER_CHECK(agreed.count(C), "expert_parallel: a capacity of ", C,
                " rows per expert first met inside a CUDA graph capture, where the ep ranks cannot check that they "
                "agree on it; run the same shapes eagerly first (the capture's warm-up steps)");
  } else {
    Tensor mine = Tensor::from_vector({static_cast<double>(C)}, {1}, {DType::Int64, pg->device()});
    Tensor all = Tensor::empty({n}, {DType::Int64, pg->device()});
    pg->allgather_into_tensor(all, mine)->wait();
    const Tensor h = all.cpu().contiguous();
    for (int q = 0; q < n; ++q)
      EMBER_CHECK(h.data<int64_t>()[q] == C, "expert_parallel: ep rank ", q, " pads each expert's tokens to ",
                  h.data<int64_t>()[q], " rows and ep rank ", pg->rank(), " to ", C,
                  ": with a capacity factor every rank of an ep group must route as many tokens per forward "
                  "(the same micro-batch size and sequence length)");
    agreed.insert(C);
  }
  const std::vector<int64_t> splits(static_cast<size_t>(n), El * C);
  const Tensor got = functional::all_to_all_v(rows, splits, splits, pg);
  const Tensor x = got.view({n, El, C, dim}).transpose(0, 1).contiguous().view({El * n * C, dim});
  const Tensor y = ex.padded(x, n * C).view({El, n, C, dim}).transpose(0, 1).contiguous().view({n * El * C, dim});
  return functional::all_to_all_v(y, splits, splits, pg);
}

// The layer's dropless dispatch over `pg` (installed as nn::MoE::dispatch).
Tensor dispatch(nn::GroupedExperts& ex, const Tensor& rows, const std::vector<int64_t>& counts,
                const std::shared_ptr<ProcessGroup>& pg) {
  const int n = pg->size();
  const int64_t E = static_cast<int64_t>(counts.size()), El = E / n;
  // (The weights' own shape is checked inside the experts' call: between
  // calls FSDP may hold them as shards.)
  EMBER_INTERNAL_ASSERT(El * n == E && ex.num_experts == E, "expert_parallel: ", E, " experts over ", n, " ranks");
  // 1. Counts: block r of mine (experts of rank r) to rank r; block q of the
  // result is what rank q sends to each of my experts.
  std::vector<double> mine(counts.begin(), counts.end());
  Tensor send_counts = Tensor::from_vector(mine, {E}, {DType::Int64, pg->device()});
  Tensor recv_counts = Tensor::empty({E}, {DType::Int64, pg->device()});
  pg->all_to_all_single(recv_counts, send_counts)->wait();
  const Tensor rc = recv_counts.cpu();
  const int64_t* from = rc.data<int64_t>();  // from[q El + e]
  std::vector<int64_t> send_splits(n, 0), recv_splits(n, 0), local(El, 0);
  for (int r = 0; r < n; ++r)
    for (int64_t e = 0; e < El; ++e) {
      send_splits[r] += counts[r * El + e];
      recv_splits[r] += from[r * El + e];
      local[e] += from[r * El + e];
    }
  // 2. The tokens, grouped by source rank then expert; reordered to expert
  // then source rank for the grouped GEMM.
  Tensor got = functional::all_to_all_v(rows, recv_splits, send_splits, pg);
  const int64_t R = got.size(0);
  std::vector<double> order, inverse(static_cast<size_t>(R));
  std::vector<int64_t> block_start(static_cast<size_t>(n * El));
  for (int64_t at = 0, q = 0; q < n; ++q)
    for (int64_t e = 0; e < El; ++e) block_start[q * El + e] = at, at += from[q * El + e];
  for (int64_t e = 0; e < El; ++e)
    for (int64_t q = 0; q < n; ++q)
      for (int64_t i = 0; i < from[q * El + e]; ++i) {
        inverse[static_cast<size_t>(block_start[q * El + e] + i)] = static_cast<double>(order.size());
        order.push_back(static_cast<double>(block_start[q * El + e] + i));
      }
  const TensorOptions idx{DType::Int64, rows.device()};
  Tensor x = index_select(got, 0, Tensor::from_vector(order, {R}, idx));
  // 3. The local experts (their weights' gradient divided by ep: set on
  // the module), through its call so a data-parallel wrapper's hooks run.
  Tensor y = ex(x, local);
  // 4. Back to source order, and to the sources.
  y = index_select(y, 0, Tensor::from_vector(inverse, {R}, idx));
  return functional::all_to_all_v(y, send_splits, recv_splits, pg);
}

// The spec of an expert weight split over ep: Shard(0) on the ep mesh; a
// weight tensor parallelism already marked Replicate on tp is described on
// the mesh both were cut from, Shard(0) along ep's dimensions (dp_shard,
// cp: the ep view's ranks in their row-major order) and Replicate along tp.
std::shared_ptr<const DTensorSpec> expert_spec(const Tensor& p, const std::shared_ptr<DeviceMesh>& ep_mesh,
                                               const Shape& global, const std::string& name) {
  const auto* have = dynamic_cast<const DTensorSpec*>(shard_spec(p));
  if (have == nullptr) return make_dtensor_spec(ep_mesh, {Shard(0)}, global, "expert_parallel");
  const auto source = ep_mesh->flattened_from();
  const std::vector<std::string> ep_dims = source ? ep_mesh->flattened_dims() : ep_mesh->dim_names();
  const auto root = source ? source->root() : ep_mesh->root();
  EMBER_CHECK(source != nullptr || have->mesh->root() == root, "expert_parallel: ", name, " is laid out by ",
              have->layout, " (", have->to_string(), ") and the ep view ", ep_mesh->to_string(),
              " is part of dp_shard x cp: expert parallelism over part of it with tensor parallelism is not built; "
              "give ep = dp_shard x cp");
  bool replicated = true;
  for (const Placement& pl : have->placements) replicated = replicated && pl.is_replicate();
  EMBER_CHECK(replicated && have->mesh->root() == root, "expert_parallel: ", name, " is already laid out (",
              have->to_string(), ") on a mesh expert parallelism's ", ep_mesh->to_string(),
              " is not cut from; split the experts over ep before other transforms shard them");
  std::vector<std::string> dims;
  std::vector<Placement> placements;
  for (const std::string& dim : root->dim_names()) {
    const bool in_ep = std::find(ep_dims.begin(), ep_dims.end(), dim) != ep_dims.end();
    if (!in_ep && !have->mesh->has_dim(dim)) continue;
    dims.push_back(dim);
    placements.push_back(in_ep ? Placement(Shard(0)) : Placement(Replicate()));
  }
  return make_dtensor_spec(root->submesh(dims), placements, global, "expert_parallel");
}

}  // namespace

void expert_parallel(nn::Module& model, const std::shared_ptr<DeviceMesh>& ep_mesh) {
  EMBER_CHECK(ep_mesh != nullptr && ep_mesh->ndim() == 1, "expert_parallel: the ep mesh must be 1-D");
  const std::shared_ptr<ProcessGroup> pg = ep_mesh->group();
  const int n = pg->size(), me = pg->rank();
  std::vector<std::pair<std::string, nn::MoE*>> layers;
  for (auto& [name, m] : model.named_modules())
    if (auto* moe = dynamic_cast<nn::MoE*>(m)) layers.emplace_back(name, moe);
  EMBER_CHECK(!layers.empty(), "expert_parallel: the model has no MoE layer (nn::MoE) to split");
  for (auto& [name, moe] : layers) {
    const int64_t E = moe->options.num_experts;
    EMBER_CHECK(E % n == 0, "expert_parallel: ", name.empty() ? "the model" : name, " has ", E,
                " experts, which ep=", n, " does not divide");
    const ShardSpec* have = shard_spec(moe->experts->w1);
    EMBER_CHECK(moe->experts->w1.size(0) == E && (have == nullptr || have->layout != "expert_parallel"),
                "expert_parallel: ", name, " is split already");
  }
  for (auto& [name, moe] : layers) {
    const int64_t El = moe->options.num_experts / n;
    for (Tensor* p : {&moe->experts->w1, &moe->experts->w2, &moe->experts->w3}) {
      // This rank's experts: the ep group's rank-th slice. The ranks
      // holding the same slice (dp_shard_mod_ep, replicas, tp) must have
      // drawn alike: one seed, or FSDP's and tensor parallelism's broadcasts.
      auto spec = expert_spec(*p, ep_mesh, p->sizes(), name + ".experts");
      p->set_data(p->detach().narrow(0, me * El, El).contiguous().clone());
      set_shard_spec(*p, std::move(spec));
    }
    moe->experts->weight_grad_scale = 1.0 / n;
    auto agreed = std::make_shared<std::set<int64_t>>();  // the capacities the ep ranks agreed on
    moe->dispatch = [pg, agreed](nn::GroupedExperts& ex, const Tensor& rows, const nn::ExpertGroups& groups) {
      return groups.capacity >= 0 ? dispatch_padded(ex, rows, groups.capacity, pg, *agreed)
                                  : dispatch(ex, rows, groups.counts, pg);
    };
  }
}

void set_moe_balance_group(nn::Module& model, const std::shared_ptr<ProcessGroup>& pg) {
  EMBER_CHECK(pg != nullptr, "set_moe_balance_group: null process group");
  for (nn::MoE* moe : nn::moe_layers(model))
    moe->balance_sum = [pg](const Tensor& c) {
      Tensor t = c.to(pg->device()).clone();
      pg->allreduce(t)->wait();
      return t;
    };
}

}  // namespace ember::distributed
