// CUDA kernels of the list ops (foreach.cc has the chunk table and the CPU
// reference). The tensors' pointers and sizes ride in the kernel's
// parameter space (kEntries tensors a launch, more in further launches):
// no host-to-device copy of a table, so nothing to wait for and nothing a
// CUDA graph could not replay (a copy from pageable memory cannot be
// captured), which gradient clipping inside a captured step needs. A
// block visits chunks b, b + grid, ... and finds its tensor by binary
// search over the entries' first chunks, as the optimizers' multi-tensor
// apply does; the sums add each tensor's chunk partials in chunk order
// (deterministic, the CPU's order).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

constexpr int kEntries = 1024;  // 24 KB of the 32 KB a launch's parameters may take

struct Entry {
  void* ptr;
  int64_t numel;
  int64_t chunk;  // the tensor's first chunk, counted within its slice
};
struct Slice {
  Entry e[kEntries];
};
static_assert(sizeof(Slice) + 1024 <= 32764, "the list ops' table outgrew a launch's parameters");

// The entry owning chunk c of the slice: the last whose first chunk is <= c.
__device__ __forceinline__ int find_entry(const Slice& s, int n, int64_t c) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s.e[mid].chunk <= c)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Each chunk's sum of squares into partial[c] (c counted within the slice).
template <typename T>
__global__ void sum_squares_kernel(const __grid_constant__ Slice s, int n, int64_t nchunks,
                                   double* __restrict__ partial) {
  __shared__ double smem[cuda::kBlockSize];
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Entry& e = s.e[find_entry(s, n, c)];
    const int64_t start = (c - e.chunk) * ForeachTable::kChunk;
    const T* p = static_cast<const T*>(e.ptr) + start;
    const int64_t m = e.numel - start < ForeachTable::kChunk ? e.numel - start : ForeachTable::kChunk;
    double acc = 0;
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) acc += static_cast<double>(p[i]) * static_cast<double>(p[i]);
    smem[threadIdx.x] = acc;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {  // blockDim is a power of two
      if (static_cast<int>(threadIdx.x) < w) smem[threadIdx.x] += smem[threadIdx.x + w];
      __syncthreads();
    }
    if (threadIdx.x == 0) partial[c] = smem[0];
    __syncthreads();  // smem is rewritten for the next chunk
  }
}

// out[t] = the sum of tensor t's chunk partials, in chunk order.
__global__ void sum_partials_kernel(const __grid_constant__ Slice s, int n, const double* __restrict__ partial,
                                    double* __restrict__ out) {
  const int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (t >= n) return;
  const int64_t chunks = cuda::ceil_div(s.e[t].numel, ForeachTable::kChunk);
  double acc = 0;
  for (int64_t c = 0; c < chunks; ++c) acc += partial[s.e[t].chunk + c];
  out[t] = acc;
}

// factor: a host number, or (by_device) the float64 one `f` points at.
template <typename T>
__global__ void mul_kernel(const __grid_constant__ Slice s, int n, int64_t nchunks, T factor,
                           const double* __restrict__ f) {
  const T k = f ? static_cast<T>(*f) : factor;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Entry& e = s.e[find_entry(s, n, c)];
    const int64_t start = (c - e.chunk) * ForeachTable::kChunk;
    T* p = static_cast<T*>(e.ptr) + start;
    const int64_t m = e.numel - start < ForeachTable::kChunk ? e.numel - start : ForeachTable::kChunk;
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) p[i] *= k;
  }
}

// Calls launch(slice, tensors in it, chunks in it, index of its first
// tensor, global number of its first chunk) for each kEntries tensors.
template <typename F>
void for_each_slice(const ForeachTable& tab, const F& launch) {
  const int64_t nt = static_cast<int64_t>(tab.ptrs.size());
  for (int64_t t0 = 0; t0 < nt; t0 += kEntries) {
    const int n = static_cast<int>(std::min<int64_t>(kEntries, nt - t0));
    Slice s;
    const int64_t base = tab.first_chunk[t0];
    for (int i = 0; i < n; ++i) s.e[i] = {tab.ptrs[t0 + i], tab.numel[t0 + i], tab.first_chunk[t0 + i] - base};
    launch(s, n, tab.first_chunk[t0 + n] - base, t0, base);
  }
}

unsigned grid_of(int64_t nchunks) {
  return static_cast<unsigned>(std::clamp<int64_t>(nchunks, 1, cuda::kMaxGridBlocks));
}

}  // namespace

void foreach_sum_squares_cuda(const ForeachTable& tab, DType dt, Tensor& out) {
  cuda::DeviceGuard guard(out);
  cudaStream_t stream = cuda::stream_for(out);
  Tensor partial =
      Tensor::empty({std::max<int64_t>(static_cast<int64_t>(tab.chunks.size()), 1)}, {DType::Float64, out.device()});
  for_each_slice(tab, [&](const Slice& s, int n, int64_t nchunks, int64_t t0, int64_t base) {
    double* part = partial.data<double>() + base;
    if (nchunks > 0) {
      if (dt == DType::Float64)
        sum_squares_kernel<double><<<grid_of(nchunks), cuda::kBlockSize, 0, stream>>>(s, n, nchunks, part);
      else
        sum_squares_kernel<float><<<grid_of(nchunks), cuda::kBlockSize, 0, stream>>>(s, n, nchunks, part);
      EMBER_CUDA_CHECK(cudaGetLastError());
    }
    sum_partials_kernel<<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(s, n, part, out.data<double>() + t0);
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

void foreach_mul_cuda(const ForeachTable& tab, DType dt, double factor, const double* device_factor, int device) {
  if (tab.chunks.empty()) return;
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  for_each_slice(tab, [&](const Slice& s, int n, int64_t nchunks, int64_t, int64_t) {
    if (nchunks == 0) return;
    if (dt == DType::Float64)
      mul_kernel<double><<<grid_of(nchunks), cuda::kBlockSize, 0, stream>>>(s, n, nchunks, factor, device_factor);
    else
      mul_kernel<float>
          <<<grid_of(nchunks), cuda::kBlockSize, 0, stream>>>(s, n, nchunks, static_cast<float>(factor), device_factor);
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace ember
