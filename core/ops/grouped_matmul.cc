// grouped_mm (ops_nn.h): one GEMM per group of rows, each on the matmul
// backends (matmul.cc's gemm_cpu / gemm_cuda), so there is no kernel of its
// own here and the CPU and CUDA paths are the same loop. A group of no rows
// costs nothing (its weight gradient is zero). On CUDA each group is one
// cuBLAS call on the current stream; cublasGemmGroupedBatchedEx would make
// the forward one launch when the group count grows (//bench:step_counts
// counts them).
#include <numeric>
#include <string>

#include "core/autocast.h"
#include "core/autograd_hook.h"
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

}  // namespace

Tensor grouped_mm(const Tensor& x, const Tensor& w, const std::vector<int64_t>& group_sizes) {
  if (Tensor lx = autocast::low(x), lw = autocast::low(w); !lx.is_same(x) || !lw.is_same(w))
    return grouped_mm(lx, lw, group_sizes);
  EMBER_CHECK(x.defined() && w.defined(), "grouped_mm: an input is undefined");
  EMBER_CHECK(x.dim() == 2 && w.dim() == 3, "grouped_mm: expected x [N, K] and w [G, M, K], got ", shape_str(x.sizes()),
              " and ", shape_str(w.sizes()));
  EMBER_CHECK(x.device() == w.device(), "grouped_mm: x ", shape_str(x.sizes()), " on ", x.device(), " and w ",
              shape_str(w.sizes()), " on ", w.device(), ": tensors must be on the same device");
  EMBER_CHECK(x.dtype() == w.dtype(), "grouped_mm: x is ", x.dtype(), " and w ", w.dtype(), ": dtypes differ");
  EMBER_CHECK(is_floating(x.dtype()), "grouped_mm: ", x.dtype(), " is not a floating dtype");
  EMBER_CHECK(x.sizes()[1] == w.sizes()[2], "grouped_mm: x ", shape_str(x.sizes()), " x w ", shape_str(w.sizes()),
              ": inner dimensions ", x.sizes()[1], " and ", w.sizes()[2], " differ");
  EMBER_CHECK(static_cast<int64_t>(group_sizes.size()) == w.sizes()[0], "grouped_mm: ", group_sizes.size(),
              " group sizes for w ", shape_str(w.sizes()), " with ", w.sizes()[0], " groups");
  int64_t total = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    EMBER_CHECK(group_sizes[g] >= 0, "grouped_mm: group ", g, " has size ", group_sizes[g]);
    total += group_sizes[g];
  }
  EMBER_CHECK(total == x.sizes()[0], "grouped_mm: the group sizes sum to ", total, " rows but x ", shape_str(x.sizes()),
              " has ", x.sizes()[0]);
  return differentiable(
      "grouped_mm", {x, w}, [&] { return grouped_gemm(x, w, group_sizes, Product::Forward); },
      [&](const Tensor&) {
        Tensor sx = x, sw = w;
        const std::vector<int64_t> sizes = group_sizes;
        const bool gx_ = x.requires_grad(), gw_ = w.requires_grad();
        BackwardFn fn = [=](const Tensor& g) {
          std::vector<Tensor> grads(2);
          if (gx_ && grad_wanted(0)) grads[0] = grouped_gemm(g, sw, sizes, Product::Input);
          if (gw_ && grad_wanted(1)) grads[1] = grouped_gemm(g, sx, sizes, Product::Weight);
          return grads;
        };
        return Recorded{fn, {sx, sw}};
      });
}

}  // namespace ember
