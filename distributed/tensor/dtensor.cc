// DTensor (dtensor.h): the specs, the placement conversions as collectives
// on the mesh dimensions' groups, and the autograd wrapper around them.
//
// A conversion runs in two passes over the mesh dimensions that change.
// The first, last dimension to first, undoes shards (all-gather, or an
// all-to-all straight to the new shard); the second, first to last, reduces
// partials and cuts new shards. The order matters when two mesh dimensions
// shard one tensor dimension: the later one splits the earlier one's chunk,
// so it is gathered first and cut last, and a change on the earlier one
// forces the later one to be redone.
#include "distributed/tensor/dtensor.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include "core/autograd_hook.h"
#include "core/exception.h"
#include "core/ops.h"
#include "distributed/comm/functional_collectives.h"

namespace ember::distributed {

namespace {

// torch.chunk: k chunks of ceil(n / k), the last ones short or empty.
int64_t chunk_size(int64_t n, int k) { return (n + k - 1) / k; }
int64_t chunk_len(int64_t n, int k, int i) {
  const int64_t c = chunk_size(n, k), lo = std::min(n, i * c);
  return std::min(n, lo + c) - lo;
}

// Shard(-1) and the like made absolute; an error naming the placement and
// the tensor when it names no dimension of it.
std::vector<Placement> normalized(const std::vector<Placement>& placements, size_t ndim, const DeviceMesh& mesh,
                                  const char* op) {
  EMBER_CHECK(static_cast<int>(placements.size()) == mesh.ndim(), op, ": ", placements.size(), " placements ",
              placements_string(placements), " for ", mesh.to_string(), " (one per mesh dimension)");
  std::vector<Placement> out = placements;
  for (Placement& p : out) {
    if (!p.is_shard()) continue;
    const int n = static_cast<int>(ndim);
    EMBER_CHECK(p.dim >= -n && p.dim < n, op, ": ", p.to_string(), " of a tensor of ", ndim, " dimensions");
    if (p.dim < 0) p.dim += n;
  }
  return out;
}

// The gradient of a Partial is replicated: each addend's gradient is the whole.
std::vector<Placement> partial_as_replicate(std::vector<Placement> p) {
  for (Placement& q : p)
    if (q.is_partial()) q = Replicate();
  return p;
}

ReduceOp reduce_of(const Placement& p) { return p.reduce == Placement::Reduce::Avg ? ReduceOp::Avg : ReduceOp::Sum; }

Tensor pad_to(const Tensor& x, int64_t d, int64_t len) {
  if (x.size(d) == len) return x;
  Shape s = x.sizes();
  s[d] = len - x.size(d);
  return cat({x, zeros(s, x.options())}, d);
}

using functional::detail::blocks_along;  // x's equal blocks, flat: what the collectives take

// A flat tensor of n blocks of `block` shape -> block r, for each r.
std::vector<Tensor> unflatten_blocks(const Tensor& flat, const Shape& block, int n) {
  int64_t numel = 1;
  for (int64_t s : block) numel *= s;
  std::vector<Tensor> out;
  for (int r = 0; r < n; ++r) out.push_back(flat.narrow(0, r * numel, numel).view(block));
  return out;
}

int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t v : s) n *= v;
  return n;
}

// The conversion itself, on local tensors, without autograd.
class Converter {
 public:
  Converter(const DeviceMesh& mesh, const Shape& global) : mesh_(mesh), global_(global) {}

  Tensor run(Tensor x, std::vector<Placement> cur, const std::vector<Placement>& tgt) {
    const int n = mesh_.ndim();
    std::vector<bool> change(n);
    for (int i = 0; i < n; ++i) change[i] = cur[i] != tgt[i];
    // A change on mesh dimension i of a shard of tensor dimension d redoes
    // every later mesh dimension sharding d (it splits i's chunk).
    for (bool grew = true; grew;) {
      grew = false;
      for (int i = 0; i < n; ++i) {
        if (!change[i]) continue;
        for (int d : {cur[i].is_shard() ? cur[i].dim : -1, tgt[i].is_shard() ? tgt[i].dim : -1}) {
          if (d < 0) continue;
          for (int j = i + 1; j < n; ++j)
            if (!change[j] && (cur[j] == Shard(d) || tgt[j] == Shard(d))) change[j] = grew = true;
        }
      }
    }
    for (int i = n - 1; i >= 0; --i) {
      if (!change[i] || !cur[i].is_shard()) continue;
      if (tgt[i].is_shard() && alone(i, cur[i].dim, cur, tgt) && alone(i, tgt[i].dim, cur, tgt)) {
        x = all_to_all(x, i, cur[i].dim, tgt[i].dim);
        cur[i] = tgt[i];
      } else {
        x = all_gather(x, i, cur[i].dim, extent_before(i, cur[i].dim, cur));
        cur[i] = Replicate();
      }
      if (cur[i] == tgt[i]) change[i] = false;
    }
    for (int i = 0; i < n; ++i) {
      if (!change[i]) continue;
      const auto& pg = mesh_.group(i);
      const int me = mesh_.coordinate()[i], k = mesh_.shape()[i];
      if (cur[i].is_partial()) {
        if (tgt[i].is_shard()) {
          x = reduce_scatter(x, i, tgt[i].dim, reduce_of(cur[i]));
          continue;
        }
        x = x.contiguous().clone();
        if (x.numel() > 0) pg->allreduce(x, reduce_of(cur[i]))->wait();
        cur[i] = Replicate();
      }
      if (tgt[i].is_shard()) {  // Replicate -> Shard(d): this rank's chunk
        const int d = tgt[i].dim;
        const int64_t L = x.size(d), c = chunk_size(L, k);
        x = x.narrow(d, std::min(L, me * c), chunk_len(L, k, me));
      } else if (tgt[i].is_partial() && tgt[i].reduce == Placement::Reduce::Sum && me != 0) {
        x = zeros(x.sizes(), x.options());  // the sum over the dimension stays the value
      }
    }
    return x.contiguous();
  }

 private:
  // No other mesh dimension shards tensor dimension d, before or after.
  bool alone(int i, int d, const std::vector<Placement>& cur, const std::vector<Placement>& tgt) const {
    for (int j = 0; j < mesh_.ndim(); ++j)
      if (j != i && (cur[j] == Shard(d) || tgt[j] == Shard(d))) return false;
    return true;
  }
  // The extent of tensor dimension d that mesh dimension i splits: what the
  // earlier mesh dimensions sharding d leave of it at this rank.
  int64_t extent_before(int i, int d, const std::vector<Placement>& cur) const {
    int64_t L = global_[d];
    for (int j = 0; j < i; ++j)
      if (cur[j] == Shard(d)) L = chunk_len(L, mesh_.shape()[j], mesh_.coordinate()[j]);
    return L;
  }

  Tensor all_gather(const Tensor& x, int i, int d, int64_t L) {
    const auto& pg = mesh_.group(i);
    const int k = mesh_.shape()[i];
    const int64_t c = chunk_size(L, k);
    Tensor p = pad_to(x, d, c).contiguous();
    Shape whole = x.sizes();
    whole[d] = L;
    if (p.numel() == 0) return zeros(whole, x.options());
    Tensor flat = Tensor::empty({p.numel() * k}, p.options());
    pg->allgather_into_tensor(flat, p)->wait();
    std::vector<Tensor> parts;
    const std::vector<Tensor> blocks = unflatten_blocks(flat, p.sizes(), k);
    for (int r = 0; r < k; ++r) parts.push_back(blocks[r].narrow(d, 0, chunk_len(L, k, r)));
    return cat(parts, d);
  }

  Tensor reduce_scatter(const Tensor& x, int i, int d, ReduceOp op) {
    const auto& pg = mesh_.group(i);
    const int k = mesh_.shape()[i], me = mesh_.coordinate()[i];
    const int64_t L = x.size(d), c = chunk_size(L, k);
    Shape block = x.sizes();
    block[d] = c;
    Tensor out = zeros(block, x.options());
    if (out.numel() > 0) pg->reduce_scatter_tensor(out, blocks_along(pad_to(x, d, c * k), d, k), op)->wait();
    return out.narrow(d, 0, chunk_len(L, k, me));
  }

  // Shard(a) -> Shard(b) on mesh dimension i when no other mesh dimension
  // shards a or b: pad both to whole chunks, send chunk r of b to rank r,
  // stack what arrives along a, cut the padding.
  Tensor all_to_all(const Tensor& x, int i, int a, int b) {
    const auto& pg = mesh_.group(i);
    const int k = mesh_.shape()[i], me = mesh_.coordinate()[i];
    const int64_t La = global_[a], Lb = global_[b], ca = chunk_size(La, k), cb = chunk_size(Lb, k);
    Tensor p = pad_to(pad_to(x, a, ca), b, cb * k);
    Shape block = p.sizes();
    block[b] = cb;
    Shape result = x.sizes();
    result[a] = La;
    result[b] = chunk_len(Lb, k, me);
    if (numel_of(block) == 0) return zeros(result, x.options());
    Tensor in = blocks_along(p, b, k);
    Tensor out = Tensor::empty({in.numel()}, in.options());
    pg->all_to_all_single(out, in)->wait();
    std::vector<Tensor> parts;
    const std::vector<Tensor> blocks = unflatten_blocks(out, block, k);
    for (int s = 0; s < k; ++s) parts.push_back(blocks[s].narrow(a, 0, chunk_len(La, k, s)));
    return cat(parts, a).narrow(b, 0, result[b]);
  }

  const DeviceMesh& mesh_;
  Shape global_;
};

// Converter::run, with a grouped shard (Shard(d, groups=g)) seen as a
// plain shard of the stacked view: dimension d split into (g, rows), the
// placement Shard(d + 1) of the rows.
Tensor convert(const DeviceMesh& mesh, const Shape& global, const Tensor& x, const std::vector<Placement>& src,
               const std::vector<Placement>& tgt) {
  int gdim = -1, groups = 1;
  for (const auto* ps : {&src, &tgt})
    for (const Placement& p : *ps)
      if (p.is_shard() && p.groups > 1) gdim = p.dim, groups = p.groups;
  if (gdim < 0) return Converter(mesh, global).run(x, src, tgt);
  auto to_view = [&](std::vector<Placement> ps) {
    for (Placement& p : ps) {
      if (!p.is_shard()) continue;
      EMBER_CHECK(p.dim != gdim || p.groups == groups, "DTensor::redistribute: ", placements_string(src), " -> ",
                  placements_string(tgt), ": dimension ", gdim, " is sharded both grouped and not");
      p = Shard(p.dim >= gdim ? p.dim + 1 : p.dim);
    }
    return ps;
  };
  Shape view = global, local = x.sizes();
  view[gdim] /= groups;
  view.insert(view.begin() + gdim, groups);
  local[gdim] /= groups;
  local.insert(local.begin() + gdim, groups);
  Tensor y = Converter(mesh, view).run(x.reshape(local), to_view(src), to_view(tgt));
  Shape merged = y.sizes();
  merged[gdim] *= merged[gdim + 1];
  merged.erase(merged.begin() + gdim + 1);
  return y.reshape(merged);
}

}  // namespace

namespace {
// The local shape a spec's regions make: one box, or the chunks of every
// block of a grouped shard stacked along its dimension.
Shape held_shape(const ShardSpec& spec) {
  Shape s = spec.region.box.lengths;
  for (const Placement& p : spec.placements)
    if (p.is_shard() && p.groups > 1) s[p.dim] *= p.groups;
  return s;
}
}  // namespace

Shape local_shape(const Shape& global_shape, const DeviceMesh& mesh, const std::vector<Placement>& placements) {
  ShardSpec spec;
  spec.placements = normalized(placements, global_shape.size(), mesh, "local_shape");
  spec.region = chunk_regions(global_shape, mesh.shape(), mesh.coordinate(), spec.placements).front();
  return held_shape(spec);
}

void DTensorSpec::reduce_norm_partial(const Tensor& partial, bool max) const {
  // Over each mesh dimension in turn: the sum (or max) over the whole mesh.
  for (int i = 0; i < mesh->ndim(); ++i) {
    const auto& pg = mesh->group(i);
    if (pg->size() == 1) continue;
    Tensor t = partial.to(pg->device()).contiguous();
    pg->allreduce(t, max ? ReduceOp::Max : ReduceOp::Sum)->wait();
    Tensor(partial).copy_(t.to(partial.device()));
  }
}

std::shared_ptr<const DTensorSpec> make_dtensor_spec(const std::shared_ptr<DeviceMesh>& mesh,
                                                     const std::vector<Placement>& placements,
                                                     const Shape& global_shape, const std::string& layout) {
  EMBER_CHECK(mesh != nullptr, "DTensor: null mesh");
  auto spec = std::make_shared<DTensorSpec>();
  spec->mesh = mesh;
  spec->global_shape = global_shape;
  spec->mesh_dims = mesh->dim_names();
  spec->mesh_shape = mesh->shape();
  spec->coord = mesh->coordinate();
  spec->placements = normalized(placements, global_shape.size(), *mesh, "DTensor");
  spec->layout = layout;
  std::vector<Region> regions = chunk_regions(global_shape, spec->mesh_shape, spec->coord, spec->placements);
  spec->region = regions.front();
  if (regions.size() > 1) spec->parts = std::move(regions);
  for (int i = 0; i < mesh->ndim(); ++i)
    if (!spec->placements[i].is_shard() && spec->coord[i] != 0) spec->writes = false;
  return spec;
}

DTensor::DTensor(Tensor local, std::shared_ptr<const DTensorSpec> spec)
    : local_(std::move(local)), spec_(std::move(spec)) {
  EMBER_CHECK(spec_ != nullptr && local_.defined(), "DTensor: an undefined local tensor or spec");
  EMBER_CHECK(local_.sizes() == held_shape(*spec_), "DTensor: rank ", spec_->mesh->global_rank(),
              " holds a local tensor of ", shape_str(local_.sizes()), ", but ", placements_string(spec_->placements),
              " of ", shape_str(spec_->global_shape), " on ", spec_->mesh->to_string(), " give it ",
              shape_str(held_shape(*spec_)));
}

DTensor DTensor::redistribute(const std::vector<Placement>& placements_in,
                              const std::optional<std::vector<Placement>>& grad_placements) const {
  EMBER_CHECK(defined(), "DTensor::redistribute: an undefined DTensor");
  const auto& mesh = spec_->mesh;
  const Shape global = spec_->global_shape;
  const std::vector<Placement> src = spec_->placements;
  const std::vector<Placement> tgt = normalized(placements_in, global.size(), *mesh, "DTensor::redistribute");
  const std::vector<Placement> grad = grad_placements
                                          ? normalized(*grad_placements, global.size(), *mesh, "DTensor::redistribute")
                                          : partial_as_replicate(tgt);
  if (src == tgt && grad == partial_as_replicate(src)) return *this;
  auto out_spec = make_dtensor_spec(mesh, tgt, global, spec_->layout);
  Tensor out = differentiable(
      "redistribute", {local_},
      [&] {
        if (src == tgt) return local_.alias();
        return convert(*mesh, global, local_, src, tgt);
      },
      [&](const Tensor&) {
        const std::vector<Placement> back = partial_as_replicate(src);
        BackwardFn fn = [mesh, global, grad, back](const Tensor& g) {
          DTensor gd(g.contiguous(), make_dtensor_spec(mesh, grad, global));
          return std::vector<Tensor>{gd.redistribute(back).to_local()};
        };
        return Recorded{std::move(fn), {}, true};
      });
  return DTensor(out, out_spec);
}

Tensor DTensor::full_tensor(const std::optional<std::vector<Placement>>& grad_placements) const {
  return redistribute(std::vector<Placement>(spec_->placements.size(), Replicate()), grad_placements).to_local();
}

Tensor DTensor::as_annotated_tensor() const {
  const ShardSpec* have = shard_spec(local_);
  if (have == spec_.get()) return local_;
  EMBER_CHECK(have == nullptr, "DTensor::as_annotated_tensor: the local tensor already carries another spec (",
              have->to_string(), ")");
  set_shard_spec(local_, spec_);
  return local_;
}

std::string DTensor::to_string() const {
  if (!defined()) return "DTensor(undefined)";
  std::ostringstream s;
  s << "DTensor(" << shape_str(shape()) << " " << placements_string(placements()) << " on " << spec_->mesh->to_string()
    << ", local " << shape_str(local_.sizes()) << ")";
  return s.str();
}

DTensor distribute_tensor(const Tensor& tensor, const std::shared_ptr<DeviceMesh>& mesh,
                          const std::vector<Placement>& placements, int src_data_rank) {
  EMBER_CHECK(mesh != nullptr, "distribute_tensor: null mesh");
  EMBER_CHECK(tensor.defined(), "distribute_tensor: undefined tensor");
  auto spec = make_dtensor_spec(mesh, placements, tensor.sizes());
  Tensor value;
  {
    NoGradGuard no_grad;
    value = tensor.detach().contiguous();
    if (src_data_rank != -1) {
      const int root = src_data_rank == -2 ? mesh->ranks().front() : src_data_rank;
      const auto& ranks = mesh->ranks();
      const auto at = std::find(ranks.begin(), ranks.end(), root);
      EMBER_CHECK(at != ranks.end(), "distribute_tensor: src_data_rank ", root, " is not a rank of ",
                  mesh->to_string());
      // Broadcast along each dimension in turn from the root's coordinate:
      // after dimension i, every rank agreeing with the root on the later
      // dimensions holds its value; after the last, every rank does.
      std::vector<int> rc(mesh->ndim());
      for (int64_t idx = at - ranks.begin(), i = mesh->ndim() - 1; i >= 0; --i) {
        rc[i] = static_cast<int>(idx % mesh->shape()[i]);
        idx /= mesh->shape()[i];
      }
      value = value.clone();
      for (int i = 0; i < mesh->ndim(); ++i)
        if (mesh->shape()[i] > 1 && value.numel() > 0) mesh->group(i)->broadcast(value, rc[i])->wait();
    }
    value = convert(*mesh, tensor.sizes(), value, std::vector<Placement>(mesh->ndim(), Replicate()), spec->placements)
                .clone();
  }
  if (tensor.requires_grad()) value.requires_grad_();
  return DTensor(value, spec);
}

DTensor from_local(const Tensor& local, const std::shared_ptr<DeviceMesh>& mesh,
                   const std::vector<Placement>& placements_in, const std::optional<Shape>& global_shape) {
  EMBER_CHECK(mesh != nullptr, "from_local: null mesh");
  EMBER_CHECK(local.defined(), "from_local: undefined local tensor");
  const std::vector<Placement> placements = normalized(placements_in, local.dim(), *mesh, "from_local");
  Shape global = local.sizes();
  if (global_shape) {
    global = *global_shape;
  } else {
    for (int i = 0; i < mesh->ndim(); ++i)
      if (placements[i].is_shard()) global[placements[i].dim] *= mesh->shape()[i];
  }
  return DTensor(local, make_dtensor_spec(mesh, placements, global));
}

bool is_dtensor(const Tensor& t) { return dynamic_cast<const DTensorSpec*>(shard_spec(t)) != nullptr; }

DTensor as_dtensor(const Tensor& t) {
  auto spec = std::dynamic_pointer_cast<const DTensorSpec>(shard_spec_ptr(t));
  EMBER_CHECK(spec != nullptr, "as_dtensor: a tensor of ", shape_str(t.sizes()),
              " carries no distributed-tensor spec (it is not a DTensor's local part)");
  return DTensor(t, spec);
}

}  // namespace ember::distributed
