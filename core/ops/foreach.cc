// Ops over a list of tensors in one go (torch's _foreach_norm and
// _foreach_mul_): gradient clipping visits every parameter's gradient
// twice a step, and one small kernel per gradient and op cost a GPT step on
// an H200 about 600 launches. The list is cut into chunks of kChunk
// elements (chunk i: tensor, first element), the same table for both
// backends; the CUDA kernels run one block per chunk (foreach.cu), the sums
// of a tensor's chunks are added in chunk order (deterministic). Neither
// backend copies a table to the device nor waits for it: a CUDA graph
// captures them (clip_grad_norm_async_ inside a captured step).
#include <cmath>
#include <vector>

#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/kernels.h"

namespace ember {
namespace {

void check_list(const char* op, const std::vector<Tensor>& ts) {
  EMBER_CHECK(!ts.empty(), op, ": expected at least one tensor");
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    EMBER_CHECK(t.defined(), op, ": tensor ", i, " is undefined");
    EMBER_CHECK(t.dtype() == ts[0].dtype() && t.device() == ts[0].device(), op, ": tensor ", i, " is ", t.dtype(),
                " on ", t.device(), ", tensor 0 ", ts[0].dtype(), " on ", ts[0].device(),
                "; one dtype and device per call");
    EMBER_CHECK(t.dtype() == DType::Float32 || t.dtype() == DType::Float64, op,
                ": float32 or float64 tensors only, got ", t.dtype(), " (tensor ", i, ")");
  }
}

}  // namespace

ForeachTable foreach_table(const std::vector<Tensor>& ts) {
  ForeachTable tab;
  for (size_t i = 0; i < ts.size(); ++i) {
    tab.ptrs.push_back(const_cast<void*>(ts[i].raw_data()));
    tab.numel.push_back(ts[i].numel());
    tab.first_chunk.push_back(static_cast<int64_t>(tab.chunks.size()));
    for (int64_t s = 0; s < ts[i].numel(); s += ForeachTable::kChunk)
      tab.chunks.push_back({static_cast<int64_t>(i), s});
  }
  tab.first_chunk.push_back(static_cast<int64_t>(tab.chunks.size()));
  return tab;
}

void foreach_sum_squares_cpu(const ForeachTable& tab, DType dt, Tensor& out) {
  std::vector<double> partial(tab.chunks.size());
  parallel_for(static_cast<int64_t>(tab.chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const auto [t, s] = tab.chunks[c];
      const int64_t n = std::min(tab.numel[t] - s, ForeachTable::kChunk);
      double acc = 0;
      if (dt == DType::Float64) {
        const double* p = static_cast<const double*>(tab.ptrs[t]) + s;
        for (int64_t i = 0; i < n; ++i) acc += p[i] * p[i];
      } else {
        const float* p = static_cast<const float*>(tab.ptrs[t]) + s;
        for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(p[i]) * p[i];
      }
      partial[c] = acc;
    }
  });
  double* o = out.data<double>();
  for (size_t t = 0; t < tab.numel.size(); ++t) {
    double acc = 0;
    for (int64_t c = tab.first_chunk[t]; c < tab.first_chunk[t + 1]; ++c) acc += partial[c];
    o[t] = acc;
  }
}

void foreach_mul_cpu(const ForeachTable& tab, DType dt, double factor) {
  parallel_for(static_cast<int64_t>(tab.chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const auto [t, s] = tab.chunks[c];
      const int64_t n = std::min(tab.numel[t] - s, ForeachTable::kChunk);
      if (dt == DType::Float64) {
        double* p = static_cast<double*>(tab.ptrs[t]) + s;
        for (int64_t i = 0; i < n; ++i) p[i] *= factor;
      } else {
        float* p = static_cast<float*>(tab.ptrs[t]) + s;
        const float f = static_cast<float>(factor);
        for (int64_t i = 0; i < n; ++i) p[i] *= f;
      }
    }
  });
}

Tensor foreach_sum_squares(const std::vector<Tensor>& tensors) {
  check_list("foreach_sum_squares", tensors);
  std::vector<Tensor> ts;
  for (const Tensor& t : tensors) ts.push_back(t.is_dense() ? t : t.contiguous());  // order does not matter
  const ForeachTable tab = foreach_table(ts);
  Tensor out = Tensor::empty({static_cast<int64_t>(ts.size())}, {DType::Float64, ts[0].device()});
  if (ts[0].is_cuda())
    foreach_sum_squares_cuda(tab, ts[0].dtype(), out);
  else
    foreach_sum_squares_cpu(tab, ts[0].dtype(), out);
  return out;
}

namespace {

// factor_t: null, or a one-element tensor on the tensors' device.
void mul_list(const std::vector<Tensor>& tensors, double factor, const Tensor* factor_t) {
  check_list("foreach_mul_", tensors);
  for (size_t i = 0; i < tensors.size(); ++i)
    EMBER_CHECK(tensors[i].is_dense(), "foreach_mul_: tensor ", i, " ", shape_str(tensors[i].sizes()),
                " is neither contiguous nor channels-last (in place needs its own elements)");
  const ForeachTable tab = foreach_table(tensors);
  if (tensors[0].is_cuda()) {
    Tensor f;  // float64 on the device, made there (no host copy)
    if (factor_t) f = factor_t->to(DType::Float64).contiguous();
    foreach_mul_cuda(tab, tensors[0].dtype(), factor, f.defined() ? f.data<double>() : nullptr,
                     tensors[0].device().index);
  } else {
    foreach_mul_cpu(tab, tensors[0].dtype(), factor_t ? factor_t->item() : factor);
  }
  for (const Tensor& t : tensors) t.impl().storage->bump_version("foreach_mul_");
}

}  // namespace

void foreach_mul_(const std::vector<Tensor>& tensors, double factor) { mul_list(tensors, factor, nullptr); }

void foreach_mul_(const std::vector<Tensor>& tensors, const Tensor& factor) {
  EMBER_CHECK(factor.defined() && factor.numel() == 1, "foreach_mul_: the factor must be a one-element tensor, got ",
              factor.defined() ? shape_str(factor.sizes()) : "an undefined tensor");
  EMBER_CHECK(tensors.empty() || factor.device() == tensors[0].device(), "foreach_mul_: the factor is on ",
              factor.device(), ", the tensors on ", tensors[0].device(), " (it is read where they are)");
  EMBER_CHECK(factor.dtype() == DType::Float32 || factor.dtype() == DType::Float64,
              "foreach_mul_: the factor must be float32 or float64, got ", factor.dtype());
  mul_list(tensors, 0.0, &factor);
}

}  // namespace ember
