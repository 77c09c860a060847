// CUDA launchers for index_select and gather. Both only move bytes, so the
// kernels are instantiated per element width rather than per dtype, and
// index_select copies whole slices in the widest unit (up to 16 bytes) that
// the slice size and pointer alignment allow: embedding lookups are exactly
// this and are bandwidth-bound. Indices in [-size, size) are valid, negative
// ones counting from the end, as in index.cc. An out-of-range index cannot
// throw from a kernel: the kernel records the first bad value in the
// device's error slot (device.h) and the op returns without waiting; the
// host raises the CPU kernel's error at its next synchronisation, or at once
// under EMBER_SYNC_CHECKS=1. check_index_range_cuda is the same check alone
// (cross-entropy targets, embedding indices).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

// Where a kernel records a bad index: the device's slot, the op's code and
// the dimension indexed (passed by value).
struct IndexError {
  DeviceErrorSlot* slot;
  int32_t op;
  int64_t dim;
};

// Raw unit of a given byte width; copying bits needs no dtype.
template <int BYTES> struct Unit;
template <> struct Unit<1> { using type = uint8_t; };
template <> struct Unit<2> { using type = uint16_t; };
template <> struct Unit<4> { using type = uint32_t; };
template <> struct Unit<8> { using type = uint64_t; };
template <> struct Unit<16> { using type = uint4; };

// Valid indices are [-size, size); negative ones count from the end, as on
// the CPU. Returns false (after recording idx) for anything else.
__device__ __forceinline__ bool wrap_index(int64_t& idx, int64_t size, const IndexError& err) {
  if (idx >= -size && idx < size) {
    if (idx < 0) idx += size;
    return true;
  }
  cuda::record_error(err.slot, err.op, 0, idx, err.dim, size);
  return false;
}

// Every index in [lo, hi), else the op's error (kind 1: a value range).
template <typename I>
__global__ void check_range_kernel(const I* __restrict__ idx, int64_t n, int64_t lo, int64_t hi,
                                   DeviceErrorSlot* slot, int32_t op) {
  cuda::grid_stride_loop(n, [&](int64_t i) {
    const int64_t v = static_cast<int64_t>(idx[i]);
    if (v < lo || v >= hi) cuda::record_error(slot, op, 1, v, lo, hi);
  });
}

// ---- Kernels ----

// One output slice [inner units] per (outer, k) row: threads walk the slice,
// so loads and stores are contiguous. Used when slices are wide.
template <typename U>
__global__ void index_select_rows_kernel(const U* __restrict__ in, const int64_t* __restrict__ index,
                                         U* __restrict__ out, int64_t rows, int64_t n, int64_t src_size,
                                         int64_t inner, IndexError err) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t o = row / n, k = row % n;
    int64_t idx = index[k];
    if (!wrap_index(idx, src_size, err)) continue;
    const U* src = in + (o * src_size + idx) * inner;
    U* dst = out + row * inner;
    for (int64_t j = threadIdx.x; j < inner; j += blockDim.x) dst[j] = src[j];
  }
}

// One thread per output unit; for narrow slices, where a block per slice
// would leave most threads idle.
template <typename U>
__global__ void index_select_flat_kernel(const U* __restrict__ in, const int64_t* __restrict__ index,
                                         U* __restrict__ out, int64_t total, int64_t n, int64_t src_size,
                                         int64_t inner, IndexError err) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    const int64_t j = i % inner, t = i / inner;
    const int64_t k = t % n, o = t / n;
    int64_t idx = index[k];
    if (wrap_index(idx, src_size, err)) out[i] = in[(o * src_size + idx) * inner + j];
  });
}

// geom: the index/out shape with `in`'s strides, except 0 at `dim` (whose
// coordinate comes from the index instead).
template <typename U>
__global__ void gather_kernel(const __grid_constant__ StridedIter geom, const U* __restrict__ in,
                              const int64_t* __restrict__ index, U* __restrict__ out, int64_t dim_stride,
                              int64_t dim_size, IndexError err) {
  cuda::grid_stride_loop(geom.numel, [&](int64_t i) {
    int64_t off[1];
    cuda::strided_offsets<1>(geom, i, off);
    int64_t idx = index[i];
    if (wrap_index(idx, dim_size, err)) out[i] = in[off[0] + idx * dim_stride];
  });
}

// ---- Launchers ----

// Widest unit that divides the slice and both base addresses.
int unit_bytes(int64_t slice_bytes, const void* a, const void* b) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b);
  for (int u = 16; u > 1; u /= 2)
    if (slice_bytes % u == 0 && addr % u == 0) return u;
  return 1;
}

template <int BYTES>
void launch_index_select(const void* in, const int64_t* index, void* out, int64_t outer, int64_t n, int64_t src_size,
                         int64_t inner_bytes, IndexError err, cudaStream_t stream) {
  using U = typename Unit<BYTES>::type;
  const int64_t inner = inner_bytes / BYTES, rows = outer * n;
  const U* src = static_cast<const U*>(in);
  U* dst = static_cast<U*>(out);
  if (inner >= cuda::kWarpSize) {
    const int block = cuda::block_for(inner);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, cuda::kMaxGridBlocks));
    index_select_rows_kernel<U><<<grid, block, 0, stream>>>(src, index, dst, rows, n, src_size, inner, err);
  } else {
    const int64_t total = rows * inner;
    index_select_flat_kernel<U>
        <<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(src, index, dst, total, n, src_size, inner, err);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <int BYTES>
void launch_gather(const StridedIter& geom, const void* in, const int64_t* index, void* out, int64_t dim_stride,
                   int64_t dim_size, IndexError err, cudaStream_t stream) {
  using U = typename Unit<BYTES>::type;
  gather_kernel<U><<<cuda::grid_for(geom.numel), cuda::kBlockSize, 0, stream>>>(
      geom, static_cast<const U*>(in), index, static_cast<U*>(out), dim_stride, dim_size, err);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

// The launcher gets [outer, src_size, inner] but not the dim; recover it for
// the error message as the first dim whose prefix product is `outer` and
// whose size is `src_size`.
int64_t infer_dim(const Tensor& in, int64_t outer, int64_t src_size) {
  int64_t prefix = 1;
  for (int64_t d = 0; d < in.dim(); ++d) {
    if (prefix == outer && in.size(d) == src_size) return d;
    prefix *= in.size(d);
  }
  return 0;
}

}  // namespace

void index_select_cuda(const Tensor& in, const Tensor& index, Tensor& out, int64_t outer, int64_t src_size,
                       int64_t inner) {
  EMBER_CHECK(index.dtype() == DType::Int64, "index_select: index must be int64, got ", index.dtype());
  const int64_t n = index.numel();
  if (outer * n * inner == 0) return;
  cuda::DeviceGuard guard(in);
  cudaStream_t stream = cuda::stream_for(in);
  static const int32_t code = cuda_error_op_code("index_select");
  const IndexError err{cuda_error_slot(in.device().index), code, infer_dim(in, outer, src_size)};
  const int64_t es = static_cast<int64_t>(in.element_size());
  const int64_t inner_bytes = inner * es;
  const void* src = in.raw_data();
  void* dst = out.raw_data();
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  switch (unit_bytes(inner_bytes, src, dst)) {
    case 16: launch_index_select<16>(src, idx, dst, outer, n, src_size, inner_bytes, err, stream); break;
    case 8: launch_index_select<8>(src, idx, dst, outer, n, src_size, inner_bytes, err, stream); break;
    case 4: launch_index_select<4>(src, idx, dst, outer, n, src_size, inner_bytes, err, stream); break;
    case 2: launch_index_select<2>(src, idx, dst, outer, n, src_size, inner_bytes, err, stream); break;
    default: launch_index_select<1>(src, idx, dst, outer, n, src_size, inner_bytes, err, stream); break;
  }
  cuda::maybe_check_now(in.device().index, stream);
}

namespace {
// gather's and scatter_add's walk over index: its sizes, and t's strides
// but along dim, which the kernels step by the index's values.
StridedIter index_geom(const Tensor& index, const Tensor& t, int64_t dim) {
  StridedIter geom;
  geom.ndim = static_cast<int>(index.dim());
  geom.nops = 1;
  geom.numel = index.numel();
  for (int64_t d = 0; d < index.dim(); ++d) {
    geom.sizes[d] = index.size(d);
    geom.strides[0][d] = d == dim ? 0 : t.stride(d);
  }
  return geom;
}
}  // namespace

void gather_cuda(const Tensor& in, const Tensor& index, Tensor& out, int64_t dim) {
  EMBER_CHECK(index.dtype() == DType::Int64, "gather: index must be int64, got ", index.dtype());
  const int64_t nd = index.dim();
  EMBER_CHECK(nd <= kMaxDims, "gather: at most ", kMaxDims, " dims supported, got ", nd);
  EMBER_CHECK(in.dim() == nd, "gather: index has ", nd, " dims but input has ", in.dim());
  EMBER_CHECK(nd == 0 ? dim == 0 : (dim >= 0 && dim < nd), "gather: dim ", dim, " out of range for ", nd, " dims");
  const int64_t numel = index.numel();
  if (numel == 0) return;
  cuda::DeviceGuard guard(in);
  cudaStream_t stream = cuda::stream_for(in);
  const StridedIter geom = index_geom(index, in, dim);
  const int64_t dim_size = nd == 0 ? 1 : in.size(dim), dim_stride = nd == 0 ? 0 : in.stride(dim);
  static const int32_t code = cuda_error_op_code("gather");
  const IndexError err{cuda_error_slot(in.device().index), code, dim};
  const void* src = in.raw_data();
  void* dst = out.raw_data();
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  switch (in.element_size()) {
    case 8: launch_gather<8>(geom, src, idx, dst, dim_stride, dim_size, err, stream); break;
    case 4: launch_gather<4>(geom, src, idx, dst, dim_stride, dim_size, err, stream); break;
    case 2: launch_gather<2>(geom, src, idx, dst, dim_stride, dim_size, err, stream); break;
    default: launch_gather<1>(geom, src, idx, dst, dim_stride, dim_size, err, stream); break;
  }
  cuda::maybe_check_now(in.device().index, stream);
}

void check_index_range_cuda(const Tensor& index, int64_t lo, int64_t hi, const char* op) {
  EMBER_CHECK(index.dtype() == DType::Int64 || index.dtype() == DType::Int32, op,
              ": indices must be int64 or int32, got ", index.dtype());
  const Tensor idx = index.contiguous();
  const int64_t n = idx.numel();
  if (n == 0) return;
  const int device = idx.device().index;
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  DeviceErrorSlot* slot = cuda_error_slot(device);
  const int32_t code = cuda_error_op_code(op);
  if (idx.dtype() == DType::Int64)
    check_range_kernel<int64_t><<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(
        static_cast<const int64_t*>(idx.raw_data()), n, lo, hi, slot, code);
  else
    check_range_kernel<int32_t><<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(
        static_cast<const int32_t*>(idx.raw_data()), n, lo, hi, slot, code);
  EMBER_CUDA_CHECK(cudaGetLastError());
  cuda::maybe_check_now(device, stream);
}

// ---- Accumulating adjoints (float / double; atomics because indices repeat) ----
namespace {
template <typename T>
__global__ void index_add_kernel(T* __restrict__ out, const int64_t* __restrict__ index, const T* __restrict__ src,
                                 int64_t outer, int64_t n, int64_t dst_size, int64_t inner) {
  const int64_t total = outer * n * inner;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < total; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % inner, j = (p / inner) % n, o = p / (inner * n);
    int64_t k = index[j];
    if (k < 0) k += dst_size;
    atomicAdd(out + (o * dst_size + k) * inner + i, src[p]);
  }
}

template <typename T>
__global__ void scatter_add_kernel(const __grid_constant__ StridedIter geom, T* __restrict__ out,
                                   const int64_t* __restrict__ index, const T* __restrict__ src, int64_t dim_stride,
                                   int64_t dim_size) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < geom.numel;
       p += int64_t(gridDim.x) * blockDim.x) {
    int64_t rem = p, off = 0;
    for (int d = geom.ndim - 1; d >= 0; --d) {
      off += (rem % geom.sizes[d]) * geom.strides[0][d];
      rem /= geom.sizes[d];
    }
    int64_t k = index[p];
    if (k < 0) k += dim_size;
    atomicAdd(out + off + k * dim_stride, src[p]);
  }
}

int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + cuda::kBlockSize - 1) / cuda::kBlockSize, cuda::kMaxGridBlocks));
}
}  // namespace

void index_add_cuda(Tensor& out, const Tensor& index, const Tensor& src, int64_t outer, int64_t dst_size,
                    int64_t inner) {
  const int64_t n = index.numel(), total = outer * n * inner;
  if (total == 0) return;
  cuda::DeviceGuard guard(out);
  cudaStream_t stream = cuda::stream_for(out);
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  if (out.dtype() == DType::Float64) {
    index_add_kernel<double><<<blocks_for(total), cuda::kBlockSize, 0, stream>>>(
        out.data<double>(), idx, src.data<double>(), outer, n, dst_size, inner);
  } else {
    EMBER_CHECK(out.dtype() == DType::Float32, "index_add: expected float32 or float64, got ", out.dtype());
    index_add_kernel<float><<<blocks_for(total), cuda::kBlockSize, 0, stream>>>(
        out.data<float>(), idx, src.data<float>(), outer, n, dst_size, inner);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void scatter_add_cuda(Tensor& out, const Tensor& index, const Tensor& src, int64_t dim) {
  const int64_t nd = index.dim(), numel = index.numel();
  EMBER_CHECK(nd <= kMaxDims, "scatter_add: at most ", kMaxDims, " dims supported, got ", nd);
  if (numel == 0) return;
  cuda::DeviceGuard guard(out);
  cudaStream_t stream = cuda::stream_for(out);
  const StridedIter geom = index_geom(index, out, dim);
  const int64_t dim_size = out.size(dim), dim_stride = out.stride(dim);
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  if (out.dtype() == DType::Float64) {
    scatter_add_kernel<double><<<blocks_for(numel), cuda::kBlockSize, 0, stream>>>(
        geom, out.data<double>(), idx, src.data<double>(), dim_stride, dim_size);
  } else {
    EMBER_CHECK(out.dtype() == DType::Float32, "scatter_add: expected float32 or float64, got ", out.dtype());
    scatter_add_kernel<float><<<blocks_for(numel), cuda::kBlockSize, 0, stream>>>(
        geom, out.data<float>(), idx, src.data<float>(), dim_stride, dim_size);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember
