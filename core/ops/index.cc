// Joining and indexing: cat, stack, index_select, gather, one_hot. cat and
// stack are copies into narrowed views of the output; index_select and
// gather have CPU kernels here and CUDA kernels in index.cu.
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

// ---- Op layer ----
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
  Tensor out = Tensor::empty(shape, {dtype, first.device()});
  int64_t pos = 0;
  for (const Tensor& t : tensors) {
    int64_t len = t.sizes()[dim];
    if (len > 0) out.narrow(dim, pos, len).copy_(t);
    pos += len;
  }
  return out;
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
  Tensor out = Tensor::empty(shape, x.options());
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x.sizes()[d];
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.sizes()[d];
  if (out.numel() == 0) return out;
  if (x.is_cuda()) index_select_cuda(in, idx, out, outer, x.sizes()[dim], inner);
  else index_select_cpu(in, idx, out, outer, x.sizes()[dim], inner);
  return out;
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
  Tensor out = Tensor::empty(index.sizes(), x.options());
  if (out.numel() == 0) return out;
  if (x.is_cuda()) gather_cuda(in, idx, out, dim); else gather_cpu(in, idx, out, dim);
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
  if (indices.numel() > 0) {
    int64_t lo = static_cast<int64_t>(min(indices).item()), hi = static_cast<int64_t>(max(indices).item());
    EMBER_CHECK(lo >= 0 && hi < num_classes, "one_hot: class values must be in [0, ", num_classes, "), got [", lo,
                ", ", hi, "]");
  }
  Tensor classes = arange(0.0, static_cast<double>(num_classes), 1.0, {indices.dtype(), indices.device()});
  return eq(indices.unsqueeze(-1), classes).to(DType::Int64);
}

}  // namespace ember
