// CUDA launchers for copy-with-cast, fill and arange. Copies between two
// dense buffers of one dtype become a cudaMemcpyAsync (the copy engine beats
// any kernel); same-dtype strided copies move raw bytes through one kernel
// per element size, so the 8x8 dtype instantiation is reserved for real
// conversions. Where both operands' innermost dim is dense, the copy moves
// 16-byte vectors along it (in_vectors): a transpose of attention's heads
// or a slice of a packed buffer as much as a contiguous cast. Conversions
// use cuda::cast_value, the rule the CPU copy uses: 16-bit floats via
// float, bool as "non-zero".
#include <cuda_runtime.h>

#include <cstring>
#include <optional>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::VecN;

// Raw element of a given byte width; copying bits needs no dtype.
template <int BYTES> struct Bits;
template <> struct Bits<1> { using type = uint8_t; };
template <> struct Bits<2> { using type = uint16_t; };
template <> struct Bits<4> { using type = uint32_t; };
template <> struct Bits<8> { using type = uint64_t; };

// ---- Kernels ----

template <typename D, typename S>
__global__ void cast_contig_kernel(D* __restrict__ out, const S* __restrict__ in, int64_t n) {
  cuda::grid_stride_loop(n, [&](int64_t i) { out[i] = cuda::cast_value<D, S>(in[i]); });
}

// VEC elements an index: the launcher's iteration space then counts vectors
// (in_vectors), so one decomposition of the index serves VEC elements and
// the wider operand moves 16 bytes a load or store.
template <typename D, typename S, int VEC>
__global__ void cast_strided_kernel(const __grid_constant__ StridedIter it,
                                    const __grid_constant__ cuda::SizeDivs divs) {
  cuda::grid_stride_loop(it.numel, [&](int64_t i) {
    int64_t off[2];
    cuda::strided_offsets<2>(it, divs, i, off);
    const VecN<S, VEC> x = reinterpret_cast<const VecN<S, VEC>*>(it.data[1])[off[1]];
    VecN<D, VEC> y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) y.v[j] = cuda::cast_value<D, S>(x.v[j]);
    reinterpret_cast<VecN<D, VEC>*>(it.data[0])[off[0]] = y;
  });
}

template <typename T, int VEC>
__global__ void fill_contig_kernel(T* __restrict__ out, T value, int64_t n) {
  VecN<T, VEC> v;
#pragma unroll
  for (int j = 0; j < VEC; ++j) v.v[j] = value;
  const int64_t nvec = n / VEC;
  for (int64_t i = cuda::global_thread_id(); i < nvec; i += cuda::grid_stride())
    reinterpret_cast<VecN<T, VEC>*>(out)[i] = v;
  for (int64_t i = nvec * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride()) out[i] = value;
}

template <typename T>
__global__ void fill_strided_kernel(const __grid_constant__ StridedIter it, const __grid_constant__ cuda::SizeDivs divs,
                                    T value) {
  cuda::grid_stride_loop(it.numel, [&](int64_t i) {
    int64_t off[1];
    cuda::strided_offsets<1>(it, divs, i, off);
    *cuda::operand_ptr<T>(it, 0, off[0]) = value;
  });
}

template <typename T>
__global__ void arange_kernel(T* __restrict__ out, double start, double step, int64_t n) {
  // Computed from i (not accumulated) in double so long ranges do not drift.
  cuda::grid_stride_loop(n, [&](int64_t i) {
    out[i] = cuda::cast_value<T, double>(start + static_cast<double>(i) * step);
  });
}

// ---- Launchers ----

struct Launch {
  cudaStream_t stream;
  int block = cuda::kBlockSize;
};

// Vectors of 16 bytes of the wider type, for raw copies and conversions
// among the float types a training step casts between; others (integers,
// float64, float8) go an element at a time, which keeps the pairs' kernels
// few.
template <typename T>
constexpr bool kStepFloat = std::is_same_v<T, float> || std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;
template <typename D, typename S>
constexpr int cast_vec_width() {
  constexpr bool raw = std::is_same_v<D, S> && std::is_unsigned_v<D> && !std::is_same_v<D, bool>;  // Bits<N>
  if constexpr (!raw && !(kStepFloat<D> && kStepFloat<S>))
    return 1;
  else
    return cuda::vec_width<D>() < cuda::vec_width<S>() ? cuda::vec_width<D>() : cuda::vec_width<S>();
}

// it's iteration space in vectors of VEC elements: where both operands'
// innermost dim is dense (stride 1), VEC divides its size and every other
// stride, and both pointers are aligned for a vector, every vector lies
// whole and aligned in both. So a contiguous tensor is one dim of vectors,
// and a head-split transpose ([B, H, T, D] to [B, T, H, D]) or a slice of a
// packed buffer (q's columns of qkv) keeps its rows' vectors. nullopt where
// the layout does not allow it.
template <typename D, typename S, int VEC>
std::optional<StridedIter> in_vectors(const StridedIter& it) {
  if constexpr (VEC == 1) {
    return std::nullopt;
  } else {
    const int in = it.ndim - 1;
    if (it.ndim < 1 || it.sizes[in] % VEC != 0) return std::nullopt;
    for (int o = 0; o < 2; ++o) {
      if (it.strides[o][in] != 1) return std::nullopt;
      for (int d = 0; d < in; ++d)
        if (it.strides[o][d] % VEC != 0) return std::nullopt;
    }
    if (!cuda::is_aligned_for<D, VEC>(it.data[0]) || !cuda::is_aligned_for<S, VEC>(it.data[1])) return std::nullopt;
    StridedIter v = it;
    v.numel /= VEC;
    v.sizes[in] /= VEC;
    for (int o = 0; o < 2; ++o)
      for (int d = 0; d < in; ++d) v.strides[o][d] /= VEC;
    return v;
  }
}

template <typename D, typename S>
void launch_cast(const StridedIter& it, Launch l) {
  constexpr int VEC = cast_vec_width<D, S>();
  if (const std::optional<StridedIter> v = in_vectors<D, S, VEC>(it)) {
    cast_strided_kernel<D, S, VEC>
        <<<cuda::grid_for(v->numel, l.block), l.block, 0, l.stream>>>(*v, cuda::size_divs(*v));
  } else if (it.all_contiguous()) {
    cast_contig_kernel<D, S><<<cuda::grid_for(it.numel, l.block), l.block, 0, l.stream>>>(
        reinterpret_cast<D*>(it.data[0]), reinterpret_cast<const S*>(it.data[1]), it.numel);
  } else {
    cast_strided_kernel<D, S, 1><<<cuda::grid_for(it.numel, l.block), l.block, 0, l.stream>>>(it, cuda::size_divs(it));
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_fill(const StridedIter& it, T value, Launch l) {
  constexpr int VEC = cuda::vec_width<T>();
  if (it.all_contiguous()) {
    T* out = reinterpret_cast<T*>(it.data[0]);
    // Zero (and any value whose bytes are all equal) is a memset.
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    bool uniform = true;
    for (size_t j = 1; j < sizeof(T); ++j) uniform &= bytes[j] == bytes[0];
    if (uniform) {
      EMBER_CUDA_CHECK(cudaMemsetAsync(out, bytes[0], it.numel * sizeof(T), l.stream));
      return;
    }
    if (cuda::is_aligned_for<T, VEC>(out)) {
      fill_contig_kernel<T, VEC><<<cuda::grid_for(it.numel, l.block, VEC), l.block, 0, l.stream>>>(out, value,
                                                                                                    it.numel);
    } else {
      fill_contig_kernel<T, 1><<<cuda::grid_for(it.numel, l.block), l.block, 0, l.stream>>>(out, value, it.numel);
    }
  } else {
    fill_strided_kernel<T><<<cuda::grid_for(it.numel, l.block), l.block, 0, l.stream>>>(it, cuda::size_divs(it), value);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void copy_cuda(const StridedIter& it) {
  if (it.numel == 0) return;
  const int device = cuda::device_of(it);
  cuda::DeviceGuard guard(device);
  Launch l{cuda::stream_for(device)};
  const DType dt = it.dtypes[0], st = it.dtypes[1];
  if (dt == st) {
    const size_t es = dtype_size(dt);
    if (it.all_contiguous()) {
      if (it.data[0] != it.data[1])
        EMBER_CUDA_CHECK(
            cudaMemcpyAsync(it.data[0], it.data[1], it.numel * es, cudaMemcpyDeviceToDevice, l.stream));
      return;
    }
    switch (es) {
      case 1: launch_cast<Bits<1>::type, Bits<1>::type>(it, l); return;
      case 2: launch_cast<Bits<2>::type, Bits<2>::type>(it, l); return;
      case 4: launch_cast<Bits<4>::type, Bits<4>::type>(it, l); return;
      case 8: launch_cast<Bits<8>::type, Bits<8>::type>(it, l); return;
    }
    EMBER_CHECK(false, "copy: unsupported element size ", es, " for dtype ", dt);
  }
  EMBER_DISPATCH_CAST(dt, "copy", [&] {
    using D = scalar_t;
    EMBER_DISPATCH_CAST(st, "copy", [&] {
      using S = scalar_t;
      launch_cast<D, S>(it, l);
    });
  });
}

void fill_cuda(const StridedIter& it, double value) {
  if (it.numel == 0) return;
  const int device = cuda::device_of(it);
  cuda::DeviceGuard guard(device);
  Launch l{cuda::stream_for(device)};
  EMBER_DISPATCH_CAST(it.dtypes[0], "fill", [&] {
    using T = scalar_t;
    launch_fill<T>(it, cuda::cast_value<T, double>(value), l);
  });
}

void arange_cuda(Tensor& out, double start, double step) {
  const int64_t n = out.numel();
  if (n == 0) return;
  EMBER_CHECK(out.is_contiguous(), "arange: output must be contiguous");
  cuda::DeviceGuard guard(out);
  cudaStream_t stream = cuda::stream_for(out);
  EMBER_DISPATCH_ALL(out.dtype(), "arange", [&] {
    using T = scalar_t;
    const int block = cuda::kBlockSize;
    arange_kernel<T><<<cuda::grid_for(n, block), block, 0, stream>>>(static_cast<T*>(out.raw_data()), start, step, n);
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace ember
