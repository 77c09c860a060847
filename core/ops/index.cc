// Joining and indexing: cat, stack, index_select, gather, one_hot. cat and
// stack are copies into narrowed views of the output; index_select and
// gather have CPU kernels here and CUDA kernels in index.cu.
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"

namespace ember {

// ---- CPU kernels ----
namespace {
[[noreturn]] void index_error(const char* op, int64_t idx, int64_t dim, int64_t size) {
  EMBER_CHECK(false, op, ": index ", idx, " is out of bounds for dimension ", dim, " with size ", size);
  __builtin_unreachable();
}
}  // namespace

void index_select_cpu(const Tensor& in, const Tensor& index, Tensor& out, int64_t outer, int64_t src_size,
                      int64_t inner) {
  const int64_t n = index.numel();
  const int64_t* idx = index.data<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    if (idx[j] < -src_size || idx[j] >= src_size) index_error("index_select", idx[j], -1, src_size);
  const size_t es = in.element_size();
  const char* src = static_cast<const char*>(in.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  parallel_for(outer * n, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(inner, 1)), [&](int64_t b, int64_t e) {
    for (int64_t oj = b; oj < e; ++oj) {
      int64_t o = oj / n, j = oj % n;
      int64_t s = idx[j] < 0 ? idx[j] + src_size : idx[j];
      std::memcpy(dst + (oj * inner) * es, src + ((o * src_size + s) * inner) * es, inner * es);
    }
  });
}

void gather_cpu(const Tensor& in, const Tensor& index, Tensor& out, int64_t dim) {
  const int64_t nd = index.dim(), n = index.numel();
  const int64_t* idx = index.data<int64_t>();
  const Shape& isz = index.sizes();
  const Shape in_st = contiguous_strides(in.sizes());
  const int64_t dim_size = in.sizes()[dim];
  EMBER_DISPATCH_ALL(in.dtype(), "gather", [&] {
    const scalar_t* src = static_cast<const scalar_t*>(in.raw_data());
    scalar_t* dst = static_cast<scalar_t*>(out.raw_data());
    for (int64_t p = 0; p < n; ++p) {
      int64_t rem = p, off = 0;
      for (int64_t d = nd - 1; d >= 0; --d) {
        int64_t c = rem % isz[d];
        rem /= isz[d];
        if (d == dim) {
          int64_t v = idx[p];
          if (v < -dim_size || v >= dim_size) index_error("gather", v, dim, dim_size);
          c = v < 0 ? v + dim_size : v;
        }
        off += c * in_st[d];
      }
      dst[p] = src[off];
    }
  });
}

template <typename F>
void dispatch_f32_f64(DType t, F&& f) {
  if (t == DType::Float64) f(double{}); else f(float{});
}

void index_add_cpu(Tensor& out, const Tensor& index, const Tensor& src, int64_t outer, int64_t dst_size,
                   int64_t inner) {
  const int64_t n = index.numel();
  const int64_t* idx = index.data<int64_t>();
  EMBER_CHECK(out.dtype() == DType::Float32 || out.dtype() == DType::Float64, "index_add: expected float32/64");
  dispatch_f32_f64(out.dtype(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* dst = static_cast<scalar_t*>(out.raw_data());
    const scalar_t* s = static_cast<const scalar_t*>(src.raw_data());
    // Threads own disjoint column ranges, so repeated indices never race.
    parallel_for(inner, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(outer * n, 1)), [&](int64_t b, int64_t e) {
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t j = 0; j < n; ++j) {
          int64_t k = idx[j] < 0 ? idx[j] + dst_size : idx[j];
          scalar_t* drow = dst + (o * dst_size + k) * inner;
          const scalar_t* srow = s + (o * n + j) * inner;
          for (int64_t i = b; i < e; ++i) drow[i] += srow[i];
        }
    });
  });
}

void scatter_add_cpu(Tensor& out, const Tensor& index, const Tensor& src, int64_t dim) {
  const int64_t nd = index.dim(), n = index.numel();
  const int64_t* idx = index.data<int64_t>();
  const Shape& isz = index.sizes();
  const Shape out_st = contiguous_strides(out.sizes());
  const int64_t dim_size = out.sizes()[dim];
  EMBER_CHECK(out.dtype() == DType::Float32 || out.dtype() == DType::Float64, "scatter_add: expected float32/64");
  dispatch_f32_f64(out.dtype(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* dst = static_cast<scalar_t*>(out.raw_data());
    const scalar_t* s = static_cast<const scalar_t*>(src.raw_data());
    for (int64_t p = 0; p < n; ++p) {
      int64_t rem = p, off = 0;
      for (int64_t d = nd - 1; d >= 0; --d) {
        int64_t c = rem % isz[d];
        rem /= isz[d];
        if (d == dim) c = idx[p] < 0 ? idx[p] + dim_size : idx[p];
        off += c * out_st[d];
      }
      dst[off] += s[p];
    }
  });
}

// ---- Op layer ----
namespace {
// Accumulating kernels run in fp32 for 16-bit gradients (no 16-bit atomics
// on every GPU, and fewer rounding steps); the result is cast back.
DType accumulate_dtype(DType t) { return t == DType::Float64 ? DType::Float64 : DType::Float32; }

// d index_select / d x: zeros of x's shape with g's rows added at `index`.
Tensor index_add_grad(const Tensor& g, const Shape& xshape, int64_t dim, const Tensor& idx) {
  DType acc = accumulate_dtype(g.dtype());
  Tensor out = zeros(xshape, {acc, g.device()});
  Tensor src = g.to(acc).contiguous();
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= xshape[d];
  for (int64_t d = dim + 1; d < static_cast<int64_t>(xshape.size()); ++d) inner *= xshape[d];
  if (src.numel() > 0) {
    if (g.is_cuda()) index_add_cuda(out, idx, src, outer, xshape[dim], inner);
    else index_add_cpu(out, idx, src, outer, xshape[dim], inner);
  }
  return out.to(g.dtype());
}

Tensor scatter_add_grad(const Tensor& g, const Shape& xshape, int64_t dim, const Tensor& idx) {
  DType acc = accumulate_dtype(g.dtype());
  Tensor out = zeros(xshape, {acc, g.device()});
  Tensor src = g.to(acc).contiguous();
  if (src.numel() > 0) {
    if (g.is_cuda()) scatter_add_cuda(out, idx, src, dim); else scatter_add_cpu(out, idx, src, dim);
  }
  return out.to(g.dtype());
}
}  // namespace

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  EMBER_CHECK(!tensors.empty(), "cat: expected a non-empty list of tensors");
  const Tensor& first = tensors[0];
  dim = wrap_dim(dim, first.dim(), "cat");
  EMBER_CHECK(first.dim() > 0, "cat: zero-dimensional tensors cannot be concatenated");
  DType dtype = first.dtype();
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    EMBER_CHECK(t.defined(), "cat: tensor ", i, " is undefined");
    EMBER_CHECK(t.device() == first.device(), "cat: tensor ", i, " is on ", t.device(), ", tensor 0 on ",
                first.device());
    EMBER_CHECK(t.dim() == first.dim(), "cat: tensor ", i, " ", shape_str(t.sizes()), " and tensor 0 ",
                shape_str(first.sizes()), " have different numbers of dims");
    for (int64_t d = 0; d < t.dim(); ++d)
      EMBER_CHECK(d == dim || t.sizes()[d] == first.sizes()[d], "cat: sizes of tensors must match except in dim ",
                  dim, ": tensor ", i, " is ", shape_str(t.sizes()), ", tensor 0 is ", shape_str(first.sizes()));
    dtype = promote_types(dtype, t.dtype());
    total += t.sizes()[dim];
  }
  Shape shape = first.sizes();
  shape[dim] = total;
  return differentiable("cat", tensors, [&] {
    Tensor out = Tensor::empty(shape, {dtype, first.device()});
    int64_t pos = 0;
    for (const Tensor& t : tensors) {
      int64_t len = t.sizes()[dim];
      if (len > 0) out.narrow(dim, pos, len).copy_(t);
      pos += len;
    }
    return out;
  }, [&](const Tensor&) {
    std::vector<int64_t> lens;
    std::vector<DType> dtypes;
    for (const Tensor& t : tensors) { lens.push_back(t.sizes()[dim]); dtypes.push_back(t.dtype()); }
    BackwardFn fn = [=](const Tensor& g) {
      std::vector<Tensor> grads;
      int64_t pos = 0;
      for (size_t i = 0; i < lens.size(); ++i) {
        grads.push_back(g.narrow(dim, pos, lens[i]).to(dtypes[i]));
        pos += lens[i];
      }
      return grads;
    };
    return Recorded{fn, {}};
  });
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  EMBER_CHECK(!tensors.empty(), "stack: expected a non-empty list of tensors");
  dim = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    EMBER_CHECK(tensors[i].sizes() == tensors[0].sizes(), "stack: tensor ", i, " has shape ",
                shape_str(tensors[i].sizes()), " but tensor 0 has ", shape_str(tensors[0].sizes()));
    parts.push_back(tensors[i].unsqueeze(dim));
  }
  return cat(parts, dim);
}

namespace {
void check_index(const Tensor& x, const Tensor& index, const char* op) {
  EMBER_CHECK(x.defined() && index.defined(), op, ": an input is undefined");
  EMBER_CHECK(index.dtype() == DType::Int64 || index.dtype() == DType::Int32, op, ": index must be int64 or int32, got ",
              index.dtype());
  EMBER_CHECK(index.device() == x.device(), op, ": index is on ", index.device(), " but input is on ", x.device());
}
}  // namespace

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  check_index(x, index, "index_select");
  EMBER_CHECK(index.dim() <= 1, "index_select: index must be 0-d or 1-d, got ", shape_str(index.sizes()));
  if (x.dim() == 0) return index_select(x.reshape({1}), 0, index).reshape(index.dim() ? Shape{index.numel()} : Shape{});
  dim = wrap_dim(dim, x.dim(), "index_select");
  Tensor in = x.contiguous();
  Tensor idx = index.to(DType::Int64).contiguous();
  Shape shape = x.sizes();
  shape[dim] = idx.numel();
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x.sizes()[d];
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.sizes()[d];
  return differentiable("index_select", {x}, [&] {
    Tensor out = Tensor::empty(shape, x.options());
    if (out.numel() == 0) return out;
    if (x.is_cuda()) index_select_cuda(in, idx, out, outer, x.sizes()[dim], inner);
    else index_select_cpu(in, idx, out, outer, x.sizes()[dim], inner);
    return out;
  }, [&](const Tensor&) {
    Shape xs = x.sizes();
    Tensor ids = idx;
    BackwardFn fn = [=](const Tensor& g) { return std::vector<Tensor>{index_add_grad(g, xs, dim, ids)}; };
    return Recorded{fn, {ids}};
  });
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  check_index(x, index, "gather");
  if (x.dim() == 0 && index.dim() == 0) return gather(x.reshape({1}), 0, index.reshape({1})).reshape({});
  EMBER_CHECK(index.dim() == x.dim(), "gather: index ", shape_str(index.sizes()), " and input ",
              shape_str(x.sizes()), " must have the same number of dims");
  dim = wrap_dim(dim, x.dim(), "gather");
  for (int64_t d = 0; d < x.dim(); ++d)
    EMBER_CHECK(d == dim || index.sizes()[d] <= x.sizes()[d], "gather: index ", shape_str(index.sizes()),
                " is larger than input ", shape_str(x.sizes()), " in dim ", d);
  Tensor in = x.contiguous();
  Tensor idx = index.to(DType::Int64).contiguous();
  return differentiable("gather", {x}, [&] {
    Tensor out = Tensor::empty(index.sizes(), x.options());
    if (out.numel() == 0) return out;
    if (x.is_cuda()) gather_cuda(in, idx, out, dim); else gather_cpu(in, idx, out, dim);
    return out;
  }, [&](const Tensor&) {
    Shape xs = x.sizes();
    Tensor ids = idx;
    BackwardFn fn = [=](const Tensor& g) { return std::vector<Tensor>{scatter_add_grad(g, xs, dim, ids)}; };
    return Recorded{fn, {ids}};
  });
}

Tensor& scatter_add_(Tensor& out, int64_t dim_in, const Tensor& index, const Tensor& src) {
  EMBER_CHECK(out.defined() && index.defined() && src.defined(), "scatter_add_: out, index and src must be defined");
  const int64_t dim = wrap_dim(dim_in, out.dim(), "scatter_add_");
  EMBER_CHECK(index.dtype() == DType::Int64, "scatter_add_: index must be int64, got ", index.dtype());
  EMBER_CHECK(index.sizes() == src.sizes() && index.dim() == out.dim(), "scatter_add_: index ",
              shape_str(index.sizes()), " and src ", shape_str(src.sizes()), " must have one shape, with out's ",
              out.dim(), " dims");
  for (int64_t d = 0; d < out.dim(); ++d)
    EMBER_CHECK(d == dim || index.size(d) <= out.size(d), "scatter_add_: index ", shape_str(index.sizes()),
                " exceeds out ", shape_str(out.sizes()), " in dim ", d);
  EMBER_CHECK(out.is_contiguous() && (out.dtype() == DType::Float32 || out.dtype() == DType::Float64) &&
                  src.dtype() == out.dtype(),
              "scatter_add_: out must be contiguous float32/float64 and src of its dtype, got out ", out.dtype(),
              ", src ", src.dtype());
  EMBER_CHECK(out.device() == index.device() && out.device() == src.device(), "scatter_add_: out on ", out.device(),
              ", index on ", index.device(), ", src on ", src.device());
  check_index_range(index, -out.size(dim), out.size(dim), "scatter_add_");
  check_inplace(out, "scatter_add_");
  if (src.numel() == 0) return out;
  const Tensor ids = index.contiguous(), s = src.contiguous();
  if (out.is_cuda())
    scatter_add_cuda(out, ids, s, dim);
  else
    scatter_add_cpu(out, ids, s, dim);
  return out;
}

Tensor one_hot(const Tensor& indices, int64_t num_classes) {
  EMBER_CHECK(indices.defined(), "one_hot: input is undefined");
  EMBER_CHECK(indices.dtype() == DType::Int64 || indices.dtype() == DType::Int32, "one_hot: expected integer class ",
              "indices, got ", indices.dtype());
  if (num_classes < 0) {
    EMBER_CHECK(indices.numel() > 0, "one_hot: cannot infer num_classes from an empty tensor");
    num_classes = static_cast<int64_t>(max(indices).item()) + 1;
  }
  // On the GPU the range is checked there (the device error slot), not
  // read back: a given num_classes costs no wait, so one_hot can run inside
  // a captured step (the vocabulary-parallel loss's backward).
  check_index_range(indices, 0, num_classes, "one_hot");
  Tensor classes = arange(0.0, static_cast<double>(num_classes), 1.0, {indices.dtype(), indices.device()});
  return eq(indices.unsqueeze(-1), classes).to(DType::Int64);
}

void check_index_range(const Tensor& indices, int64_t lo, int64_t hi, const char* op) {
  EMBER_CHECK(indices.defined(), op, ": indices are undefined");
  EMBER_CHECK(indices.dtype() == DType::Int64 || indices.dtype() == DType::Int32, op,
              ": indices must be int64 or int32, got ", indices.dtype());
  if (indices.numel() == 0) return;
  if (indices.is_cuda()) {
    check_index_range_cuda(indices, lo, hi, op);
    return;
  }
  const int64_t mn = static_cast<int64_t>(min(indices).item()), mx = static_cast<int64_t>(max(indices).item());
  EMBER_CHECK(mn >= lo && mx < hi, op, ": values must be in [", lo, ", ", hi, "), got [", mn, ", ", mx, "]");
}

}  // namespace ember
