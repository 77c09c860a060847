// CUDA launcher for reductions (sum, max, min, argmax, argmin) over the
// middle axis of a contiguous [outer, r, inner] tensor. Each op is a Reducer:
// an accumulator type plus identity/make/combine/finalize, so one kernel body
// serves all five. Sum accumulates in acc_t (float for 16-bit floats) or,
// for integer/bool inputs, in int64, which is also the output dtype then, as
// in reduce.cc; max/min propagate NaN; arg ops keep the
// lowest index among equal extrema (a NaN counts as the extremum, the first
// NaN wins), which makes the result independent of the combine order. When
// the output has too few elements to fill the GPU (a full reduction, say),
// the reduced axis is split across blocks that write partial accumulators,
// and a second small kernel combines them: deterministic, unlike atomics.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::VecN;

template <typename T>
constexpr bool is_float_acc = std::is_floating_point_v<acc_t<T>>;
// Sum: floats in acc_t, integers (and bool) in int64 so they do not wrap.
template <typename T>
using sum_t = std::conditional_t<is_float_acc<T>, acc_t<T>, int64_t>;
// Max/min compare in acc_t; bool/uint8 widen to int so shuffles accept them.
template <typename T>
using cmp_t = std::conditional_t<is_float_acc<T>, acc_t<T>, std::conditional_t<(sizeof(T) < 4), int, T>>;

template <typename V>
__device__ __forceinline__ bool is_nan(V v) {
  if constexpr (std::is_floating_point_v<V>) return v != v; else return false;
}

template <typename V>
struct ArgPair {
  V val;
  int64_t idx;
};

template <ReduceOp OP>
constexpr bool is_arg_op = OP == ReduceOp::ArgMax || OP == ReduceOp::ArgMin;
template <ReduceOp OP>
constexpr bool is_max_op = OP == ReduceOp::Max || OP == ReduceOp::ArgMax;

template <ReduceOp OP, typename T>
struct Reducer {
  using V = std::conditional_t<OP == ReduceOp::Sum, sum_t<T>, cmp_t<T>>;
  using A = std::conditional_t<is_arg_op<OP>, ArgPair<V>, V>;
  // Arg ops write indices; integer sums write the int64 accumulator itself
  // (the op layer gives them an int64 output, as torch does).
  using Out = std::conditional_t<is_arg_op<OP> || (OP == ReduceOp::Sum && !is_float_acc<T>), int64_t, T>;

  static __device__ __forceinline__ V worst() {  // identity of max/min
    if constexpr (std::is_floating_point_v<V>) {
      return is_max_op<OP> ? -std::numeric_limits<V>::infinity() : std::numeric_limits<V>::infinity();
    } else {
      return static_cast<V>(is_max_op<OP> ? std::numeric_limits<T>::lowest() : std::numeric_limits<T>::max());
    }
  }
  static __device__ __forceinline__ A identity() {
    if constexpr (OP == ReduceOp::Sum) return V(0);
    else if constexpr (is_arg_op<OP>) return A{worst(), std::numeric_limits<int64_t>::max()};
    else return worst();
  }
  static __device__ __forceinline__ A make(T x, int64_t i) {
    const V v = static_cast<V>(static_cast<acc_t<T>>(x));
    if constexpr (is_arg_op<OP>) return A{v, i}; else return v;
  }
  // True if a beats b (max/min with NaN as the most extreme value).
  static __device__ __forceinline__ bool beats(V a, V b) {
    if (is_nan(a)) return !is_nan(b);
    if (is_nan(b)) return false;
    return is_max_op<OP> ? a > b : a < b;
  }
  static __device__ __forceinline__ A combine(A a, A b) {
    if constexpr (OP == ReduceOp::Sum) {
      return a + b;
    } else if constexpr (is_arg_op<OP>) {
      if (beats(a.val, b.val)) return a;
      if (beats(b.val, a.val)) return b;
      return a.idx <= b.idx ? a : b;
    } else {
      return beats(b, a) ? b : a;
    }
  }
  static __device__ __forceinline__ Out finalize(A a) {
    if constexpr (is_arg_op<OP>) return a.idx; else return cuda::cast_value<Out, V>(a);
  }
  static __device__ __forceinline__ A shfl_down(A a, int d) {
    if constexpr (is_arg_op<OP>) return A{cuda::shfl_down(a.val, d), cuda::shfl_down(a.idx, d)};
    else return cuda::shfl_down(a, d);
  }
};

template <typename R, typename A>
__device__ __forceinline__ A warp_reduce(A acc) {
#pragma unroll
  for (int d = cuda::kWarpSize / 2; d > 0; d /= 2) acc = R::combine(acc, R::shfl_down(acc, d));
  return acc;  // complete in lane 0
}

constexpr int kMaxRowThreads = 512;

// ---- Kernels ----

// inner == 1, r >= 32. Block (tx, ty): ty rows per block, tx threads per row;
// block column blockIdx.y takes [split * chunk, +chunk) of each row. Loads
// are 16-byte vectors once the row pointer is aligned (rows start anywhere,
// so a short head and tail go element-wise). splits == 1 writes the result,
// otherwise a partial accumulator at dst[row * splits + split].
template <ReduceOp OP, typename T, int VEC>
__global__ void __launch_bounds__(kMaxRowThreads)
    reduce_rows_kernel(const T* __restrict__ in, int64_t outer, int64_t r, int64_t chunk, int splits,
                       void* __restrict__ dst) {
  using R = Reducer<OP, T>;
  using A = typename R::A;
  __shared__ A smem[kMaxRowThreads / cuda::kWarpSize];
  const int tx = blockDim.x, tid = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  A acc = R::identity();
  if (row < outer) {
    const T* p = in + row * r;
    const int64_t b = static_cast<int64_t>(blockIdx.y) * chunk, e = std::min(r, b + chunk);
    cuda::for_each_aligned<VEC>(
        p, b, e, tid, tx, [&](int64_t i) { acc = R::combine(acc, R::make(p[i], i)); },
        [&](int64_t i) {
          const VecN<T, VEC> x = *reinterpret_cast<const VecN<T, VEC>*>(p + i);
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc = R::combine(acc, R::make(x.v[j], i + j));
        });
  }
  acc = warp_reduce<R>(acc);
  const int nwarps = tx / cuda::kWarpSize;
  if (nwarps > 1) {  // a row spans several warps: combine them through shared memory
    const int warp = tid / cuda::kWarpSize, lane = tid % cuda::kWarpSize;
    A* row_smem = smem + threadIdx.y * nwarps;
    if (lane == 0) row_smem[warp] = acc;
    __syncthreads();
    if (warp == 0) acc = warp_reduce<R>(lane < nwarps ? row_smem[lane] : R::identity());
  }
  if (tid == 0 && row < outer) {
    if (splits == 1) static_cast<typename R::Out*>(dst)[row] = R::finalize(acc);
    else static_cast<A*>(dst)[row * splits + blockIdx.y] = acc;
  }
}

// Strided layout (inner > 1, or rows too short for a warp each). Block
// (tx, ty): tx consecutive outputs q = o * inner + j, which for consecutive j
// sit next to each other in memory, so a warp's loads are contiguous runs;
// ty threads stride the reduced axis and combine through shared memory.
// grid.y splits the reduced axis as in the rows kernel.
template <ReduceOp OP, typename T>
__global__ void reduce_strided_kernel(const T* __restrict__ in, int64_t n_out, int64_t r, int64_t inner,
                                      int64_t chunk, int splits, void* __restrict__ dst) {
  using R = Reducer<OP, T>;
  using A = typename R::A;
  __shared__ A smem[cuda::kBlockSize];
  const int tx = blockDim.x, ty = blockDim.y;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * tx + threadIdx.x;
  const int64_t b = static_cast<int64_t>(blockIdx.y) * chunk, e = std::min(r, b + chunk);
  A acc = R::identity();
  if (q < n_out) {
    const int64_t o = q / inner, j = q - o * inner;
    const T* p = in + o * r * inner + j;
    for (int64_t k = b + threadIdx.y; k < e; k += ty) acc = R::combine(acc, R::make(p[k * inner], k));
  }
  const int slot = threadIdx.y * tx + threadIdx.x;
  smem[slot] = acc;
  __syncthreads();
  for (int s = ty / 2; s > 0; s /= 2) {  // ty is a power of two
    if (static_cast<int>(threadIdx.y) < s) smem[slot] = R::combine(smem[slot], smem[slot + s * tx]);
    __syncthreads();
  }
  if (threadIdx.y == 0 && q < n_out) {
    if (splits == 1) static_cast<typename R::Out*>(dst)[q] = R::finalize(smem[slot]);
    else static_cast<A*>(dst)[q * splits + blockIdx.y] = smem[slot];
  }
}

// Second pass: one warp per output combines its `splits` partials.
template <ReduceOp OP, typename T>
__global__ void reduce_partials_kernel(const typename Reducer<OP, T>::A* __restrict__ part, int64_t n_out,
                                       int splits, typename Reducer<OP, T>::Out* __restrict__ out) {
  using R = Reducer<OP, T>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  typename R::A acc = R::identity();
  if (row < n_out)
    for (int s = threadIdx.x; s < splits; s += cuda::kWarpSize) acc = R::combine(acc, part[row * splits + s]);
  acc = warp_reduce<R>(acc);
  if (threadIdx.x == 0 && row < n_out) out[row] = R::finalize(acc);
}

// ---- Launchers ----

int64_t pow2_ceil(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

// How many ways to split the reduced axis: enough blocks for one full wave
// of the GPU (at the kernel's real occupancy), but never so few elements per
// block that the partial pass costs more than it saves.
template <typename Kernel>
int pick_splits(Kernel kernel, int64_t blocks, int64_t r, int64_t min_per_block, int device, int threads) {
  const int sms = cuda::sm_count(device);
  if (blocks >= int64_t{sms} * 32) return 1;  // no SM holds more than 32 blocks
  int per_sm = 0;
  EMBER_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int64_t wave = int64_t{sms} * std::max(per_sm, 1);
  if (blocks >= wave) return 1;
  const int64_t s = std::min(cuda::ceil_div(wave, blocks), cuda::ceil_div(r, min_per_block));
  return static_cast<int>(std::clamp<int64_t>(s, 1, 65535));
}

template <ReduceOp OP, typename T>
void launch_reduce(const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner, int device,
                   cudaStream_t stream) {
  using R = Reducer<OP, T>;
  using A = typename R::A;
  using Out = typename R::Out;
  constexpr int VEC = cuda::vec_width<T>();
  const T* src = static_cast<const T*>(in.raw_data());
  Out* dst = static_cast<Out*>(out.raw_data());
  const int64_t n_out = outer * inner;
  // Rows shorter than a warp waste most of it; the strided kernel instead
  // gives each thread its own row.
  const bool rows = inner == 1 && r >= cuda::kWarpSize;

  dim3 block;
  int64_t blocks = 0, min_per_block = 0;
  int splits = 1;
  if (rows) {
    // Threads per row: enough for ~4 vector loads each, between a warp and 512.
    const int64_t tx = std::clamp<int64_t>(pow2_ceil(cuda::ceil_div(r, VEC * 4)), cuda::kWarpSize, kMaxRowThreads);
    block = dim3(static_cast<unsigned>(tx), static_cast<unsigned>(std::max<int64_t>(1, cuda::kBlockSize / tx)));
    blocks = cuda::ceil_div(outer, block.y);
    min_per_block = tx * VEC * 8;
    splits = pick_splits(reduce_rows_kernel<OP, T, VEC>, blocks, r, min_per_block, device, block.x * block.y);
  } else {
    // Few outputs: more threads along r; short r: more outputs per block.
    const int64_t tx0 = std::min<int64_t>(cuda::kWarpSize, pow2_ceil(n_out));
    const int64_t ty = std::min<int64_t>(cuda::kBlockSize / tx0, pow2_ceil(r));
    const int64_t tx = std::min<int64_t>(cuda::kBlockSize / ty, pow2_ceil(n_out));
    block = dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
    blocks = cuda::ceil_div(n_out, tx);
    min_per_block = ty * 16;
    splits = pick_splits(reduce_strided_kernel<OP, T>, blocks, r, min_per_block, device, block.x * block.y);
  }
  const int64_t chunk = cuda::ceil_div(std::max<int64_t>(r, 1), splits);
  DataPtr scratch;
  void* target = dst;
  if (splits > 1) {
    scratch = get_allocator(cuda_device(device))->allocate(static_cast<size_t>(n_out) * splits * sizeof(A));
    target = scratch.get();
  }
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(splits));
  if (rows) {
    reduce_rows_kernel<OP, T, VEC><<<grid, block, 0, stream>>>(src, outer, r, chunk, splits, target);
  } else {
    reduce_strided_kernel<OP, T><<<grid, block, 0, stream>>>(src, n_out, r, inner, chunk, splits, target);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
  if (splits > 1) {
    const dim3 pblock(cuda::kWarpSize, cuda::kBlockSize / cuda::kWarpSize);
    const unsigned pgrid = static_cast<unsigned>(cuda::ceil_div(n_out, pblock.y));
    reduce_partials_kernel<OP, T><<<pgrid, pblock, 0, stream>>>(static_cast<const A*>(target), n_out, splits, dst);
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  // `scratch` goes back to the caching allocator here; its free list is per
  // stream, so reuse is ordered after the kernels above.
}

}  // namespace

void reduce_cuda(ReduceOp op, const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner) {
  if (outer * inner == 0) return;
  const bool int64_out = op == ReduceOp::ArgMax || op == ReduceOp::ArgMin ||
                         (op == ReduceOp::Sum && !is_floating(in.dtype()));
  const DType want = int64_out ? DType::Int64 : in.dtype();
  EMBER_CHECK(out.dtype() == want, "reduce: expected a ", want, " output for a ", in.dtype(), " input, got ",
              out.dtype());
  const int device = in.device().index;
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  EMBER_DISPATCH_ALL(in.dtype(), "reduce", [&] {
    using T = scalar_t;
    switch (op) {
      case ReduceOp::Sum: launch_reduce<ReduceOp::Sum, T>(in, out, outer, r, inner, device, stream); break;
      case ReduceOp::Max: launch_reduce<ReduceOp::Max, T>(in, out, outer, r, inner, device, stream); break;
      case ReduceOp::Min: launch_reduce<ReduceOp::Min, T>(in, out, outer, r, inner, device, stream); break;
      case ReduceOp::ArgMax: launch_reduce<ReduceOp::ArgMax, T>(in, out, outer, r, inner, device, stream); break;
      case ReduceOp::ArgMin: launch_reduce<ReduceOp::ArgMin, T>(in, out, outer, r, inner, device, stream); break;
    }
  });
}

}  // namespace ember
