// DeviceMesh (device_mesh.h): the agreement on the mesh, one process group
// per slice of each dimension, coordinates and sub-meshes.
#include "distributed/device_mesh.h"

#include <algorithm>
#include <cstdint>
#include <sstream>

#include "core/exception.h"
#include "distributed/comm/object_collectives.h"
#include "distributed/init.h"

namespace ember::distributed {

namespace {

std::string describe(const std::vector<int>& shape, const std::vector<std::string>& names) {
  std::ostringstream os;
  os << "DeviceMesh(";
  for (size_t d = 0; d < shape.size(); ++d)
    os << (d ? ", " : "") << (d < names.size() ? names[d] : "?") << "=" << shape[d];
  os << ")";
  return os.str();
}

// What ranks compare: one line per dimension, then the backend.
std::string encode(const std::vector<int>& shape, const std::vector<std::string>& names, const std::string& backend) {
  std::string s;
  for (size_t d = 0; d < std::max(shape.size(), names.size()); ++d)
    s += (d < names.size() ? names[d] : "") + "=" + (d < shape.size() ? std::to_string(shape[d]) : "") + "\n";
  return s + "backend=" + backend;
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// "dimension 1 ('dp'): rank 3 asked for dp=4, rank 0 for dp=2".
std::string first_difference(const std::string& mine, const std::string& theirs, int rank) {
  const auto a = lines(mine), b = lines(theirs);
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string x = i < a.size() ? a[i] : "(none)", y = i < b.size() ? b[i] : "(none)";
    if (x == y) continue;
    if (x.rfind("backend=", 0) == 0 || y.rfind("backend=", 0) == 0)
      return "rank " + std::to_string(rank) + " asked for " + (x.rfind("backend=", 0) == 0 ? x : "more dimensions") +
             ", rank 0 for " + (y.rfind("backend=", 0) == 0 ? y : "more dimensions");
    return "dimension " + std::to_string(i) + ": rank " + std::to_string(rank) + " asked for " + x + ", rank 0 for " +
           y;
  }
  return "";
}

}  // namespace

void check_mesh_shape(const std::vector<int>& shape, const std::vector<std::string>& names, int world_size) {
  const std::string what = describe(shape, names);
  EMBER_CHECK(!shape.empty(), "DeviceMesh: the shape is empty (a mesh has at least one dimension)");
  EMBER_CHECK(names.size() == shape.size(), "DeviceMesh: ", shape.size(), " sizes but ", names.size(),
              " dimension names");
  int64_t product = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    EMBER_CHECK(!names[d].empty(), "DeviceMesh: dimension ", d, " has an empty name in ", what);
    EMBER_CHECK(shape[d] >= 1, "DeviceMesh: dimension '", names[d], "' has size ", shape[d], " in ", what,
                " (sizes are >= 1)");
    for (size_t e = 0; e < d; ++e)
      EMBER_CHECK(names[e] != names[d], "DeviceMesh: dimension name '", names[d], "' is used twice in ", what);
    product *= shape[d];
  }
  EMBER_CHECK(product == world_size, "DeviceMesh: ", what, " has ", product, " ranks but the world has ", world_size);
}

std::shared_ptr<DeviceMesh> DeviceMesh::create(const std::vector<int>& shape, const std::vector<std::string>& names,
                                               const std::string& backend) {
  EMBER_CHECK(is_initialized(), "DeviceMesh: init_process_group() has not run");
  std::shared_ptr<ProcessGroup> world = default_group();
  // First agree, then validate: a rank that threw on its own shape while
  // the others waited in a collective would turn a typo into a timeout.
  const std::string mine = encode(shape, names, backend);
  const std::vector<std::string> all = allgather_strings(*world, mine);
  for (int r = 1; r < world->size(); ++r)
    EMBER_CHECK(all[r] == all[0], "DeviceMesh: the ranks disagree on the mesh: ", first_difference(all[r], all[0], r),
                " (every rank must create the same mesh)");
  check_mesh_shape(shape, names, world->size());

  auto mesh = std::shared_ptr<DeviceMesh>(new DeviceMesh());
  mesh->shape_ = shape;
  mesh->names_ = names;
  mesh->global_rank_ = world->rank();
  for (int r = 0; r < world->size(); ++r) mesh->ranks_.push_back(r);
  mesh->coord_ = mesh->coordinate_of(world->rank());
  // One group per slice, every rank calling new_group for every slice in
  // the same order (as new_group requires); a rank keeps its own slices'.
  // A dimension spanning the whole world uses the default group itself.
  mesh->groups_.resize(shape.size());
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    if (shape[d] == world->size() && (backend.empty() || backend == world->backend_name())) {
      mesh->groups_[d] = world;
      continue;
    }
    std::vector<int> c(shape.size(), 0);
    const int slices = world->size() / shape[d];
    for (int s = 0; s < slices; ++s) {
      // The s-th combination of the other dimensions, row-major.
      for (int e = static_cast<int>(shape.size()) - 1, rest = s; e >= 0; --e) {
        if (e == d) continue;
        c[e] = rest % shape[e];
        rest /= shape[e];
      }
      std::vector<int> members;
      for (int k = 0; k < shape[d]; ++k) {
        c[d] = k;
        members.push_back(mesh->rank_at(c));
      }
      if (auto g = new_group(members, backend)) {
        g->set_name(group_name(names[d]));  // what the flight recorder and fr_trace call it
        mesh->groups_[d] = std::move(g);
      }
    }
    EMBER_INTERNAL_ASSERT(mesh->groups_[d] != nullptr, "DeviceMesh: rank ", world->rank(), " is in no slice of ",
                          names[d]);
  }
  // Every rank has connected every group it belongs to before any rank goes
  // on: a rank that dropped its mesh at once (a short-lived mesh) would
  // otherwise close a connection a slower peer is still completing.
  world->barrier()->wait();
  return mesh;
}

std::shared_ptr<DeviceMesh> DeviceMesh::from_group(std::shared_ptr<ProcessGroup> group, const std::string& name) {
  EMBER_CHECK(group != nullptr, "DeviceMesh::from_group: null group");
  EMBER_CHECK(!name.empty(), "DeviceMesh::from_group: empty dimension name");
  auto mesh = std::shared_ptr<DeviceMesh>(new DeviceMesh());
  mesh->shape_ = {group->size()};
  mesh->names_ = {name};
  mesh->ranks_ = group->global_ranks();
  mesh->coord_ = {group->rank()};
  mesh->global_rank_ = group->global_rank(group->rank());
  mesh->groups_ = {std::move(group)};
  return mesh;
}

int DeviceMesh::size() const {
  int n = 1;
  for (int s : shape_) n *= s;
  return n;
}

bool DeviceMesh::has_dim(const std::string& dim) const {
  return std::find(names_.begin(), names_.end(), dim) != names_.end();
}

int DeviceMesh::dim_index(const std::string& dim) const {
  auto it = std::find(names_.begin(), names_.end(), dim);
  if (it == names_.end()) {
    std::string known;
    for (const auto& n : names_) known += (known.empty() ? "'" : ", '") + n + "'";
    EMBER_CHECK(false, to_string(), " has no dimension '", dim, "' (its dimensions: ", known, ")");
  }
  return static_cast<int>(it - names_.begin());
}

const std::shared_ptr<ProcessGroup>& DeviceMesh::group(int dim) const {
  EMBER_CHECK(dim >= 0 && dim < ndim(), to_string(), ": dimension index ", dim, " is outside [0, ", ndim(), ")");
  return groups_[dim];
}

const std::shared_ptr<ProcessGroup>& DeviceMesh::group() const {
  EMBER_CHECK(ndim() == 1, to_string(), " has ", ndim(), " dimensions: name the one whose group you want");
  return groups_[0];
}

int DeviceMesh::rank_at(const std::vector<int>& coord) const {
  EMBER_CHECK(coord.size() == shape_.size(), to_string(), ": a coordinate of ", coord.size(), " entries for ", ndim(),
              " dimensions");
  int64_t index = 0;
  for (size_t d = 0; d < shape_.size(); ++d) {
    EMBER_CHECK(coord[d] >= 0 && coord[d] < shape_[d], to_string(), ": coordinate ", coord[d], " of '", names_[d],
                "' is outside [0, ", shape_[d], ")");
    index = index * shape_[d] + coord[d];
  }
  return ranks_[index];
}

std::vector<int> DeviceMesh::coordinate_of(int index) const {
  EMBER_CHECK(index >= 0 && index < size(), to_string(), ": rank index ", index, " is outside [0, ", size(), ")");
  std::vector<int> c(shape_.size(), 0);
  for (int d = ndim() - 1, rest = index; d >= 0; --d) {
    c[d] = rest % shape_[d];
    rest /= shape_[d];
  }
  return c;
}

std::vector<int> DeviceMesh::dim_indices(const std::vector<std::string>& dims, const char* what) const {
  EMBER_CHECK(!dims.empty(), to_string(), ": ", what, " needs at least one dimension");
  std::vector<int> idx;
  for (const auto& n : dims) {
    const int d = dim_index(n);
    EMBER_CHECK(std::find(idx.begin(), idx.end(), d) == idx.end(), to_string(), ": dimension '", n,
                "' is named twice for ", what);
    idx.push_back(d);
  }
  return idx;
}

std::vector<int> DeviceMesh::slice_ranks(const std::vector<int>& idx, std::vector<int> c) const {
  int n = 1;
  for (int d : idx) n *= shape_[d];
  std::vector<int> out;
  for (int s = 0; s < n; ++s) {
    for (int k = static_cast<int>(idx.size()) - 1, rest = s; k >= 0; --k) {
      c[idx[k]] = rest % shape_[idx[k]];
      rest /= shape_[idx[k]];
    }
    out.push_back(rank_at(c));
  }
  return out;
}

std::shared_ptr<DeviceMesh> DeviceMesh::submesh(const std::vector<std::string>& dims) const {
  if (dims.size() == 1 && !has_dim(dims[0]))
    if (auto flat = flattened(dims[0])) return flat;
  const std::vector<int> idx = dim_indices(dims, "a sub-mesh");
  std::lock_guard<std::mutex> lock(sub_mu_);
  if (auto cached = subs_[dims].lock()) return cached;
  auto sub = std::shared_ptr<DeviceMesh>(new DeviceMesh());
  subs_[dims] = sub;
  sub->root_ = root();
  sub->global_rank_ = global_rank_;
  for (int d : idx) {
    sub->shape_.push_back(shape_[d]);
    sub->names_.push_back(names_[d]);
    sub->coord_.push_back(coord_[d]);
    sub->groups_.push_back(groups_[d]);
  }
  sub->ranks_ = slice_ranks(idx, coord_);  // the others fixed at this rank's
  return sub;
}

// flatten's checks of the view's name, on either path.
void DeviceMesh::check_flatten_name(const std::string& name) const {
  EMBER_CHECK(!name.empty(), to_string(), ": flatten needs a name");
  EMBER_CHECK(!has_dim(name), to_string(), ": flatten's name '", name, "' is already a dimension");
  EMBER_CHECK(root_ == nullptr, to_string(), ": flatten runs on the mesh create() made, not on a sub-mesh");
  EMBER_CHECK(flats_.count(name) == 0, to_string(), ": a view named '", name, "' is already registered");
}

std::shared_ptr<DeviceMesh> DeviceMesh::flatten(const std::vector<std::string>& dims, const std::string& name) {
  check_flatten_name(name);
  const std::vector<int> idx = dim_indices(dims, "flatten");
  // One dimension of more than one rank (or none): its group already is the
  // view's, and no rank needs to make one.
  int wide = -1, n_wide = 0;
  for (int d : idx)
    if (shape_[d] > 1) wide = d, ++n_wide;
  std::shared_ptr<DeviceMesh> view;
  if (n_wide <= 1) {
    view = from_group(groups_[wide >= 0 ? wide : idx[0]], name);
    flats_[name] = view;
  } else {
    // The slices, each listed at its first rank (zero on every one of `dims`).
    std::vector<std::vector<int>> partition;
    for (int i = 0; i < size(); ++i) {
      const std::vector<int> c = coordinate_of(i);
      if (std::all_of(idx.begin(), idx.end(), [&](int d) { return c[d] == 0; }))
        partition.push_back(slice_ranks(idx, c));
    }
    view = flatten(name, partition);
  }
  view->flat_source_ = weak_from_this();
  view->flat_dims_ = dims;
  return view;
}

std::shared_ptr<DeviceMesh> DeviceMesh::flatten(const std::string& name,
                                                const std::vector<std::vector<int>>& partition) {
  check_flatten_name(name);
  EMBER_CHECK(!partition.empty(), to_string(), ": flatten '", name, "': an empty partition");
  std::vector<int> seen(ranks_.size(), 0);
  for (const auto& part : partition) {
    EMBER_CHECK(part.size() == partition[0].size(), to_string(), ": flatten '", name, "': the groups differ in size (",
                part.size(), " and ", partition[0].size(), ")");
    for (int r : part) {
      EMBER_CHECK(r >= 0 && r < static_cast<int>(seen.size()) && !seen[r]++, to_string(), ": flatten '", name,
                  "': rank ", r, " is outside the mesh or in two groups");
    }
  }
  EMBER_CHECK(partition.size() * partition[0].size() == ranks_.size(), to_string(), ": flatten '", name,
              "': the groups cover ", partition.size() * partition[0].size(), " of ", ranks_.size(), " ranks");
  std::shared_ptr<ProcessGroup> mine;
  for (const auto& part : partition)  // every rank, every group, in order (new_group's rule)
    if (auto g = new_group(part)) mine = std::move(g);
  EMBER_INTERNAL_ASSERT(mine != nullptr, "flatten '", name, "': rank ", global_rank_, " is in no group");
  mine->set_name(group_name(name));
  // As create(): every rank has connected its groups before any goes on.
  default_group()->barrier()->wait();
  auto view = from_group(std::move(mine), name);
  flats_[name] = view;
  return view;
}

std::shared_ptr<DeviceMesh> DeviceMesh::flattened(const std::string& name) const {
  const DeviceMesh& r = *root();
  auto it = r.flats_.find(name);
  return it == r.flats_.end() ? nullptr : it->second;
}

std::string DeviceMesh::to_string() const { return describe(shape_, names_); }

std::shared_ptr<const DeviceMesh> DeviceMesh::root() const { return root_ ? root_ : shared_from_this(); }

}  // namespace ember::distributed
