// grouped_mm (ops_nn.h): with group sizes on the host, one GEMM per group
// of rows, each on the matmul backends (matmul.cc's gemm_cpu / gemm_cuda),
// the same loop on the CPU and CUDA. A group of no rows costs nothing (its
// weight gradient is zero). On CUDA each group is one cuBLAS call on the
// current stream. With the groups as offsets on the device, 16-bit CUDA
// operands take grouped_matmul.cu's kernels (one launch a product, nothing
// read back); the rest reads the offsets and takes the loop. And
// group_order, the counting sort that makes those offsets for a mixture of
// experts: the host loop here, grouped_matmul.cu's kernel on CUDA.
#include <cstdint>
#include <functional>
#include <numeric>
#include <string>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/cuda_graph.h"
#include "core/ops.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"

namespace ember {
namespace {

// The three products of a grouped GEMM, all on contiguous operands:
//   Forward  c_g [n_g, M] = a_g [n_g, K] b[g]^T     (b [G, M, K])
//   Input    c_g [n_g, K] = a_g [n_g, M] b[g]        (b [G, M, K])
//   Weight   c[g] [M, K]  = a_g^T [M, n_g] b_g [n_g, K]  (a [N, M], b [N, K])
enum class Product { Forward, Input, Weight };

// 16-bit CPU operands are widened to float32 around the loop (a per-group
// oneDNN 16-bit matmul would be one primitive per group shape).
bool widen_on_cpu(const Tensor& t) {
  return !t.is_cuda() && (t.dtype() == DType::Float16 || t.dtype() == DType::BFloat16);
}

Tensor grouped_gemm(const Tensor& a_in, const Tensor& b_in, const std::vector<int64_t>& sizes, Product p) {
  if (widen_on_cpu(a_in))
    return grouped_gemm(a_in.to(DType::Float32), b_in.to(DType::Float32), sizes, p).to(a_in.dtype());
  const Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const int64_t G = static_cast<int64_t>(sizes.size());
  const size_t es = a.element_size();
  Tensor out;
  if (p == Product::Forward) out = Tensor::empty({a.sizes()[0], b.sizes()[1]}, a.options());
  if (p == Product::Input) out = Tensor::empty({a.sizes()[0], b.sizes()[2]}, a.options());
  if (p == Product::Weight) out = zeros({G, a.sizes()[1], b.sizes()[1]}, a.options());
  const char* pa = static_cast<const char*>(a.raw_data());
  const char* pb = static_cast<const char*>(b.raw_data());
  char* pc = static_cast<char*>(out.raw_data());
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = sizes[g];
    if (n == 0) continue;
    GemmArgs args{a.dtype(), 1, 0, 0, 0, false, false, nullptr, 0, 0, nullptr, 0, 0, nullptr, 0, 0};
    if (p == Product::Forward) {  // [n, K] x [M, K]^T
      const int64_t K = a.sizes()[1], M = b.sizes()[1];
      args = {a.dtype(),         1, n, M, K, false, true, pa + row * K * es, K, 0, pb + g * M * K * es, K, 0,
              pc + row * M * es, M, 0};
    } else if (p == Product::Input) {  // [n, M] x [M, K]
      const int64_t M = a.sizes()[1], K = b.sizes()[2];
      args = {a.dtype(),         1, n, K, M, false, false, pa + row * M * es, M, 0, pb + g * M * K * es, K, 0,
              pc + row * K * es, K, 0};
    } else {  // [n, M]^T x [n, K]
      const int64_t M = a.sizes()[1], K = b.sizes()[1];
      args = {a.dtype(),           1, M, K, n, true, false, pa + row * M * es, M, 0, pb + row * K * es, K, 0,
              pc + g * M * K * es, K, 0};
    }
    if (a.is_cuda()) {
      gemm_cuda(args, a.device().index);
    } else {
      gemm_cpu(args);
    }
    row += n;
  }
  return out;
}

// The checks both forms share: x [N, K], w [G, M, K], one device and dtype.
void check_operands(const Tensor& x, const Tensor& w) {
  EMBER_CHECK(x.defined() && w.defined(), "grouped_mm: an input is undefined");
  EMBER_CHECK(x.dim() == 2 && w.dim() == 3, "grouped_mm: expected x [N, K] and w [G, M, K], got ", shape_str(x.sizes()),
              " and ", shape_str(w.sizes()));
  EMBER_CHECK(x.device() == w.device(), "grouped_mm: x ", shape_str(x.sizes()), " on ", x.device(), " and w ",
              shape_str(w.sizes()), " on ", w.device(), ": tensors must be on the same device");
  EMBER_CHECK(x.dtype() == w.dtype(), "grouped_mm: x is ", x.dtype(), " and w ", w.dtype(), ": dtypes differ");
  EMBER_CHECK(is_floating(x.dtype()), "grouped_mm: ", x.dtype(), " is not a floating dtype");
  EMBER_CHECK(x.sizes()[1] == w.sizes()[2], "grouped_mm: x ", shape_str(x.sizes()), " x w ", shape_str(w.sizes()),
              ": inner dimensions ", x.sizes()[1], " and ", w.sizes()[2], " differ");
}

// The host's group sizes from device offsets (a wait on CUDA), checked.
std::vector<int64_t> sizes_of(const Tensor& offsets, const Tensor& x, const Tensor& w) {
  EMBER_CHECK(!offsets.is_cuda() || !cuda_graph_capturing(), "grouped_mm: ", dtype_name(x.dtype()), " x ",
              shape_str(x.sizes()), " and w ", shape_str(w.sizes()),
              " take the per-group loop, which reads the group offsets on the host: not inside a CUDA graph capture "
              "(bf16 or fp16 operands whose K and M are multiples of 8 run on the device)");
  const int64_t rows = x.sizes()[0];
  const Tensor o = offsets.to(kCPU).contiguous();
  std::vector<int64_t> sizes;
  int64_t prev = 0;
  for (int64_t g = 0; g < o.numel(); ++g) {
    const int64_t end = o.data<int64_t>()[g];
    EMBER_CHECK(end >= prev && end <= rows, "grouped_mm: group offsets must be non-decreasing row ends in [0, ", rows,
                "]; group ", g, " ends at ", end, " after ", prev);
    sizes.push_back(end - prev);
    prev = end;
  }
  EMBER_CHECK(prev == rows, "grouped_mm: the group offsets end at ", prev, " but x has ", rows, " rows");
  return sizes;
}

// 16-byte aligned (the kernels copy 16 bytes at a time): a view at an odd
// offset is copied.
Tensor aligned(const Tensor& t) {
  const Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.raw_data()) % 16 == 0 ? c : c.clone();
}

// One product on the device (grouped_matmul.cu), shapes as grouped_gemm's.
Tensor grouped_gemm_device(const Tensor& a_in, const Tensor& b_in, const Tensor& offsets, Product p) {
  const Tensor a = aligned(a_in), b = aligned(b_in);
  const int64_t N = a.sizes()[0];
  Tensor out;
  if (p == Product::Forward) out = Tensor::empty({N, b.sizes()[1]}, a.options());
  if (p == Product::Input) out = Tensor::empty({N, b.sizes()[2]}, a.options());
  if (p == Product::Weight) {
    if (N == 0) return zeros({offsets.numel(), a.sizes()[1], b.sizes()[1]}, a.options());
    out = Tensor::empty({offsets.numel(), a.sizes()[1], b.sizes()[1]}, a.options());
  }
  if (out.numel() == 0) return out;
  grouped_gemm_offsets_cuda(static_cast<int>(p), a, b, offsets, out);
  return out;
}

// The op with its own derivative, each product by `gemm` (the host loop or
// the device kernels); `offsets` (if any) kept with the saved tensors.
using GroupedGemm = std::function<Tensor(const Tensor& a, const Tensor& b, Product p)>;
Tensor grouped_op(const Tensor& x, const Tensor& w, const GroupedGemm& gemm, const Tensor& offsets) {
  return differentiable(
      "grouped_mm", {x, w}, [&] { return gemm(x, w, Product::Forward); },
      [&](const Tensor&) {
        Tensor sx = x, sw = w;
        const bool gx_ = x.requires_grad(), gw_ = w.requires_grad();
        BackwardFn fn = [=](const Tensor& g) {
          std::vector<Tensor> grads(2);
          if (gx_ && grad_wanted(0)) grads[0] = gemm(g, sw, Product::Input);
          if (gw_ && grad_wanted(1)) grads[1] = gemm(g, sx, Product::Weight);
          return grads;
        };
        std::vector<Tensor> saved{sx, sw};
        if (offsets.defined()) saved.push_back(offsets);
        return Recorded{fn, saved};
      });
}

}  // namespace

Tensor grouped_mm(const Tensor& x, const Tensor& w, const std::vector<int64_t>& group_sizes) {
  if (Tensor lx = autocast::low(x), lw = autocast::low(w); !lx.is_same(x) || !lw.is_same(w))
    return grouped_mm(lx, lw, group_sizes);
  check_operands(x, w);
  EMBER_CHECK(static_cast<int64_t>(group_sizes.size()) == w.sizes()[0], "grouped_mm: ", group_sizes.size(),
              " group sizes for w ", shape_str(w.sizes()), " with ", w.sizes()[0], " groups");
  int64_t total = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    EMBER_CHECK(group_sizes[g] >= 0, "grouped_mm: group ", g, " has size ", group_sizes[g]);
    total += group_sizes[g];
  }
  EMBER_CHECK(total == x.sizes()[0], "grouped_mm: the group sizes sum to ", total, " rows but x ", shape_str(x.sizes()),
              " has ", x.sizes()[0]);
  const std::vector<int64_t> sizes = group_sizes;
  return grouped_op(x, w, [sizes](const Tensor& a, const Tensor& b, Product p) { return grouped_gemm(a, b, sizes, p); },
                    {});
}

Tensor grouped_mm(const Tensor& x, const Tensor& w, const Tensor& offsets) {
  if (Tensor lx = autocast::low(x), lw = autocast::low(w); !lx.is_same(x) || !lw.is_same(w))
    return grouped_mm(lx, lw, offsets);
  check_operands(x, w);
  EMBER_CHECK(
      offsets.defined() && offsets.dtype() == DType::Int64 && offsets.dim() == 1 && offsets.numel() == w.sizes()[0],
      "grouped_mm: offsets must be int64 [", w.sizes()[0], "] (a row end per group of w ", shape_str(w.sizes()),
      "), got ", offsets.defined() ? shape_str(offsets.sizes()) : "undefined", " ",
      offsets.defined() ? dtype_name(offsets.dtype()) : "");
  EMBER_CHECK(offsets.device() == x.device(), "grouped_mm: offsets on ", offsets.device(), " and x on ", x.device(),
              ": the offsets must be on x's device");
  const bool device = x.is_cuda() && (x.dtype() == DType::BFloat16 || x.dtype() == DType::Float16) &&
                      x.sizes()[1] % 8 == 0 && w.sizes()[1] % 8 == 0;
  if (!device) return grouped_mm(x, w, sizes_of(offsets, x, w));
  EMBER_CHECK(w.sizes()[0] > 0 || x.sizes()[0] == 0, "grouped_mm: x ", shape_str(x.sizes()), " has rows but w ",
              shape_str(w.sizes()), " no group to take them");
  const Tensor offs = offsets.contiguous();
  return grouped_op(
      x, w, [offs](const Tensor& a, const Tensor& b, Product p) { return grouped_gemm_device(a, b, offs, p); }, offs);
}

GroupOrder group_order(const Tensor& ids, int64_t groups) {
  EMBER_CHECK(ids.defined() && ids.dtype() == DType::Int64 && ids.dim() == 2,
              "group_order: ids must be int64 [rows, choices], got ",
              ids.defined() ? shape_str(ids.sizes()) + " " + dtype_name(ids.dtype()) : std::string("undefined"));
  EMBER_CHECK(groups >= 1, "group_order: ", groups, " groups (at least 1)");
  const Tensor id = ids.contiguous();
  const int64_t n = id.sizes()[0], k = id.sizes()[1], items = n * k;
  const TensorOptions opts{DType::Int64, id.device()};
  GroupOrder o{Tensor::empty({items}, opts), Tensor::empty({n, k}, opts), Tensor::empty({groups}, opts)};
  if (id.is_cuda()) {
    group_order_cuda(id, groups, o.rows, o.positions, o.offsets);
    return o;
  }
  check_index_range(id, 0, groups, "group_order");
  const int64_t* ch = id.data<int64_t>();
  std::vector<int64_t> start(static_cast<size_t>(groups), 0);
  for (int64_t i = 0; i < items; ++i) ++start[static_cast<size_t>(ch[i])];
  int64_t* offs = o.offsets.data<int64_t>();
  int64_t total = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = start[static_cast<size_t>(g)];
    start[static_cast<size_t>(g)] = total;
    total += count;
    offs[g] = total;
  }
  int64_t* rows = o.rows.data<int64_t>();
  int64_t* pos = o.positions.data<int64_t>();
  for (int64_t i = 0; i < items; ++i) {  // i = row k + choice, in order: a stable sort
    const int64_t at = start[static_cast<size_t>(ch[i])]++;
    rows[at] = i / k;
    pos[i] = at;
  }
  return o;
}

}  // namespace ember
