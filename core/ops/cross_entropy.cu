// CUDA kernels of cross_entropy (cross_entropy.cc has the op, the math and
// the CPU reference). Both kernels take a row per tx threads (ty rows a
// block, as softmax.cu's row kernel), reading the logits in their own dtype
// with 16-byte loads and computing in float32 (float64 for float64):
//  - forward: one pass over the row for the online (max, sum of exp) pair
//    and, with label smoothing, the row's sum; the row's first thread reads
//    the target's logit and writes loss, lse and the row's count. A target
//    out of range is recorded in the device's error slot (raised at the
//    next synchronisation, as index errors are) and its row is NaN;
//  - backward: one pass writing g (exp(x - lse) - ls/C - (1-ls)[c == t]) in
//    the logits' dtype, nothing else the size of the logits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/online_softmax.cuh"

namespace ember {
namespace {

using cuda::MaxSum;
using cuda::VecN;

constexpr int kMaxRowThreads = 1024;

template <typename T>
using comp_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T, typename I, int VEC>
__global__ void __launch_bounds__(kMaxRowThreads)
    cross_entropy_forward_kernel(const T* __restrict__ x, const I* __restrict__ target, const CrossEntropyArgs a,
                                 comp_t<T>* __restrict__ loss, comp_t<T>* __restrict__ lse, float* __restrict__ counted,
                                 DeviceErrorSlot* slot, int32_t code) {
  using C = comp_t<T>;
  __shared__ MaxSum<C> smem[kMaxRowThreads / cuda::kWarpSize];
  __shared__ C ssum[kMaxRowThreads / cuda::kWarpSize];
  const int tx = blockDim.x, tid = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool smooth = a.label_smoothing > 0;
  const T* p = x + row * a.classes;
  MaxSum<C> st = cuda::ms_identity<C>();
  C sx = 0;
  if (row < a.rows) {
    cuda::for_each_aligned<VEC>(
        p, 0, a.classes, tid, tx,
        [&](int64_t i) {
          const C v = static_cast<C>(p[i]);
          cuda::ms_add(st, v);
          if (smooth) sx += v;
        },
        [&](int64_t i) {
          const VecN<T, VEC> xv = *reinterpret_cast<const VecN<T, VEC>*>(p + i);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const C v = static_cast<C>(xv.v[j]);
            cuda::ms_add(st, v);
            if (smooth) sx += v;
          }
        });
  }
  st = cuda::ms_warp_allreduce(st);
  if (smooth) sx = cuda::warp_sum(sx);
  const int nwarps = tx / cuda::kWarpSize;
  if (nwarps > 1) {
    const int warp = tid / cuda::kWarpSize, lane = tid % cuda::kWarpSize;
    MaxSum<C>* row_smem = smem + threadIdx.y * nwarps;
    C* row_sum = ssum + threadIdx.y * nwarps;
    if (lane == 0) {
      row_smem[warp] = st;
      row_sum[warp] = sx;
    }
    __syncthreads();
    st = cuda::ms_warp_allreduce(lane < nwarps ? row_smem[lane] : cuda::ms_identity<C>());
    if (smooth) sx = cuda::warp_sum(lane < nwarps ? row_sum[lane] : C(0));
  }
  if (row >= a.rows || tid != 0) return;
  const int64_t t = static_cast<int64_t>(target[row]);
  if (t == a.ignore_index) {
    loss[row] = 0;
    lse[row] = 0;
    if (counted) counted[row] = 0.f;
    return;
  }
  if (counted) counted[row] = 1.f;
  if (t < 0 || t >= a.classes) {
    cuda::record_error(slot, code, 1, t, 0, a.classes);
    loss[row] = lse[row] = std::numeric_limits<C>::quiet_NaN();
    return;
  }
  // (m - x_t) + log(sum), not lse - x_t: a large max would round away a
  // small loss's digits (as the CPU kernel).
  const C log_sum = m_log(st.s);
  C v = (st.m - static_cast<C>(p[t])) + log_sum;
  if (smooth) {
    const C ls = static_cast<C>(a.label_smoothing);
    v = v * (C(1) - ls) + ((st.m - sx / static_cast<C>(a.classes)) + log_sum) * ls;
  }
  loss[row] = v;
  lse[row] = st.m + log_sum;
}

template <typename T, typename I, int VEC>
__global__ void __launch_bounds__(kMaxRowThreads)
    cross_entropy_backward_kernel(const comp_t<T>* __restrict__ g, const T* __restrict__ x,
                                  const I* __restrict__ target, const comp_t<T>* __restrict__ lse,
                                  const CrossEntropyArgs a, T* __restrict__ dx) {
  using C = comp_t<T>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= a.rows) return;
  const int64_t t = static_cast<int64_t>(target[row]);
  const bool ignored = t == a.ignore_index;
  const C gn = ignored ? C(0) : g[row], l = ignored ? C(0) : lse[row];
  const C off = static_cast<C>(a.label_smoothing / static_cast<double>(a.classes));
  const C hit = C(1) - static_cast<C>(a.label_smoothing);
  const T* p = x + row * a.classes;
  T* q = dx + row * a.classes;
  // An ignored row is zero, whatever its logits (an inf there is no NaN).
  auto grad = [&](C v, int64_t c) {
    return ignored ? static_cast<T>(C(0)) : static_cast<T>(gn * (m_exp(v - l) - off - (c == t ? hit : C(0))));
  };
  cuda::for_each_aligned<VEC>(
      q, 0, a.classes, threadIdx.x, blockDim.x, [&](int64_t i) { q[i] = grad(static_cast<C>(p[i]), i); },
      [&](int64_t i) {
        const VecN<T, VEC> xv = *reinterpret_cast<const VecN<T, VEC>*>(p + i);
        VecN<T, VEC> y;
#pragma unroll
        for (int j = 0; j < VEC; ++j) y.v[j] = grad(static_cast<C>(xv.v[j]), i + j);
        *reinterpret_cast<VecN<T, VEC>*>(q + i) = y;
      });
}

int64_t pow2_ceil(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

// tx threads a row (about 4 vectors each, one warp to 1024), ty rows a block.
template <typename T>
struct RowLaunch {
  dim3 grid, block;
  explicit RowLaunch(const CrossEntropyArgs& a) {
    constexpr int VEC = cuda::vec_width<T>();
    const int64_t tx = std::clamp<int64_t>(pow2_ceil(cuda::ceil_div(std::max<int64_t>(a.classes, 1), VEC * 4)),
                                           cuda::kWarpSize, kMaxRowThreads);
    block = dim3(static_cast<unsigned>(tx), static_cast<unsigned>(std::max<int64_t>(1, cuda::kBlockSize / tx)));
    grid = dim3(static_cast<unsigned>(cuda::ceil_div(a.rows, block.y)));
  }
};

// Whether every row of both buffers starts VEC-aligned relative to the
// other (the kernels step both by the same element offsets).
template <typename T>
bool rows_aligned(const void* a, const void* b) {
  constexpr int VEC = cuda::vec_width<T>();
  return cuda::is_aligned_for<T, VEC>(a) && cuda::is_aligned_for<T, VEC>(b);
}

template <typename T, typename I>
void forward(const CrossEntropyArgs& a, const Tensor& x, const Tensor& target, Tensor& loss, Tensor& lse,
             Tensor* counted) {
  using C = comp_t<T>;
  constexpr int VEC = cuda::vec_width<T>();
  const int device = x.device().index;
  cudaStream_t stream = cuda::stream_for(x);
  static const int32_t code = cuda_error_op_code("cross_entropy");
  const RowLaunch<T> rl(a);
  const T* xp = x.data<T>();
  const I* tp = static_cast<const I*>(target.raw_data());
  float* cp = counted ? counted->data<float>() : nullptr;
  DeviceErrorSlot* slot = cuda_error_slot(device);
  if (cuda::is_aligned_for<T, VEC>(xp))
    cross_entropy_forward_kernel<T, I, VEC>
        <<<rl.grid, rl.block, 0, stream>>>(xp, tp, a, loss.data<C>(), lse.data<C>(), cp, slot, code);
  else
    cross_entropy_forward_kernel<T, I, 1>
        <<<rl.grid, rl.block, 0, stream>>>(xp, tp, a, loss.data<C>(), lse.data<C>(), cp, slot, code);
  EMBER_CUDA_CHECK(cudaGetLastError());
  cuda::maybe_check_now(device, stream);
}

template <typename T, typename I>
void backward(const CrossEntropyArgs& a, const Tensor& g, const Tensor& x, const Tensor& target, const Tensor& lse,
              Tensor& dx) {
  using C = comp_t<T>;
  cudaStream_t stream = cuda::stream_for(x);
  const RowLaunch<T> rl(a);
  const I* tp = static_cast<const I*>(target.raw_data());
  if (rows_aligned<T>(x.data<T>(), dx.data<T>()))
    cross_entropy_backward_kernel<T, I, cuda::vec_width<T>()>
        <<<rl.grid, rl.block, 0, stream>>>(g.data<C>(), x.data<T>(), tp, lse.data<C>(), a, dx.data<T>());
  else
    cross_entropy_backward_kernel<T, I, 1>
        <<<rl.grid, rl.block, 0, stream>>>(g.data<C>(), x.data<T>(), tp, lse.data<C>(), a, dx.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename F>
void dispatch(const Tensor& logits, const Tensor& target, F&& f) {
  EMBER_DISPATCH_FLOAT(logits.dtype(), "cross_entropy", [&] {
    using T = scalar_t;
    if (target.dtype() == DType::Int64)
      f.template operator()<T, int64_t>();
    else
      f.template operator()<T, int32_t>();
  });
}

}  // namespace

void cross_entropy_forward_cuda(const CrossEntropyArgs& a, const Tensor& logits, const Tensor& target, Tensor& loss,
                                Tensor& lse, Tensor* counted) {
  cuda::DeviceGuard guard(logits);
  dispatch(logits, target, [&]<typename T, typename I>() { forward<T, I>(a, logits, target, loss, lse, counted); });
}

void cross_entropy_backward_cuda(const CrossEntropyArgs& a, const Tensor& grad_loss, const Tensor& logits,
                                 const Tensor& target, const Tensor& lse, Tensor& grad) {
  cuda::DeviceGuard guard(logits);
  dispatch(logits, target, [&]<typename T, typename I>() { backward<T, I>(a, grad_loss, logits, target, lse, grad); });
}

}  // namespace ember
