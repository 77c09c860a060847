// CUDA launchers for the fused optimizer steps: one multi-tensor-apply
// kernel launch covers every parameter of a device and dtype. Each tensor is
// cut into fixed-size chunks; block b takes chunks b, b + grid, ... and finds
// its tensor by binary search over the tensors' first-chunk numbers, so the
// launch needs no per-block table. The tensor table (pointers, sizes) rides
// in the kernel's parameter space while it fits (sm_70+ allows 32 KB of
// parameters since CUDA 12.1), which costs no copy and no synchronisation;
// a larger model's table goes to a device buffer in one async copy, still a
// single launch. The per-element math is optim_fns (core/ops_optim.h), shared
// with the CPU kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "core/ops.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops_optim.h"

namespace ember {
namespace {

using cuda::VecN;

constexpr int kMaxDepth = 6;            // param, grad, up to three state tensors, a master's 16-bit parameter
constexpr int64_t kChunk = 16384;       // elements per block visit: 64 per thread
constexpr int kArgEntries = 384;        // 384 * 80 B = 30 KB of kernel parameters

struct TensorEntry {
  void* ptr[kMaxDepth];
  int64_t numel;
  int64_t chunk_begin;  // first global chunk number of this tensor
  float* step;          // Adam with device step counts: this tensor's count (else null)
  bool init;            // SGD: new momentum buffer (torch's first-step clone)
  bool aligned;         // every operand 16-byte aligned: vector loads allowed
};

struct ArgTable {
  TensorEntry e[kArgEntries];
};
// CUDA's limit on a launch's parameters is 32764 bytes; the table's
// neighbours (counts and the step's functor) take at most a few hundred.
static_assert(sizeof(ArgTable) + 1024 <= 32764, "the multi-tensor table outgrew a launch's parameters");

// The tensor owning global chunk c: the last entry whose first chunk is <= c.
__device__ __forceinline__ int find_tensor(const TensorEntry* entries, int n, int64_t c) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (entries[mid].chunk_begin <= c) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Applies the per-tensor functor f.at(entry) to every element, x[o] the
// element of operand o in compute type C. Operand 1 (the gradient) is of
// type G (T, or a master's 16-bit parameter's type), read-only and not
// stored; the others are T. With LOW, operand 0 is the float32 master of the
// 16-bit parameter in the entry's operand DEPTH: re-seeded from it before f
// (optim_fns::master_value) and written to it, rounded, after. Nothing at
// all when f.skip() (found_inf).
template <typename T, int DEPTH, typename F, typename G = T, bool LOW = false>
__device__ __forceinline__ void multi_tensor_apply(const TensorEntry* entries, int ntensors, int64_t nchunks,
                                                   const F& f) {
  using C = acc_t<T>;
  constexpr int VEC = cuda::vec_width<T>();
  if (f.skip()) return;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const TensorEntry& e = entries[find_tensor(entries, ntensors, c)];
    const int64_t start = (c - e.chunk_begin) * kChunk;
    const int64_t n = e.numel - start < kChunk ? e.numel - start : kChunk;
    const auto g = f.at(e);
    T* ptr[DEPTH];
#pragma unroll
    for (int o = 0; o < DEPTH; ++o) ptr[o] = o == 1 ? nullptr : static_cast<T*>(e.ptr[o]) + start;  // 1: `grad`
    const G* grad = DEPTH > 1 ? static_cast<const G*>(e.ptr[1]) + start : nullptr;
    G* low = LOW ? static_cast<G*>(e.ptr[DEPTH]) + start : nullptr;
    int64_t done = 0;
    if (e.aligned) {
      const int64_t nvec = n / VEC;
      for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
        VecN<T, VEC> r[DEPTH];
        VecN<G, VEC> rg, rl;
#pragma unroll
        for (int o = 0; o < DEPTH; ++o)
          if (o != 1) r[o] = reinterpret_cast<const VecN<T, VEC>*>(ptr[o])[v];
        if constexpr (DEPTH > 1) rg = reinterpret_cast<const VecN<G, VEC>*>(grad)[v];
        if constexpr (LOW) rl = reinterpret_cast<const VecN<G, VEC>*>(low)[v];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          C x[DEPTH];
#pragma unroll
          for (int o = 0; o < DEPTH; ++o) x[o] = o == 1 ? static_cast<C>(rg.v[j]) : static_cast<C>(r[o].v[j]);
          if constexpr (LOW) x[0] = optim_fns::master_value(x[0], rl.v[j]);
          g(x);
#pragma unroll
          for (int o = 0; o < DEPTH; ++o)
            if (o != 1) r[o].v[j] = static_cast<T>(x[o]);
          if constexpr (LOW) rl.v[j] = static_cast<G>(x[0]);
        }
#pragma unroll
        for (int o = 0; o < DEPTH; ++o)
          if (o != 1) reinterpret_cast<VecN<T, VEC>*>(ptr[o])[v] = r[o];
        if constexpr (LOW) reinterpret_cast<VecN<G, VEC>*>(low)[v] = rl;
      }
      done = nvec * VEC;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
      C x[DEPTH];
#pragma unroll
      for (int o = 0; o < DEPTH; ++o) x[o] = o == 1 ? static_cast<C>(grad[i]) : static_cast<C>(ptr[o][i]);
      if constexpr (LOW) x[0] = optim_fns::master_value(x[0], low[i]);
      g(x);
#pragma unroll
      for (int o = 0; o < DEPTH; ++o)
        if (o != 1) ptr[o][i] = static_cast<T>(x[o]);
      if constexpr (LOW) low[i] = static_cast<G>(x[0]);
    }
  }
}

__device__ __forceinline__ bool found_inf_set(const float* found_inf) { return found_inf && *found_inf > 0.f; }

// x = {p, g, buf}, or {p, g} without momentum.
template <typename C, int DEPTH>
struct SgdFn {
  optim_fns::SgdScalars<C> s;
  DeviceHyper dev;
  struct At {
    optim_fns::SgdScalars<C> s;
    bool init;
    __device__ __forceinline__ void operator()(C (&x)[DEPTH]) const {
      if constexpr (DEPTH > 2) {
        optim_fns::sgd_update<C>(x[0], x[1], x[2], init, s);
      } else {
        C unused = C(0);
        optim_fns::sgd_update<C>(x[0], x[1], unused, init, s);
      }
    }
  };
  __device__ __forceinline__ bool skip() const { return found_inf_set(dev.found_inf); }
  __device__ __forceinline__ At at(const TensorEntry& e) const {
    return {dev.lr ? optim_fns::sgd_with_lr(s, static_cast<double>(*dev.lr)) : s, e.init};
  }
};

// x = {p, g, m, v[, vmax]}. Scalars resolved per tensor when the learning
// rate or the step count is on the device.
template <typename C, int DEPTH>
struct AdamFn {
  optim_fns::AdamScalars<C> s;
  DeviceHyper dev;
  double host_step;
  struct At {
    optim_fns::AdamScalars<C> s;
    __device__ __forceinline__ void operator()(C (&x)[DEPTH]) const {
      if constexpr (DEPTH > 4) {
        optim_fns::adam_update<C>(x[0], x[1], x[2], x[3], x[4], s);
      } else {
        C unused = C(0);
        optim_fns::adam_update<C>(x[0], x[1], x[2], x[3], unused, s);
      }
    }
  };
  __device__ __forceinline__ bool skip() const { return found_inf_set(dev.found_inf); }
  __device__ __forceinline__ At at(const TensorEntry& e) const {
    if (!e.step && !dev.lr) return {s};
    const double lr = dev.lr ? static_cast<double>(*dev.lr) : s.lr_d;
    const double step = e.step ? static_cast<double>(*e.step + 1.0f) : host_step;
    return {optim_fns::adam_resolve(s, lr, step)};
  }
};

// x = {g}: unscaled in place; a non-finite element sets *found_inf (every
// writer stores the same 1, so the race is benign, as in torch's kernel).
template <typename C>
struct AmpUnscaleFn {
  float* found_inf;
  const float* inv_scale;
  struct At {
    float* found_inf;
    C inv;
    __device__ __forceinline__ void operator()(C (&x)[1]) const {
      bool found = false;
      x[0] = optim_fns::amp_unscale<C>(x[0], inv, found);
      if (found) *found_inf = 1.f;
    }
  };
  __device__ __forceinline__ bool skip() const { return false; }
  __device__ __forceinline__ At at(const TensorEntry&) const { return {found_inf, static_cast<C>(*inv_scale)}; }
};

// After an Adam step with device counts: each count + 1, unless skipped. One
// thread per count; launched after the step on the same stream, so every
// block of the step has read the old count.
// The counts' addresses travel in the kernel's parameters, kStepPtrs a
// launch: no table to copy from the host (which a CUDA graph could not
// replay).
constexpr int kStepPtrs = 128;
struct StepPtrs {
  float* p[kStepPtrs];
};
__global__ void bump_steps_kernel(const __grid_constant__ StepPtrs steps, int n, const float* found_inf) {
  const int i = threadIdx.x;
  if (i < n && !found_inf_set(found_inf)) *steps.p[i] += 1.0f;
}

__global__ void amp_update_scale_kernel(float* scale, int32_t* growth_tracker, const float* found_inf,
                                        AmpScaleArgs a) {
  optim_fns::amp_update_scale(*scale, *growth_tracker, *found_inf, a.growth_factor, a.backoff_factor,
                              a.growth_interval);
}

// The table in parameter space: __grid_constant__ lets the binary search
// index it at run time without copying it to local memory.
template <typename T, int DEPTH, typename F, typename G, bool LOW>
__global__ void __launch_bounds__(cuda::kBlockSize)
    mta_param_kernel(const __grid_constant__ ArgTable table, int ntensors, int64_t nchunks, F f) {
  multi_tensor_apply<T, DEPTH, F, G, LOW>(table.e, ntensors, nchunks, f);
}

template <typename T, int DEPTH, typename F, typename G, bool LOW>
__global__ void __launch_bounds__(cuda::kBlockSize)
    mta_buffer_kernel(const TensorEntry* __restrict__ entries, int ntensors, int64_t nchunks, F f) {
  multi_tensor_apply<T, DEPTH, F, G, LOW>(entries, ntensors, nchunks, f);
}

// Builds the table for operand lists (one list per operand, same length;
// with LOW one more: the masters' 16-bit parameters) and launches once on
// the tensors' device and current stream.
template <typename T, int DEPTH, typename F, typename G = T, bool LOW = false>
void launch(const std::vector<const std::vector<Tensor>*>& lists, const std::vector<bool>& init, const F& f,
            const std::vector<Tensor>& steps = {}) {
  EMBER_INTERNAL_ASSERT(lists.size() == static_cast<size_t>(DEPTH + LOW), "multi-tensor apply: ", lists.size(),
                        " operand lists for depth ", DEPTH, LOW ? " and masters" : "");
  const std::vector<Tensor>& params = *lists[0];
  std::vector<TensorEntry> entries;
  entries.reserve(params.size());
  int64_t nchunks = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    TensorEntry e{};
    e.aligned = true;
    for (int o = 0; o < DEPTH + LOW; ++o) {
      e.ptr[o] = (*lists[o])[i].raw_data();
      // The gradient and a 16-bit parameter are G, loaded VEC at a time too.
      e.aligned = e.aligned && (o == 1 || o == DEPTH ? cuda::is_aligned_for<G, cuda::vec_width<T>()>(e.ptr[o])
                                                     : cuda::is_aligned_for<T, cuda::vec_width<T>()>(e.ptr[o]));
    }
    e.numel = n;
    e.chunk_begin = nchunks;
    e.init = !init.empty() && init[i];
    e.step = steps.empty() ? nullptr : static_cast<float*>(steps[i].raw_data());
    nchunks += cuda::ceil_div(n, kChunk);
    entries.push_back(e);
  }
  if (entries.empty()) return;
  cuda::DeviceGuard guard(params[0]);
  cudaStream_t stream = cuda::stream_for(params[0]);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(nchunks, cuda::kMaxGridBlocks));
  const int n = static_cast<int>(entries.size());
  if (entries.size() <= static_cast<size_t>(kArgEntries)) {
    ArgTable table;
    std::copy(entries.begin(), entries.end(), table.e);
    mta_param_kernel<T, DEPTH, F, G, LOW><<<grid, cuda::kBlockSize, 0, stream>>>(table, n, nchunks, f);
  } else if (cuda_graph_capturing()) {
    // A CUDA graph cannot copy the table from pageable memory (its replay
    // would need those host bytes to stay): one parameter-space launch per
    // kArgEntries tensors instead, each slice's chunks counted from 0.
    for (size_t i0 = 0; i0 < entries.size(); i0 += kArgEntries) {
      const size_t i1 = std::min(entries.size(), i0 + static_cast<size_t>(kArgEntries));
      const int64_t base = entries[i0].chunk_begin;
      const int64_t end = i1 < entries.size() ? entries[i1].chunk_begin : nchunks;
      ArgTable table;
      for (size_t i = i0; i < i1; ++i) {
        table.e[i - i0] = entries[i];
        table.e[i - i0].chunk_begin -= base;
      }
      const unsigned g = static_cast<unsigned>(std::min<int64_t>(end - base, cuda::kMaxGridBlocks));
      mta_param_kernel<T, DEPTH, F, G, LOW>
          <<<g, cuda::kBlockSize, 0, stream>>>(table, static_cast<int>(i1 - i0), end - base, f);
      EMBER_CUDA_CHECK(cudaGetLastError());
    }
  } else {
    // Pageable source: the driver stages it before returning, so `entries`
    // may be freed; the buffer's block is reused only after this stream's
    // kernel, by the caching allocator's per-stream rule.
    const size_t bytes = entries.size() * sizeof(TensorEntry);
    Tensor buf = Tensor::empty({static_cast<int64_t>(bytes)}, {DType::UInt8, params[0].device()});
    EMBER_CUDA_CHECK(cudaMemcpyAsync(buf.raw_data(), entries.data(), bytes, cudaMemcpyHostToDevice, stream));
    mta_buffer_kernel<T, DEPTH, F, G, LOW>
        <<<grid, cuda::kBlockSize, 0, stream>>>(static_cast<const TensorEntry*>(buf.raw_data()), n, nchunks, f);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

// Calls f.template operator()<T, G, LOW>(): T the parameters' type, G the
// gradients' (a master's 16-bit parameter's type where `low` holds them).
template <typename F>
void dispatch_masters(DType param, const std::vector<Tensor>& low, const char* op, const F& f) {
  if (low.empty()) {
    EMBER_DISPATCH_FLOAT(param, op, [&] { f.template operator()<scalar_t, scalar_t, false>(); });
    return;
  }
  EMBER_INTERNAL_ASSERT(param == DType::Float32, op, ": masters must be float32, got ", param);
  if (low[0].dtype() == DType::BFloat16)
    f.template operator()<float, BFloat16, true>();
  else
    f.template operator()<float, Half, true>();
}

// An op's operand lists, with the masters' 16-bit parameters last when LOW.
template <bool LOW>
std::vector<const std::vector<Tensor>*> operands(std::vector<const std::vector<Tensor>*> lists,
                                                 const std::vector<Tensor>& low) {
  if (LOW) lists.push_back(&low);
  return lists;
}

}  // namespace

void sgd_step_cuda(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const std::vector<Tensor>& bufs,
                   const std::vector<bool>& init, const SgdOptions& a, DeviceHyper dev,
                   const std::vector<Tensor>& low) {
  if (params.empty()) return;
  dispatch_masters(params[0].dtype(), low, "sgd_step_", [&]<typename T, typename G, bool LOW>() {
    using C = acc_t<T>;
    const auto s = optim_fns::sgd_scalars<C>(a);
    if (s.has_momentum)
      launch<T, 3, SgdFn<C, 3>, G, LOW>(operands<LOW>({&params, &grads, &bufs}, low), init, SgdFn<C, 3>{s, dev});
    else
      launch<T, 2, SgdFn<C, 2>, G, LOW>(operands<LOW>({&params, &grads}, low), {}, SgdFn<C, 2>{s, dev});
  });
}

void adam_step_cuda(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                    const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                    const std::vector<Tensor>& max_exp_avg_sqs, const std::vector<Tensor>& steps,
                    const AdamKernelArgs& a, const std::vector<Tensor>& low) {
  if (params.empty()) return;
  dispatch_masters(params[0].dtype(), low, "adam_step_", [&]<typename T, typename G, bool LOW>() {
    using C = acc_t<T>;
    const auto s = optim_fns::adam_scalars<C>(a);
    if (s.amsgrad)
      launch<T, 5, AdamFn<C, 5>, G, LOW>(
          operands<LOW>({&params, &grads, &exp_avgs, &exp_avg_sqs, &max_exp_avg_sqs}, low), {},
          AdamFn<C, 5>{s, a.dev, a.step}, steps);
    else
      launch<T, 4, AdamFn<C, 4>, G, LOW>(operands<LOW>({&params, &grads, &exp_avgs, &exp_avg_sqs}, low), {},
                                         AdamFn<C, 4>{s, a.dev, a.step}, steps);
  });
  if (steps.empty()) return;
  // Counts of empty parameters too: they took part in the step.
  cuda::DeviceGuard guard(params[0]);
  cudaStream_t stream = cuda::stream_for(params[0]);
  for (size_t i0 = 0; i0 < steps.size(); i0 += kStepPtrs) {
    const int n = static_cast<int>(std::min(steps.size() - i0, static_cast<size_t>(kStepPtrs)));
    StepPtrs ptrs{};
    for (int i = 0; i < n; ++i) ptrs.p[i] = static_cast<float*>(steps[i0 + i].raw_data());
    bump_steps_kernel<<<1, kStepPtrs, 0, stream>>>(ptrs, n, a.dev.found_inf);
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
}

void amp_unscale_cuda(const std::vector<Tensor>& grads, const Tensor& found_inf, const Tensor& inv_scale) {
  if (grads.empty()) return;
  EMBER_DISPATCH_FLOAT(grads[0].dtype(), "amp_unscale_", [&] {
    using T = scalar_t;
    launch<T, 1>({&grads}, {}, AmpUnscaleFn<acc_t<T>>{found_inf.data<float>(), inv_scale.data<float>()});
  });
}

void amp_update_scale_cuda(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                           const AmpScaleArgs& a) {
  cuda::DeviceGuard guard(scale);
  amp_update_scale_kernel<<<1, 1, 0, cuda::stream_for(scale)>>>(scale.data<float>(), growth_tracker.data<int32_t>(),
                                                                 found_inf.data<float>(), a);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember
