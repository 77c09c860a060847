// CUDA launchers for the binary elementwise ops (add, sub, mul, div, pow,
// maximum, minimum, comparisons) and the ternary where. The math is
// binary_fn from elementwise_fns.h, shared with binary.cc, evaluated in
// acc_t<T>. Three shapes of work get a vectorized kernel because they cover
// nearly all real traffic: both inputs contiguous, tensor (op) scalar and
// scalar (op) tensor (a 0-stride input is read once per thread); everything
// else, including broadcasts along inner dims, unravels each linear index.
#include <cuda_runtime.h>

#include <type_traits>

// m_pow's `y < 0` and similar sign tests are always false for uint8/bool.
#pragma nv_diag_suppress 186

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::VecN;

template <BinaryOp OP, typename T>
using out_t = std::conditional_t<(OP >= BinaryOp::Eq), bool, T>;

// ---- Kernels ----

// out, a, b are dense 1-D; a_scalar/b_scalar mark a 0-stride input (its one
// value is broadcast). The flags are uniform across the grid, so the branches
// cost nothing, and one kernel covers all three fast cases.
// A host scalar (a_host/b_host) arrives as the value a_val/b_val instead.
template <BinaryOp OP, typename T, int VEC>
__global__ void binary_contig_kernel(out_t<OP, T>* __restrict__ out, const T* __restrict__ a,
                                     const T* __restrict__ b, bool a_scalar, bool b_scalar, int64_t n,
                                     acc_t<T> alpha, bool a_host, acc_t<T> a_val, bool b_host, acc_t<T> b_val) {
  using C = acc_t<T>;
  using O = out_t<OP, T>;
  const C a0 = a_scalar ? (a_host ? a_val : static_cast<C>(a[0])) : C(0);
  const C b0 = b_scalar ? (b_host ? b_val : static_cast<C>(b[0])) : C(0);
  const int64_t nvec = n / VEC;
  for (int64_t v = cuda::global_thread_id(); v < nvec; v += cuda::grid_stride()) {
    VecN<T, VEC> va, vb;
    if (!a_scalar) va = reinterpret_cast<const VecN<T, VEC>*>(a)[v];
    if (!b_scalar) vb = reinterpret_cast<const VecN<T, VEC>*>(b)[v];
    VecN<O, VEC> r;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const C x = a_scalar ? a0 : static_cast<C>(va.v[j]);
      const C y = b_scalar ? b0 : static_cast<C>(vb.v[j]);
      r.v[j] = static_cast<O>(binary_fn<OP, C>(x, y, alpha));
    }
    reinterpret_cast<VecN<O, VEC>*>(out)[v] = r;
  }
  for (int64_t i = nvec * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride()) {
    const C x = a_scalar ? a0 : static_cast<C>(a[i]);
    const C y = b_scalar ? b0 : static_cast<C>(b[i]);
    out[i] = static_cast<O>(binary_fn<OP, C>(x, y, alpha));
  }
}

template <BinaryOp OP, typename T>
__global__ void binary_strided_kernel(const __grid_constant__ StridedIter it,
                                      const __grid_constant__ cuda::SizeDivs divs, acc_t<T> alpha) {
  using C = acc_t<T>;
  using O = out_t<OP, T>;
  cuda::grid_stride_loop(it.numel, [&](int64_t i) {
    int64_t off[3];
    cuda::strided_offsets<3>(it, divs, i, off);
    const C x = cuda::operand_value<T, C>(it, 1, off[1]);
    const C y = cuda::operand_value<T, C>(it, 2, off[2]);
    *cuda::operand_ptr<O>(it, 0, off[0]) = static_cast<O>(binary_fn<OP, C>(x, y, alpha));
  });
}

template <typename T, int VEC>
__global__ void where_contig_kernel(T* __restrict__ out, const bool* __restrict__ cond, const T* __restrict__ a,
                                    const T* __restrict__ b, int64_t n) {
  const int64_t nvec = n / VEC;
  for (int64_t v = cuda::global_thread_id(); v < nvec; v += cuda::grid_stride()) {
    const VecN<bool, VEC> c = reinterpret_cast<const VecN<bool, VEC>*>(cond)[v];
    const VecN<T, VEC> x = reinterpret_cast<const VecN<T, VEC>*>(a)[v];
    const VecN<T, VEC> y = reinterpret_cast<const VecN<T, VEC>*>(b)[v];
    VecN<T, VEC> r;
#pragma unroll
    for (int j = 0; j < VEC; ++j) r.v[j] = c.v[j] ? x.v[j] : y.v[j];
    reinterpret_cast<VecN<T, VEC>*>(out)[v] = r;
  }
  for (int64_t i = nvec * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride())
    out[i] = cond[i] ? a[i] : b[i];
}

template <typename T>
__global__ void where_strided_kernel(const __grid_constant__ StridedIter it,
                                     const __grid_constant__ cuda::SizeDivs divs) {
  cuda::grid_stride_loop(it.numel, [&](int64_t i) {
    int64_t off[4];
    cuda::strided_offsets<4>(it, divs, i, off);
    const bool c = *cuda::operand_ptr<const bool>(it, 1, off[1]);
    *cuda::operand_ptr<T>(it, 0, off[0]) =
        c ? *cuda::operand_ptr<const T>(it, 2, off[2]) : *cuda::operand_ptr<const T>(it, 3, off[3]);
  });
}

// ---- Launchers ----

// 1-D with out dense and each input either dense or a broadcast scalar.
bool is_dense_or_scalar(const StridedIter& it) {
  if (it.ndim != 1 || it.strides[0][0] != 1) return false;
  for (int o = 1; o < it.nops; ++o)
    if (it.strides[o][0] != 1 && it.strides[o][0] != 0) return false;
  return true;
}

template <BinaryOp OP, typename T>
void launch_binary(const StridedIter& it, acc_t<T> alpha, cudaStream_t stream) {
  using O = out_t<OP, T>;
  constexpr int VEC = cuda::vec_width<T>();
  const int block = cuda::kBlockSize;
  const int64_t n = it.numel;
  if (is_dense_or_scalar(it)) {
    O* out = reinterpret_cast<O*>(it.data[0]);
    const T* a = reinterpret_cast<const T*>(it.data[1]);
    const T* b = reinterpret_cast<const T*>(it.data[2]);
    // (A host scalar is a scalar whatever its stride: a one-element output
    // gives every operand stride 1.)
    const bool a_scalar = it.strides[1][0] == 0 || it.is_host_scalar(1);
    const bool b_scalar = it.strides[2][0] == 0 || it.is_host_scalar(2);
    const bool aligned = cuda::is_aligned_for<O, VEC>(out) && (a_scalar || cuda::is_aligned_for<T, VEC>(a)) &&
                         (b_scalar || cuda::is_aligned_for<T, VEC>(b));
    const bool ah = it.is_host_scalar(1), bh = it.is_host_scalar(2);
    const acc_t<T> av = cuda::host_scalar_value<acc_t<T>>(it, 1), bv = cuda::host_scalar_value<acc_t<T>>(it, 2);
    if (aligned) {
      binary_contig_kernel<OP, T, VEC><<<cuda::grid_for(n, block, VEC), block, 0, stream>>>(
          out, a, b, a_scalar, b_scalar, n, alpha, ah, av, bh, bv);
    } else {
      binary_contig_kernel<OP, T, 1><<<cuda::grid_for(n, block), block, 0, stream>>>(out, a, b, a_scalar, b_scalar,
                                                                                     n, alpha, ah, av, bh, bv);
    }
  } else {
    binary_strided_kernel<OP, T><<<cuda::grid_for(n, block), block, 0, stream>>>(it, cuda::size_divs(it), alpha);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_where(const StridedIter& it, cudaStream_t stream) {
  // Vector width bounded by the bool condition: 16 T's would need a 16-byte
  // aligned T vector and a 16-byte bool vector at once; 4 keeps both cheap.
  constexpr int VEC = cuda::vec_width<T>() < 4 ? cuda::vec_width<T>() : 4;
  const int block = cuda::kBlockSize;
  const int64_t n = it.numel;
  if (it.all_contiguous()) {
    T* out = reinterpret_cast<T*>(it.data[0]);
    const bool* c = reinterpret_cast<const bool*>(it.data[1]);
    const T* a = reinterpret_cast<const T*>(it.data[2]);
    const T* b = reinterpret_cast<const T*>(it.data[3]);
    if (cuda::is_aligned_for<T, VEC>(out) && cuda::is_aligned_for<bool, VEC>(c) && cuda::is_aligned_for<T, VEC>(a) &&
        cuda::is_aligned_for<T, VEC>(b)) {
      where_contig_kernel<T, VEC><<<cuda::grid_for(n, block, VEC), block, 0, stream>>>(out, c, a, b, n);
    } else {
      where_contig_kernel<T, 1><<<cuda::grid_for(n, block), block, 0, stream>>>(out, c, a, b, n);
    }
  } else {
    where_strided_kernel<T><<<cuda::grid_for(n, block), block, 0, stream>>>(it, cuda::size_divs(it));
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void binary_cuda(BinaryOp op, const StridedIter& it, double alpha) {
  if (it.numel == 0) return;
  const int device = cuda::device_of(it);
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  dispatch_binary_typed(op, it.dtypes[1], alpha, [&](auto op_c, auto tag, auto al) {
    launch_binary<decltype(op_c)::value, decltype(tag)>(it, al, stream);
  });
}

void where_cuda(const StridedIter& it) {
  if (it.numel == 0) return;
  const int device = cuda::device_of(it);
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  EMBER_DISPATCH_ALL(it.dtypes[0], "where", [&] { launch_where<scalar_t>(it, stream); });
}

}  // namespace ember
