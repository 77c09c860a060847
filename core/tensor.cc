// Tensor metadata, views, copies across devices and dtypes, and printing.
#include "core/tensor.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "core/autograd_hook.h"
#include "core/cuda_graph.h"
#if EMBER_WITH_CUDA
#include "core/cuda_check.h"
#endif
#include "core/ops.h"
#include "core/ops/kernels.h"

namespace ember {

std::string shape_str(const Shape& s) { return detail::str_cat(s); }

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  int64_t n = std::max<int64_t>(ndim, 1);
  EMBER_CHECK(dim >= -n && dim < n, op, ": dim ", dim, " out of range for a ", ndim, "-d tensor");
  return dim < 0 ? dim + n : dim;
}

Shape contiguous_strides(const Shape& sizes) {
  Shape st(sizes.size());
  int64_t s = 1;
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) {
    st[i] = s;
    s *= std::max<int64_t>(sizes[i], 1);
  }
  return st;
}

int64_t shape_numel(const Shape& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes)
    EMBER_CHECK(!__builtin_mul_overflow(n, s, &n), "shape ", shape_str(sizes), " has more elements than int64 holds");
  return n;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    EMBER_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ", shape_str(b),
                " cannot be broadcast (dim ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// ---- Construction ----
Tensor Tensor::empty(const Shape& sizes, TensorOptions opts) {
  for (int64_t s : sizes) EMBER_CHECK(s >= 0, "empty: negative size in ", shape_str(sizes));
  auto impl = std::make_shared<TensorImpl>();
  impl->sizes = sizes;
  impl->strides = contiguous_strides(sizes);
  impl->dtype = opts.dtype;
  impl->storage = std::make_shared<Storage>();
  size_t nbytes = 0;
  EMBER_CHECK(!__builtin_mul_overflow(static_cast<size_t>(shape_numel(sizes)), dtype_size(opts.dtype), &nbytes),
              "empty: ", shape_str(sizes), " of ", opts.dtype, " does not fit in memory");
  impl->storage->data = get_allocator(opts.device)->allocate(nbytes);
  impl->storage->nbytes = nbytes;
  return Tensor(std::move(impl));
}

Tensor Tensor::from_vector(const std::vector<double>& values, const Shape& sizes, TensorOptions opts) {
  EMBER_CHECK(static_cast<int64_t>(values.size()) == shape_numel(sizes), "from_vector: ", values.size(),
              " values for shape ", shape_str(sizes));
  Tensor t = empty(sizes, {opts.dtype, kCPU});
  EMBER_DISPATCH_ALL(opts.dtype, "from_vector", [&] {
    scalar_t* p = t.data<scalar_t>();
    for (size_t i = 0; i < values.size(); ++i) {
      if constexpr (std::is_same_v<scalar_t, Half> || std::is_same_v<scalar_t, BFloat16>)
        p[i] = scalar_t(static_cast<float>(values[i]));
      else
        p[i] = static_cast<scalar_t>(values[i]);
    }
  });
  return t.to(opts.device);
}

// ---- Metadata ----
int64_t Tensor::size(int64_t dim) const {
  EMBER_CHECK(this->dim() > 0, "size: a 0-dim tensor has no dim ", dim);
  return sizes()[wrap_dim(dim, this->dim(), "size")];
}
int64_t Tensor::stride(int64_t dim) const {
  EMBER_CHECK(this->dim() > 0, "stride: a 0-dim tensor has no dim ", dim);
  return strides()[wrap_dim(dim, this->dim(), "stride")];
}
int64_t Tensor::numel() const { return shape_numel(sizes()); }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (sizes()[i] == 1) continue;
    if (strides()[i] != expected) return false;
    expected *= sizes()[i];
  }
  return true;
}

bool Tensor::is_contiguous(MemoryFormat format) const {
  if (format == MemoryFormat::Contiguous) return is_contiguous();
  if (dim() != 4) return false;
  // Walk the dims in NHWC order: C fastest, then W, H, N.
  int64_t expected = 1;
  for (int64_t d : {1, 3, 2, 0}) {
    if (sizes()[d] == 1) continue;
    if (strides()[d] != expected) return false;
    expected *= sizes()[d];
  }
  return true;
}

MemoryFormat Tensor::suggest_memory_format() const {
  return dim() == 4 && !is_contiguous() && is_contiguous(MemoryFormat::ChannelsLast) ? MemoryFormat::ChannelsLast
                                                                                      : MemoryFormat::Contiguous;
}

void Tensor::free_storage(const char* why) const {
  Storage& s = *impl().storage;
  if (s.freed) return;
  s.data.ptr.reset();
  s.freed = true;
  s.freed_why = why;
  s.bump_version("free_storage");
}

void Tensor::restore_storage() const {
  Storage& s = *impl().storage;
  if (!s.freed) return;
  s.data = get_allocator(s.data.device)->allocate(s.nbytes);
  s.freed = false;
  s.freed_why = nullptr;
  s.bump_version("restore_storage");
}

void* Tensor::raw_data() const {
  const Storage& s = *impl().storage;
  if (s.freed && s.freed_why)
    EMBER_CHECK(false, "tensor ", shape_str(sizes()), " ", dtype(), " on ", device(),
                ": its storage was freed: ", s.freed_why);
  EMBER_CHECK(!s.freed, "tensor ", shape_str(sizes()), " ", dtype(), " on ", device(),
              ": its storage was freed (free_storage) and not restored; call restore_storage() before using it");
  return static_cast<char*>(impl().storage->data.get()) + impl().offset * static_cast<int64_t>(element_size());
}

// ---- Views ----
namespace {
Tensor make_view(const Tensor& base, const Shape& sizes, const Shape& strides, int64_t offset) {
  EMBER_INTERNAL_ASSERT(sizes.size() == strides.size());
  auto impl2 = std::make_shared<TensorImpl>();
  impl2->storage = base.impl().storage;
  impl2->sizes = sizes;
  impl2->strides = strides;
  impl2->offset = offset;
  impl2->dtype = base.dtype();
  return Tensor(std::move(impl2));
}

// Records a view's derivative: `bwd(g, base_shape)` maps the view's gradient
// to the base's. Views compute nothing, so there is no forward to guard.
template <typename Bwd>
Tensor view_diff(const Tensor& base, Tensor out, const char* op, Bwd bwd) {
  if (!needs_grad({base})) return out;
  Shape bs = base.sizes();
  autograd_recorder()->record(op, {base}, out, [bs, bwd](const Tensor& g) { return std::vector<Tensor>{bwd(g, bs)}; },
                              {}, false);
  return out;
}
Tensor reshape_back(const Tensor& g, const Shape& bs) { return g.reshape(bs); }
Tensor same_view(const Tensor& base, const char* op) {
  return view_diff(base, make_view(base, base.sizes(), base.strides(), base.storage_offset()), op,
                   [](const Tensor& g, const Shape&) { return g; });
}
}  // namespace

Tensor Tensor::as_strided(const Shape& sizes, const Shape& strides, int64_t offset) const {
  EMBER_CHECK(!needs_grad({*this}), "as_strided: not differentiable; the input ", shape_str(this->sizes()),
              " requires grad (use view/reshape/slice/... or detach() first)");
  return make_view(*this, sizes, strides, offset);
}

void Tensor::set_data(const Tensor& data) const {
  EMBER_CHECK(data.defined(), "set_data: new data is undefined");
  EMBER_CHECK(!data.requires_grad() || data.is_leaf(), "set_data: new data must not carry autograd history");
  TensorImpl& me = impl();
  const TensorImpl& src = data.impl();
  if (me.storage != src.storage) me.storage->bump_version("set_data");
  me.storage = src.storage;
  me.sizes = src.sizes;
  me.strides = src.strides;
  me.offset = src.offset;
  me.dtype = src.dtype;
}

void set_memory_kind(const Tensor& t, MemoryKind kind) {
  if (!t.defined()) return;
  const Storage& s = *t.impl().storage;
  if (s.freed || s.data.get() == nullptr) return;
  get_allocator(s.device())->set_memory_kind(s.data.get(), kind);
}

Tensor Tensor::alias() const { return make_view(*this, sizes(), strides(), storage_offset()); }

namespace {
Shape infer_size(const Shape& sizes, int64_t numel, const char* op, const Shape& from) {
  Shape out = sizes;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      EMBER_CHECK(infer < 0, op, ": only one dimension can be -1, got ", shape_str(sizes));
      infer = static_cast<int64_t>(i);
    } else {
      EMBER_CHECK(out[i] >= 0, op, ": invalid size ", shape_str(sizes));
      known *= out[i];
    }
  }
  if (infer >= 0) {
    EMBER_CHECK(known != 0 && numel % known == 0, op, ": shape ", shape_str(sizes), " is invalid for input ",
                shape_str(from), " of ", numel, " elements");
    out[infer] = numel / known;
  }
  EMBER_CHECK(shape_numel(out) == numel, op, ": shape ", shape_str(sizes), " is invalid for input ", shape_str(from),
              " of ", numel, " elements");
  return out;
}

// Strides for viewing (sizes, strides) as new_sizes without a copy, if possible
// (PyTorch's computeStride: each run of merged old dims must be contiguous).
bool view_strides(const Shape& sizes, const Shape& strides, const Shape& new_sizes, Shape& out) {
  out.assign(new_sizes.size(), 1);
  if (sizes.empty() || shape_numel(sizes) == 0) {
    out = contiguous_strides(new_sizes);
    return true;
  }
  int64_t view_d = static_cast<int64_t>(new_sizes.size()) - 1;
  int64_t chunk_base_stride = strides.empty() ? 1 : strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    tensor_numel *= sizes[d];
    if (d == 0 || (sizes[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_sizes[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_sizes[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}
}  // namespace

Tensor Tensor::view(const Shape& new_sizes) const {
  Shape s = infer_size(new_sizes, numel(), "view", sizes());
  Shape st;
  EMBER_CHECK(view_strides(sizes(), strides(), s, st), "view: size ", shape_str(s),
              " is not compatible with input of shape ", shape_str(sizes()), " and strides ", shape_str(strides()),
              " (at least one dimension spans two contiguous subspaces); use reshape");
  return view_diff(*this, make_view(*this, s, st, storage_offset()), "view", reshape_back);
}

Tensor Tensor::reshape(const Shape& new_sizes) const {
  Shape s = infer_size(new_sizes, numel(), "reshape", sizes());
  Shape st;
  if (view_strides(sizes(), strides(), s, st))
    return view_diff(*this, make_view(*this, s, st, storage_offset()), "reshape", reshape_back);
  return contiguous().view(s);
}

Tensor Tensor::flatten(int64_t start, int64_t end) const {
  if (dim() == 0) return reshape({1});
  start = wrap_dim(start, dim(), "flatten");
  end = wrap_dim(end, dim(), "flatten");
  EMBER_CHECK(start <= end, "flatten: start dim ", start, " is after end dim ", end);
  Shape s(sizes().begin(), sizes().begin() + start);
  int64_t m = 1;
  for (int64_t i = start; i <= end; ++i) m *= sizes()[i];
  s.push_back(m);
  s.insert(s.end(), sizes().begin() + end + 1, sizes().end());
  return reshape(s);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  Shape s = sizes(), st = strides();
  if (dim() == 0) return same_view(*this, "transpose");
  std::swap(s[d0], s[d1]);
  std::swap(st[d0], st[d1]);
  return view_diff(*this, make_view(*this, s, st, storage_offset()), "transpose",
                   [d0, d1](const Tensor& g, const Shape&) { return g.transpose(d0, d1); });
}

Tensor Tensor::t() const {
  EMBER_CHECK(dim() <= 2, "t: expects a tensor with <= 2 dims, got ", shape_str(sizes()));
  return dim() < 2 ? same_view(*this, "t") : transpose(0, 1);
}

Tensor Tensor::permute(const Shape& dims) const {
  EMBER_CHECK(static_cast<int64_t>(dims.size()) == dim(), "permute: ", dims.size(), " dims given for a ", dim(),
              "-d tensor ", shape_str(sizes()));
  Shape s(dims.size()), st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], dim(), "permute");
    EMBER_CHECK(!seen[d], "permute: dim ", d, " repeated in ", shape_str(dims));
    seen[d] = true;
    s[i] = sizes()[d];
    st[i] = strides()[d];
  }
  Shape inv(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inv[wrap_dim(dims[i], dim(), "permute")] = static_cast<int64_t>(i);
  return view_diff(*this, make_view(*this, s, st, storage_offset()), "permute",
                   [inv](const Tensor& g, const Shape&) { return g.permute(inv); });
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  EMBER_CHECK(dim() > 0, "slice: cannot be applied to a 0-dim tensor");
  d = wrap_dim(d, dim(), "slice");
  EMBER_CHECK(step > 0, "slice: step must be positive, got ", step);
  int64_t n = sizes()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape s = sizes(), st = strides();
  s[d] = (end - start + step - 1) / step;
  st[d] *= step;
  return view_diff(*this, make_view(*this, s, st, storage_offset() + start * strides()[d]), "slice",
                   [d, start, end, step](const Tensor& g, const Shape& bs) {
                     Tensor z = zeros(bs, g.options());
                     z.slice(d, start, end, step).copy_(g);
                     return z;
                   });
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  EMBER_CHECK(dim() > 0, "narrow: cannot be applied to a 0-dim tensor");
  d = wrap_dim(d, dim(), "narrow");
  int64_t n = sizes()[d];
  if (start < 0) start += n;
  EMBER_CHECK(start >= 0 && length >= 0 && start + length <= n, "narrow: start ", start, " + length ", length,
              " exceeds dimension ", d, " of size ", n, " in ", shape_str(sizes()));
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  EMBER_CHECK(dim() > 0, "select: cannot be applied to a 0-dim tensor");
  d = wrap_dim(d, dim(), "select");
  int64_t n = sizes()[d];
  EMBER_CHECK(index >= -n && index < n, "select: index ", index, " out of range for dimension ", d, " of size ", n);
  if (index < 0) index += n;
  Shape s = sizes(), st = strides();
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return view_diff(*this, make_view(*this, s, st, storage_offset() + index * strides()[d]), "select",
                   [d, index](const Tensor& g, const Shape& bs) {
                     Tensor z = zeros(bs, g.options());
                     z.select(d, index).copy_(g);
                     return z;
                   });
}

Tensor Tensor::expand(const Shape& new_sizes) const {
  EMBER_CHECK(new_sizes.size() >= sizes().size(), "expand: target ", shape_str(new_sizes), " has fewer dims than ",
              shape_str(sizes()));
  size_t lead = new_sizes.size() - sizes().size();
  Shape s(new_sizes.size()), st(new_sizes.size());
  for (size_t i = 0; i < new_sizes.size(); ++i) {
    if (i < lead) {
      EMBER_CHECK(new_sizes[i] >= 0, "expand: new leading dim must be sized, got ", shape_str(new_sizes));
      s[i] = new_sizes[i];
      st[i] = 0;
    } else {
      int64_t cur = sizes()[i - lead];
      int64_t want = new_sizes[i] == -1 ? cur : new_sizes[i];
      EMBER_CHECK(cur == want || cur == 1, "expand: cannot expand ", shape_str(sizes()), " to ",
                  shape_str(new_sizes), " (dim ", i, ": ", cur, " vs ", want, ")");
      s[i] = want;
      st[i] = cur == want ? strides()[i - lead] : 0;
    }
  }
  return view_diff(*this, make_view(*this, s, st, storage_offset()), "expand",
                   [](const Tensor& g, const Shape& bs) { return sum_to(g, bs); });
}

Tensor Tensor::squeeze() const {
  Shape s, st;
  for (int64_t i = 0; i < dim(); ++i)
    if (sizes()[i] != 1) {
      s.push_back(sizes()[i]);
      st.push_back(strides()[i]);
    }
  return view_diff(*this, make_view(*this, s, st, storage_offset()), "squeeze", reshape_back);
}

Tensor Tensor::squeeze(int64_t d) const {
  if (dim() == 0) return same_view(*this, "squeeze");
  d = wrap_dim(d, dim(), "squeeze");
  if (sizes()[d] != 1) return same_view(*this, "squeeze");
  Shape s = sizes(), st = strides();
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return view_diff(*this, make_view(*this, s, st, storage_offset()), "squeeze", reshape_back);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape s = sizes(), st = strides();
  int64_t new_stride = d < dim() ? strides()[d] * sizes()[d] : 1;
  s.insert(s.begin() + d, 1);
  st.insert(st.begin() + d, new_stride);
  return view_diff(*this, make_view(*this, s, st, storage_offset()), "unsqueeze", reshape_back);
}

// ---- Copies ----
Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::contiguous(MemoryFormat format) const {
  if (format == MemoryFormat::Contiguous) return contiguous();
  EMBER_CHECK(dim() == 4, "contiguous(ChannelsLast): expected a 4-D [N, C, H, W] tensor, got ", shape_str(sizes()));
  if (is_contiguous(format)) return *this;
  return permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2});
}

Tensor Tensor::empty(const Shape& sizes, TensorOptions opts, MemoryFormat format) {
  if (format == MemoryFormat::Contiguous) return empty(sizes, opts);
  EMBER_CHECK(sizes.size() == 4, "empty(ChannelsLast): expected 4-D [N, C, H, W] sizes, got ", shape_str(sizes));
  // permute() would record a view node; a fresh buffer has no history.
  Tensor t = empty({sizes[0], sizes[2], sizes[3], sizes[1]}, opts);
  t.impl_->sizes = sizes;
  t.impl_->strides = {sizes[1] * sizes[2] * sizes[3], 1, sizes[3] * sizes[1], sizes[1]};
  return t;
}

Tensor Tensor::clone() const {
  return differentiable("clone", {*this}, [&] {
    Tensor out = empty(sizes(), options());
    out.copy_(*this);
    return out;
  }, [](const Tensor&) { return Recorded{[](const Tensor& g) { return std::vector<Tensor>{g}; }, {}}; });
}

Tensor Tensor::to(Device d) const { return to(d, dtype()); }
Tensor Tensor::to(DType t) const { return to(device(), t); }
Tensor Tensor::to(Device d, DType t) const {
  if (d == device() && t == dtype()) return *this;
  Device from_device = device();
  DType from_dtype = dtype();
  return differentiable(
      "to", {*this},
      [&] {
        // Keeps a channels-last tensor channels-last (PyTorch's preserve_format):
        // a channels-last weight cast by autocast or moved to the GPU stays OHWI.
        Tensor out = empty(sizes(), {t, d}, suggest_memory_format());
        out.copy_(*this);
        return out;
      },
      [=](const Tensor&) {
        return Recorded{[=](const Tensor& g) { return std::vector<Tensor>{g.to(from_device, from_dtype)}; }, {}, true};
      });
}

Tensor Tensor::pin_memory() const {
  EMBER_CHECK(device().is_cpu(), "pin_memory: tensor is already on ", device());
  auto impl2 = std::make_shared<TensorImpl>();
  impl2->sizes = sizes();
  impl2->strides = contiguous_strides(sizes());
  impl2->dtype = dtype();
  impl2->storage = std::make_shared<Storage>();
  impl2->storage->nbytes = nbytes();
  impl2->storage->data = pinned_allocator()->allocate(nbytes());
  Tensor out(std::move(impl2));
  out.copy_(*this);
  return out;
}

StridedIter make_iter(const Tensor& out, std::initializer_list<Tensor> inputs, const char* op) {
  StridedIter it;
  it.nops = 1 + static_cast<int>(inputs.size());
  EMBER_INTERNAL_ASSERT(it.nops <= kMaxOperands);
  const int64_t nd = out.dim();
  it.numel = out.numel();
  std::vector<const Tensor*> ops{&out};
  for (const Tensor& t : inputs) ops.push_back(&t);
  // Per-operand strides broadcast to out's shape.
  std::vector<Shape> st(it.nops, Shape(nd, 0));
  for (int o = 0; o < it.nops; ++o) {
    const Tensor& t = *ops[o];
    EMBER_CHECK(t.dim() <= nd, op, ": operand ", shape_str(t.sizes()), " has more dims than the output ",
                shape_str(out.sizes()));
    int64_t lead = nd - t.dim();
    for (int64_t d = 0; d < t.dim(); ++d) {
      EMBER_CHECK(t.sizes()[d] == out.sizes()[d + lead] || t.sizes()[d] == 1, op, ": operand ",
                  shape_str(t.sizes()), " does not broadcast to ", shape_str(out.sizes()));
      st[o][d + lead] = t.sizes()[d] == 1 ? 0 : t.strides()[d];
    }
    it.data[o] = static_cast<char*>(t.raw_data());
    it.dtypes[o] = t.dtype();
  }
  // Walk the output in memory order (outermost stride first), so a
  // channels-last output and inputs stream as one flat run; for a contiguous
  // output this is the logical order. Then drop size-1 dims and merge dim d
  // into d+1 where every operand is contiguous across the pair.
  std::vector<int64_t> order(nd);
  for (int64_t d = 0; d < nd; ++d) order[d] = d;
  if (!out.is_contiguous())
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return st[0][a] > st[0][b]; });
  Shape sizes;
  std::vector<Shape> strides(it.nops);
  for (int64_t d : order) {
    if (out.sizes()[d] == 1) continue;
    sizes.push_back(out.sizes()[d]);
    for (int o = 0; o < it.nops; ++o) strides[o].push_back(st[o][d]);
  }
  Shape msizes;
  std::vector<Shape> mstrides(it.nops);
  for (size_t d = 0; d < sizes.size(); ++d) {
    bool merge = !msizes.empty();
    for (int o = 0; merge && o < it.nops; ++o)
      merge = mstrides[o].back() == strides[o][d] * sizes[d];
    if (merge) {
      msizes.back() *= sizes[d];
      for (int o = 0; o < it.nops; ++o) mstrides[o].back() = strides[o][d];
    } else {
      msizes.push_back(sizes[d]);
      for (int o = 0; o < it.nops; ++o) mstrides[o].push_back(strides[o][d]);
    }
  }
  if (msizes.empty()) {  // a scalar
    msizes.push_back(1);
    for (int o = 0; o < it.nops; ++o) mstrides[o].push_back(1);
  }
  EMBER_CHECK(msizes.size() <= static_cast<size_t>(kMaxDims), op, ": tensors of shape ", shape_str(out.sizes()),
              " need ", msizes.size(), " strided dims after merging; at most ", kMaxDims, " are supported");
  it.ndim = static_cast<int>(msizes.size());
  for (int d = 0; d < it.ndim; ++d) {
    it.sizes[d] = msizes[d];
    for (int o = 0; o < it.nops; ++o) it.strides[o][d] = mstrides[o][d];
  }
  return it;
}

namespace {
std::atomic<uint64_t> g_cuda_layout_copies{0};

// Reads or writes the innermost dimension of the other side with a stride:
// a transpose, not a slice (both sides step 1 inside) or a broadcast (0).
bool is_layout_copy(const Tensor& dst, const Tensor& src) {
  for (int64_t d = 0; d < dst.dim(); ++d) {
    const int64_t a = dst.strides()[d], b = src.strides()[d];
    if (dst.sizes()[d] > 1 && a != 0 && b != 0 && (a == 1) != (b == 1)) return true;
  }
  return false;
}
}  // namespace

uint64_t cuda_layout_copies() { return g_cuda_layout_copies.load(std::memory_order_relaxed); }

Tensor& Tensor::copy_(const Tensor& src) {
  EMBER_PROFILE_OP("copy_", *this, src);
  EMBER_CHECK(src.defined(), "copy_: source is undefined");
  EMBER_CHECK(!needs_grad({src}), "copy_: the source ", shape_str(src.sizes()),
              " requires grad and copy_ is not differentiable; use clone() or to(), or detach() the source");
  check_inplace(*this, "copy_");
  broadcast_shapes(sizes(), src.sizes(), "copy_");
  Tensor s = src.expand(sizes());
  if (s.device() != device()) {
    // Cross-device: make a dense buffer in our dtype on the source side, move
    // the bytes, then a same-device (possibly strided) copy. The buffers are
    // laid out as the destination (channels-last when it is), so a
    // channels-last tensor moves as it is, with no transposes on either side.
    const MemoryFormat fmt = suggest_memory_format();
    Tensor staged = Tensor::empty(sizes(), {dtype(), s.device()}, fmt);
    staged.copy_(s);
    Tensor landed = is_contiguous(fmt) ? *this : Tensor::empty(sizes(), options(), fmt);
#if EMBER_WITH_CUDA  // else unreachable: no CUDA tensor can be allocated
    cudaMemcpyKind kind = s.device().is_cpu() ? cudaMemcpyHostToDevice
                          : device().is_cpu() ? cudaMemcpyDeviceToHost
                                              : cudaMemcpyDeviceToDevice;
    if (nbytes() > 0) {
      check_not_capturing(s.device().is_cpu() ? "a copy from the CPU to the GPU"
                          : device().is_cpu() ? "a copy from the GPU to the CPU (item(), cpu(), to_vector())"
                                              : "a copy between two GPUs",
                          s.device().is_cpu() || device().is_cpu()
                              ? "a graph can neither wait for host memory nor stage it (make the tensor on the "
                                "device before capture and copy_ new values into it between replays)"
                              : nullptr);
      // Issue on the source GPU's stream (the destination's for H2D) with that
      // GPU current; for D2D, the destination's pending work is waited first.
      int gpu = s.is_cuda() ? s.device().index : device().index;
      int prev = 0;
      EMBER_CUDA_CHECK(cudaGetDevice(&prev));
      EMBER_CUDA_CHECK(cudaSetDevice(gpu));
      const Stream on = Stream::current(gpu);
      auto stream = static_cast<cudaStream_t>(on.handle);
      if (s.is_cuda() && is_cuda())
        EMBER_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(Stream::current(device().index).handle)));
      // A device-to-host copy is a natural synchronisation: the errors that
      // kernels recorded (device.h) are copied out ahead of it and raised
      // after it. Into pageable memory the copy itself returns only once
      // done (after everything queued before it), so it is the one wait;
      // into pinned memory it is asynchronous and the stream is waited for.
      // A host-to-device copy waits for nothing: `staged` is pageable memory
      // of ours, which CUDA copies out before cudaMemcpyAsync returns.
      bool wait = kind == cudaMemcpyDeviceToDevice;
      if (kind == cudaMemcpyDeviceToHost) {
        cuda_error_snapshot(on);
        cudaPointerAttributes attr{};
        if (cudaPointerGetAttributes(&attr, landed.raw_data()) == cudaSuccess) wait = attr.type == cudaMemoryTypeHost;
        else cudaGetLastError();  // plain malloc'd memory on old runtimes: pageable
      }
      cudaError_t err = cudaMemcpyAsync(landed.raw_data(), staged.raw_data(), nbytes(), kind, stream);
      if (err == cudaSuccess && wait) err = cudaStreamSynchronize(stream);
      cudaSetDevice(prev);
      EMBER_CUDA_CHECK(err);
      if (kind == cudaMemcpyDeviceToHost) cuda_error_raise_if_set(on);
    }
#endif
    if (!landed.is_same(*this)) copy_(landed);
    return *this;
  }
  if (numel() == 0) return *this;
  if (may_overlap(*this, s)) s = s.clone();
  StridedIter it = make_iter(*this, {s}, "copy_");
  if (is_cuda()) {
    if (is_layout_copy(*this, s)) g_cuda_layout_copies.fetch_add(1, std::memory_order_relaxed);
    copy_cuda(it);
  } else {
    copy_cpu(it);
  }
  return *this;
}

bool may_overlap(const Tensor& dst, const Tensor& src) {
  return src.shares_storage(dst) && !(src.sizes() == dst.sizes() && src.strides() == dst.strides() &&
                                      src.storage_offset() == dst.storage_offset());
}

Tensor& Tensor::fill_(double value) {
  EMBER_PROFILE_OP("fill_", *this);
  check_inplace(*this, "fill_");
  StridedIter it = make_iter(*this, {}, "fill_");
  if (is_cuda()) fill_cuda(it, value); else fill_cpu(it, value);
  return *this;
}

double Tensor::item() const {
  EMBER_CHECK(numel() == 1, "item: expected a tensor with one element, got shape ", shape_str(sizes()));
  return to_vector()[0];
}

std::vector<double> Tensor::to_vector() const {
  Tensor c = to(kCPU).contiguous();
  std::vector<double> out(static_cast<size_t>(c.numel()));
  EMBER_DISPATCH_CAST(c.dtype(), "to_vector", [&] {  // float8 too: reading and printing it is allowed
    const scalar_t* p = c.data<scalar_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(static_cast<acc_t<scalar_t>>(p[i]));
  });
  return out;
}

// ---- Printing ----
namespace {
void print_rec(std::ostream& os, const std::vector<double>& v, const Shape& sizes, size_t d, int64_t& pos,
               const Shape& cstrides, bool is_float, int indent) {
  constexpr int64_t kEdge = 3;
  if (d == sizes.size()) {
    double x = v[pos];
    if (is_float) os << std::setprecision(4) << std::fixed << x;
    else os << static_cast<int64_t>(x);
    return;
  }
  os << '[';
  int64_t n = sizes[d];
  bool summarize = n > 2 * kEdge + 1 && shape_numel(sizes) > 1000;
  int64_t base = pos;
  for (int64_t i = 0; i < n; ++i) {
    if (summarize && i == kEdge) {
      os << (d + 1 == sizes.size() ? ", ..." : ",\n" + std::string(indent + 1, ' ') + "...");
      i = n - kEdge;
    }
    if (i > 0) os << (d + 1 == sizes.size() ? ", " : ",\n" + std::string(indent + 1, ' '));
    pos = base + i * cstrides[d];
    print_rec(os, v, sizes, d + 1, pos, cstrides, is_float, indent + 1);
  }
  os << ']';
}
}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream os;
  std::vector<double> v = to_vector();
  os << "tensor(";
  int64_t pos = 0;
  if (dim() == 0) {
    Shape none;
    print_rec(os, v, none, 0, pos, none, is_floating(dtype()), 7);
  } else {
    print_rec(os, v, sizes(), 0, pos, contiguous_strides(sizes()), is_floating(dtype()), 7);
  }
  os << ", shape=" << shape_str(sizes()) << ", dtype=" << dtype() << ", device=" << device() << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace ember
