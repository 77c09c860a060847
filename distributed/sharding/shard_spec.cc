// The sharding vocabulary (shard_spec.h): placements, boxes and runs, the
// chunk rule, and the overlap of two regions walked as contiguous stretches.
#include "distributed/sharding/shard_spec.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "core/exception.h"

namespace ember::distributed {

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::Shard:
      return "Shard(" + std::to_string(dim) + (groups > 1 ? ", groups=" + std::to_string(groups) : "") + ")";
    case Kind::Replicate:
      return "Replicate()";
    case Kind::Partial:
      return reduce == Reduce::Sum ? "Partial(sum)" : "Partial(avg)";
  }
  return "?";
}

Placement Shard(int dim, int groups) {
  EMBER_CHECK(groups >= 1, "Shard(", dim, "): groups must be at least 1, got ", groups);
  Placement p;
  p.kind = Placement::Kind::Shard;
  p.dim = dim;
  p.groups = groups;
  return p;
}

Placement Replicate() { return Placement{}; }

Placement Partial(Placement::Reduce reduce) {
  Placement p;
  p.kind = Placement::Kind::Partial;
  p.reduce = reduce;
  return p;
}

std::string placements_string(const std::vector<Placement>& placements) {
  std::string s = "[";
  for (size_t i = 0; i < placements.size(); ++i) s += (i ? ", " : "") + placements[i].to_string();
  return s + "]";
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t l : lengths) n *= l;
  return n;
}

std::string Box::to_string() const {
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < lengths.size(); ++d) os << (d ? ", " : "") << offsets[d] << ":" << offsets[d] + lengths[d];
  os << "]";
  return os.str();
}

Box whole_box(const Shape& shape) { return {Shape(shape.size(), 0), shape}; }

Box intersect(const Box& a, const Box& b) {
  EMBER_INTERNAL_ASSERT(a.lengths.size() == b.lengths.size(), "intersect: boxes of ", a.lengths.size(), " and ",
                        b.lengths.size(), " dimensions");
  Box out;
  for (size_t d = 0; d < a.lengths.size(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d]);
    out.offsets.push_back(lo);
    out.lengths.push_back(std::max<int64_t>(0, hi - lo));
  }
  return out;
}

std::string Region::to_string() const {
  return box.to_string() + " elements " + std::to_string(begin) + ".." + std::to_string(begin + numel);
}

Region whole_region(const Shape& shape) {
  Region r{whole_box(shape), 0, 0};
  r.numel = r.box.numel();
  return r;
}

Region run_region(const Shape& shape, int64_t begin, int64_t numel) {
  if (shape.empty()) return {Box{}, begin, numel};
  int64_t row = 1;
  for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
  Region r{whole_box(shape), 0, numel};
  if (row == 0 || numel == 0) {  // nothing held: an empty box at the run's row
    const int64_t at = row == 0 ? 0 : std::min(begin / row, shape[0]);
    r.box.offsets[0] = at;
    r.box.lengths[0] = 0;
    r.numel = 0;
    return r;
  }
  const int64_t first = begin / row, last = (begin + numel - 1) / row;
  r.box.offsets[0] = first;
  r.box.lengths[0] = last - first + 1;
  r.begin = begin - first * row;
  return r;
}

Region chunk_region(const Shape& shape, const std::vector<int>& mesh_shape, const std::vector<int>& coord,
                    const std::vector<Placement>& placements) {
  EMBER_CHECK(placements.size() == mesh_shape.size() && coord.size() == mesh_shape.size(),
              "chunk_region: ", placements.size(), " placements and a coordinate of ", coord.size(), " for a mesh of ",
              mesh_shape.size(), " dimensions");
  Box box = whole_box(shape);
  for (size_t m = 0; m < placements.size(); ++m) {
    const Placement& p = placements[m];
    if (!p.is_shard()) continue;
    EMBER_CHECK(p.dim >= 0 && p.dim < static_cast<int>(shape.size()), "chunk_region: ", p.to_string(),
                " of a tensor of ", shape.size(), " dimensions");
    const int64_t n = box.lengths[p.dim], k = mesh_shape[m];
    const int64_t chunk = (n + k - 1) / k;  // torch.chunk: the last chunks short or empty
    const int64_t lo = std::min(n, coord[m] * chunk), hi = std::min(n, lo + chunk);
    box.offsets[p.dim] += lo;
    box.lengths[p.dim] = hi - lo;
  }
  Region r{box, 0, 0};
  r.numel = box.numel();
  return r;
}

std::vector<Region> chunk_regions(const Shape& shape, const std::vector<int>& mesh_shape, const std::vector<int>& coord,
                                  const std::vector<Placement>& placements) {
  int gdim = -1, groups = 1;
  for (const Placement& p : placements) {
    if (!p.is_shard() || p.groups == 1) continue;
    EMBER_CHECK(gdim < 0 || (gdim == p.dim && groups == p.groups), "chunk_regions: grouped shards ",
                placements_string(placements), " of more than one dimension or grouping");
    gdim = p.dim;
    groups = p.groups;
  }
  if (gdim < 0) return {chunk_region(shape, mesh_shape, coord, placements)};
  EMBER_CHECK(gdim >= 0 && gdim < static_cast<int>(shape.size()) && shape[gdim] % groups == 0,
              "chunk_regions: ", placements_string(placements), " of a tensor of ", shape_str(shape), ": dimension ",
              gdim, " is not ", groups, " equal blocks");
  // The chunk rule on the stacked view (the dimension split into blocks
  // and their rows), then each block's chunk back in the tensor's terms.
  Shape view = shape;
  view[gdim] = shape[gdim] / groups;
  view.insert(view.begin() + gdim, groups);
  std::vector<Placement> vp = placements;
  for (Placement& p : vp) {
    if (!p.is_shard()) continue;
    EMBER_CHECK(p.dim != gdim || p.groups == groups, "chunk_regions: ", placements_string(placements),
                " shard dimension ", gdim, " both grouped and not");
    if (p.dim >= gdim) p = Shard(p.dim + 1);
  }
  const Box vb = chunk_region(view, mesh_shape, coord, vp).box;
  std::vector<Region> out;
  for (int64_t g = vb.offsets[gdim]; g < vb.offsets[gdim] + vb.lengths[gdim]; ++g) {
    Box b;
    for (size_t d = 0; d < view.size(); ++d) {
      if (static_cast<int>(d) == gdim) continue;
      const bool rows = static_cast<int>(d) == gdim + 1;
      b.offsets.push_back(rows ? g * view[d] + vb.offsets[d] : vb.offsets[d]);
      b.lengths.push_back(vb.lengths[d]);
    }
    Region r{b, 0, 0};
    r.numel = b.numel();
    out.push_back(r);
  }
  return out;
}

int64_t ShardSpec::held_numel() const {
  if (parts.empty()) return region.numel;
  int64_t n = 0;
  for (const Region& r : parts) n += r.numel;
  return n;
}

void check_region(const Shape& shape, const Region& r, const std::string& what) {
  EMBER_CHECK(r.box.offsets.size() == shape.size() && r.box.lengths.size() == shape.size(), what, ": region ",
              r.to_string(), " has ", r.box.lengths.size(), " dimensions, the tensor ", shape.size());
  for (size_t d = 0; d < shape.size(); ++d)
    EMBER_CHECK(r.box.offsets[d] >= 0 && r.box.lengths[d] >= 0 && r.box.offsets[d] + r.box.lengths[d] <= shape[d], what,
                ": region ", r.to_string(), " is outside the tensor's dimension ", d, " (size ", shape[d], ")");
  EMBER_CHECK(r.begin >= 0 && r.numel >= 0 && r.begin + r.numel <= r.box.numel(), what, ": region ", r.to_string(),
              " runs outside its box of ", r.box.numel(), " elements");
}

namespace {

// Walks the elements `a` and `b` share as stretches contiguous in both
// flattenings: fn(index in a's run, index in b's run, length).
template <typename Fn>
void for_each_common_stretch(const Shape& shape, const Region& a, const Region& b, Fn fn) {
  const int n = static_cast<int>(shape.size());
  if (n == 0) {  // a 0-d tensor: one element, held when the run has it
    if (a.begin == 0 && a.numel > 0 && b.begin == 0 && b.numel > 0) fn(0, 0, 1);
    return;
  }
  const Box in = intersect(a.box, b.box);
  if (in.numel() == 0) return;
  // Dimensions after `split` span the whole tensor in both boxes, so a
  // stretch of `split`'s range times everything after it is contiguous in
  // both flattenings.
  int split = n - 1;
  while (split >= 0 && a.box.lengths[split] == shape[split] && b.box.lengths[split] == shape[split]) --split;
  int64_t inner = 1;
  for (int d = std::max(split, 0) + 1; d < n; ++d) inner *= shape[d];
  const int64_t len = split < 0 ? in.numel() : in.lengths[split] * inner;
  // Row-major strides of each box.
  Shape sa(n, 1), sb(n, 1);
  for (int d = n - 2; d >= 0; --d) {
    sa[d] = sa[d + 1] * a.box.lengths[d + 1];
    sb[d] = sb[d + 1] * b.box.lengths[d + 1];
  }
  // Row r of the intersection (its outer dimensions, row-major) starts at
  // ia(r) in a's flattening and ib(r) in b's; both only grow with r. So the
  // rows worth visiting are a contiguous range: from the first that reaches
  // both runs (found by bisection) to the first past either run's end. A
  // region from an untrusted index may name a huge box with a tiny run;
  // the walk costs the rows the runs share, not the box's.
  const int outer_dims = std::max(split, 0);
  int64_t rows = 1;
  for (int d = 0; d < outer_dims; ++d) rows *= in.lengths[d];
  auto starts = [&](int64_t r, int64_t* ia, int64_t* ib) {
    *ia = 0, *ib = 0;
    for (int d = outer_dims - 1; d >= 0; --d) {
      const int64_t cd = r % in.lengths[d];
      r /= in.lengths[d];
      *ia += (in.offsets[d] + cd - a.box.offsets[d]) * sa[d];
      *ib += (in.offsets[d] + cd - b.box.offsets[d]) * sb[d];
    }
    if (split >= 0) {
      *ia += (in.offsets[split] - a.box.offsets[split]) * sa[split];
      *ib += (in.offsets[split] - b.box.offsets[split]) * sb[split];
    }
  };
  int64_t lo = 0, hi = rows;  // first row whose stretch ends past both runs' beginnings
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    int64_t ia = 0, ib = 0;
    starts(mid, &ia, &ib);
    if (ia + len > a.begin && ib + len > b.begin)
      hi = mid;
    else
      lo = mid + 1;
  }
  for (int64_t r = lo; r < rows; ++r) {
    int64_t ia = 0, ib = 0;
    starts(r, &ia, &ib);
    if (ia >= a.begin + a.numel || ib >= b.begin + b.numel) return;  // past a run: so are the rest
    // The part of [0, len) inside both runs.
    const int64_t k0 = std::max<int64_t>({0, a.begin - ia, b.begin - ib});
    const int64_t k1 = std::min<int64_t>({len, a.begin + a.numel - ia, b.begin + b.numel - ib});
    if (k0 < k1) fn(ia + k0 - a.begin, ib + k0 - b.begin, k1 - k0);
  }
}

}  // namespace

int64_t overlap(const Shape& shape, const Region& a, const Region& b) {
  int64_t total = 0;
  for_each_common_stretch(shape, a, b, [&](int64_t, int64_t, int64_t len) { total += len; });
  return total;
}

int64_t copy_overlap(const Shape& shape, const Region& src, const void* src_data, const Region& dst, void* dst_data,
                     size_t element_size) {
  int64_t total = 0;
  const char* s = static_cast<const char*>(src_data);
  char* d = static_cast<char*>(dst_data);
  for_each_common_stretch(shape, src, dst, [&](int64_t is, int64_t id, int64_t len) {
    std::memcpy(d + id * element_size, s + is * element_size, static_cast<size_t>(len) * element_size);
    total += len;
  });
  return total;
}

std::string ShardSpec::to_string() const {
  std::ostringstream os;
  os << placements_string(placements) << " on (";
  for (size_t m = 0; m < mesh_dims.size(); ++m)
    os << (m ? ", " : "") << mesh_dims[m] << "=" << (m < mesh_shape.size() ? mesh_shape[m] : 0);
  os << ") at (";
  for (size_t m = 0; m < coord.size(); ++m) os << (m ? ", " : "") << coord[m];
  os << "): ";
  const std::vector<Region> rs = regions();
  for (size_t i = 0; i < rs.size(); ++i) os << (i ? " + " : "") << rs[i].to_string();
  return os.str();
}

void set_shard_spec(const Tensor& t, std::shared_ptr<const ShardSpec> spec) {
  EMBER_CHECK(t.defined(), "set_shard_spec: undefined tensor");
  if (spec) {
    check_region(spec->global_shape, spec->region, "set_shard_spec");
    for (const Region& r : spec->parts) check_region(spec->global_shape, r, "set_shard_spec");
    EMBER_CHECK(spec->placements.size() == spec->mesh_dims.size() && spec->mesh_shape.size() == spec->mesh_dims.size(),
                "set_shard_spec: ", spec->placements.size(), " placements for a mesh of ", spec->mesh_dims.size(),
                " dimensions (", spec->mesh_shape.size(), " sizes)");
  }
  t.impl().shard_meta = std::move(spec);
}

const ShardSpec* shard_spec(const Tensor& t) {
  if (!t.defined() || !t.impl().shard_meta) return nullptr;
  return dynamic_cast<const ShardSpec*>(t.impl().shard_meta.get());
}

std::shared_ptr<const ShardSpec> shard_spec_ptr(const Tensor& t) {
  if (!t.defined()) return nullptr;
  return std::dynamic_pointer_cast<const ShardSpec>(t.impl().shard_meta);
}

Tensor local_shard(const Tensor& t) {
  const ShardSpec* s = shard_spec(t);
  return s && s->local ? s->local() : t;
}

}  // namespace ember::distributed
