// CUDA kernels of the list ops (foreach.cc has the chunk table and the CPU
// reference): the table goes to the device in one host-to-device copy (no
// wait: the caller's host vectors are staged by the copy), then one block
// per chunk; the sums add each tensor's chunk partials in chunk order.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

// Device copy of a ForeachTable: [ptr, numel] per tensor, [tensor, start]
// per chunk, first_chunk per tensor + 1, as int64 in one buffer.
struct DeviceTable {
  Tensor buf;
  const int64_t *tensors = nullptr, *chunks = nullptr, *first = nullptr;
};

DeviceTable upload(const ForeachTable& tab, Device dev) {
  const int64_t nt = static_cast<int64_t>(tab.ptrs.size()), nc = static_cast<int64_t>(tab.chunks.size());
  Tensor host = Tensor::empty({2 * nt + 2 * nc + nt + 1}, {DType::Int64, kCPU});
  int64_t* h = host.data<int64_t>();
  for (int64_t t = 0; t < nt; ++t) {
    h[2 * t] = reinterpret_cast<int64_t>(tab.ptrs[t]);
    h[2 * t + 1] = tab.numel[t];
  }
  for (int64_t c = 0; c < nc; ++c) {
    h[2 * nt + 2 * c] = tab.chunks[c].first;
    h[2 * nt + 2 * c + 1] = tab.chunks[c].second;
  }
  for (int64_t t = 0; t <= nt; ++t) h[2 * nt + 2 * nc + t] = tab.first_chunk[t];
  DeviceTable d;
  d.buf = host.to(dev);
  d.tensors = d.buf.data<int64_t>();
  d.chunks = d.tensors + 2 * nt;
  d.first = d.chunks + 2 * nc;
  return d;
}

template <typename T>
__global__ void sum_squares_kernel(const int64_t* __restrict__ tensors, const int64_t* __restrict__ chunks,
                                   double* __restrict__ partial) {
  __shared__ double smem[cuda::kBlockSize];
  const int64_t t = chunks[2 * blockIdx.x], s = chunks[2 * blockIdx.x + 1];
  const T* p = reinterpret_cast<const T*>(tensors[2 * t]) + s;
  const int64_t n = tensors[2 * t + 1] - s < ForeachTable::kChunk ? tensors[2 * t + 1] - s : ForeachTable::kChunk;
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += static_cast<double>(p[i]) * static_cast<double>(p[i]);
  smem[threadIdx.x] = acc;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {  // blockDim is a power of two
    if (static_cast<int>(threadIdx.x) < w) smem[threadIdx.x] += smem[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = smem[0];
}

__global__ void sum_partials_kernel(const int64_t* __restrict__ first, int64_t nt, const double* __restrict__ partial,
                                    double* __restrict__ out) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= nt) return;
  double acc = 0;
  for (int64_t c = first[t]; c < first[t + 1]; ++c) acc += partial[c];
  out[t] = acc;
}

template <typename T>
__global__ void mul_kernel(const int64_t* __restrict__ tensors, const int64_t* __restrict__ chunks, T factor) {
  const int64_t t = chunks[2 * blockIdx.x], s = chunks[2 * blockIdx.x + 1];
  T* p = reinterpret_cast<T*>(tensors[2 * t]) + s;
  const int64_t n = tensors[2 * t + 1] - s < ForeachTable::kChunk ? tensors[2 * t + 1] - s : ForeachTable::kChunk;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] *= factor;
}

}  // namespace

void foreach_sum_squares_cuda(const ForeachTable& tab, DType dt, Tensor& out) {
  cuda::DeviceGuard guard(out);
  cudaStream_t stream = cuda::stream_for(out);
  const int64_t nt = static_cast<int64_t>(tab.ptrs.size()), nc = static_cast<int64_t>(tab.chunks.size());
  const DeviceTable d = upload(tab, out.device());
  Tensor partial = Tensor::empty({std::max<int64_t>(nc, 1)}, {DType::Float64, out.device()});
  if (nc > 0) {
    if (dt == DType::Float64)
      sum_squares_kernel<double>
          <<<static_cast<unsigned>(nc), cuda::kBlockSize, 0, stream>>>(d.tensors, d.chunks, partial.data<double>());
    else
      sum_squares_kernel<float>
          <<<static_cast<unsigned>(nc), cuda::kBlockSize, 0, stream>>>(d.tensors, d.chunks, partial.data<double>());
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  sum_partials_kernel<<<cuda::grid_for(nt), cuda::kBlockSize, 0, stream>>>(d.first, nt, partial.data<double>(),
                                                                           out.data<double>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void foreach_mul_cuda(const ForeachTable& tab, DType dt, double factor, int device) {
  if (tab.chunks.empty()) return;
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  const DeviceTable d = upload(tab, Device(DeviceType::CUDA, device));
  const unsigned nc = static_cast<unsigned>(tab.chunks.size());
  if (dt == DType::Float64)
    mul_kernel<double><<<nc, cuda::kBlockSize, 0, stream>>>(d.tensors, d.chunks, factor);
  else
    mul_kernel<float><<<nc, cuda::kBlockSize, 0, stream>>>(d.tensors, d.chunks, static_cast<float>(factor));
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember
