// CUDA launchers for index_select and gather, and for their adjoints
// (index_add, scatter_add: a sort, then sums in the CPU's order; see the
// section's comment). index_select and gather only move bytes, so their
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

#include <algorithm>
#include <cstdint>
#include <limits>

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
__global__ void gather_kernel(const __grid_constant__ StridedIter geom, const __grid_constant__ cuda::SizeDivs divs,
                              const U* __restrict__ in, const int64_t* __restrict__ index, U* __restrict__ out,
                              int64_t dim_stride, int64_t dim_size, IndexError err) {
  cuda::grid_stride_loop(geom.numel, [&](int64_t i) {
    int64_t off[1];
    cuda::strided_offsets<1>(geom, divs, i, off);
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
      geom, cuda::size_divs(geom), static_cast<const U*>(in), index, static_cast<U*>(out), dim_stride, dim_size, err);
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

// ---- Accumulating adjoints: a stable sort, then each element's sum in order ----
//
// index_add (index_select's and the embedding's backward) and scatter_add
// (gather's) add several source values into one element when an index
// repeats. Atomics would add them in whatever order the threads arrive, so a
// step's gradients would change from run to run. Instead the items are sorted
// by the element they add to, ties kept in item order, and one thread per
// element adds its items in that order, starting from the element's value:
// the CPU kernels' order, so both backends give the same sums bit for bit
// (as PyTorch's embedding backward sorts; its index_add_ uses atomics).
namespace {
constexpr int kSortThreads = 512, kSortItems = 8, kDigitBits = 4, kDigits = 1 << kDigitBits;
constexpr int64_t kSortTile = int64_t{kSortThreads} * kSortItems;

// Item j of index_add adds to row index[j] (negative counting from the end).
struct IndexKeys {
  const int64_t* index;
  int64_t size;
  __device__ int64_t operator()(int64_t j) const {
    const int64_t k = index[j];
    return k < 0 ? k + size : k;
  }
};

// Item p of scatter_add adds to the element of out at this offset: p's
// coordinates with `dim` replaced by index[p].
struct ScatterKeys {
  StridedIter geom;     // the index's sizes, out's strides, 0 at dim
  cuda::SizeDivs divs;  // geom's
  const int64_t* index;
  int64_t dim_stride, dim_size;
  __device__ int64_t operator()(int64_t p) const {
    int64_t off[1];
    cuda::strided_offsets<1>(geom, divs, p, off);
    int64_t k = index[p];
    if (k < 0) k += dim_size;
    return off[0] + k * dim_stride;
  }
};

// Two key and two item buffers; pass p reads pair (p - 1) & 1, writes p & 1.
struct SortBuffers {
  int64_t* keys[2];
  int64_t* items[2];
};

// A least-significant-digit radix sort of (key_of(j), j) for j < n by key,
// four bits a pass, ties in item order, in one block: the index lists of a
// training step are small (tokens a rank sees), and one block needs no
// global histogram between launches, so the sort is one launch. Each pass
// counts the digits of the whole list, then walks it in tiles of kSortTile:
// thread t holds the tile's items [t * kSortItems, (t + 1) * kSortItems), so
// a scan of the per-thread digit counts in digit-major order gives every
// item its place with earlier items first (a stable pass). No atomics: the
// order is the same on every run.
template <typename KeyFn>
__global__ void __launch_bounds__(kSortThreads)
    sort_by_key_kernel(const __grid_constant__ KeyFn key_of, int64_t n, int passes, SortBuffers buf) {
  __shared__ int counts[kDigits * kSortThreads];  // [digit][thread], then its exclusive scan
  __shared__ int partial[kSortThreads];
  __shared__ int64_t start[kDigits];  // the pass's first slot of each digit
  __shared__ int64_t seen[kDigits];   // items of each digit placed by earlier tiles
  __shared__ int tile_total;
  const int t = threadIdx.x;
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * kDigitBits;
    const int64_t* keys_in = pass == 0 ? nullptr : buf.keys[(pass - 1) & 1];
    const int64_t* items_in = pass == 0 ? nullptr : buf.items[(pass - 1) & 1];
    int64_t* keys_out = buf.keys[pass & 1];
    int64_t* items_out = buf.items[pass & 1];
    auto key_at = [&](int64_t i) { return pass == 0 ? key_of(i) : keys_in[i]; };
    auto digit_of = [&](int64_t key) { return static_cast<int>((key >> shift) & (kDigits - 1)); };

    // The whole list's count of each digit, summed over the threads.
    int c[kDigits];
#pragma unroll
    for (int d = 0; d < kDigits; ++d) c[d] = 0;
    for (int64_t i = t; i < n; i += kSortThreads) {
      const int dig = digit_of(key_at(i));
#pragma unroll
      for (int d = 0; d < kDigits; ++d) c[d] += dig == d;
    }
#pragma unroll
    for (int d = 0; d < kDigits; ++d) counts[d * kSortThreads + t] = c[d];
    __syncthreads();
    for (int s = kSortThreads / 2; s > 0; s /= 2) {
      if (t < s)
        for (int d = 0; d < kDigits; ++d) counts[d * kSortThreads + t] += counts[d * kSortThreads + t + s];
      __syncthreads();
    }
    if (t == 0) {
      int64_t at = 0;
      for (int d = 0; d < kDigits; ++d) {
        start[d] = at;
        seen[d] = 0;
        at += counts[d * kSortThreads];
      }
    }
    __syncthreads();

    for (int64_t tile = 0; tile < n; tile += kSortTile) {
      const int64_t first = tile + int64_t{t} * kSortItems;
      int64_t key[kSortItems];
#pragma unroll
      for (int d = 0; d < kDigits; ++d) c[d] = 0;
#pragma unroll
      for (int j = 0; j < kSortItems; ++j) {
        key[j] = first + j < n ? key_at(first + j) : 0;
        const int dig = first + j < n ? digit_of(key[j]) : -1;
#pragma unroll
        for (int d = 0; d < kDigits; ++d) c[d] += dig == d;
      }
#pragma unroll
      for (int d = 0; d < kDigits; ++d) counts[d * kSortThreads + t] = c[d];
      __syncthreads();
      // Exclusive scan of counts[] read flat: thread t scans entries
      // [t * kDigits, (t + 1) * kDigits) itself, then the threads' sums
      // are scanned across the block (Hillis-Steele).
      int* mine = counts + t * kDigits;
      int run = 0;
      for (int e = 0; e < kDigits; ++e) {
        const int v = mine[e];
        mine[e] = run;
        run += v;
      }
      partial[t] = run;
      __syncthreads();
      for (int s = 1; s < kSortThreads; s *= 2) {
        const int v = t >= s ? partial[t - s] : 0;
        __syncthreads();
        partial[t] += v;
        __syncthreads();
      }
      const int before = partial[t] - run;  // exclusive
      for (int e = 0; e < kDigits; ++e) mine[e] += before;
      if (t == kSortThreads - 1) tile_total = partial[t];
      __syncthreads();
      // counts[d][t] now holds the tile's items of digit < d plus those of
      // digit d held by threads before t; counts[d][0] the first part alone.
      int rank[kDigits];
#pragma unroll
      for (int d = 0; d < kDigits; ++d) rank[d] = counts[d * kSortThreads + t] - counts[d * kSortThreads];
#pragma unroll
      for (int j = 0; j < kSortItems; ++j) {
        if (first + j >= n) break;
        const int dig = digit_of(key[j]);
        int r = 0;
#pragma unroll
        for (int d = 0; d < kDigits; ++d)
          if (dig == d) r = rank[d]++;
        const int64_t slot = start[dig] + seen[dig] + r;
        keys_out[slot] = key[j];
        items_out[slot] = pass == 0 ? first + j : items_in[first + j];
      }
      __syncthreads();
      if (t < kDigits) {
        const int next = t + 1 < kDigits ? counts[(t + 1) * kSortThreads] : tile_total;
        seen[t] += next - counts[t * kSortThreads];
      }
      __syncthreads();  // seen[] and counts[] are read and rewritten by the next tile
    }
  }
}

// Element k's sum: one thread per (outer, sorted item, column), of which
// the first item of each run of equal keys adds the whole run in item order
// (the CPU's order, so the same bits). The cost is a run's length in
// dependent adds: a token on every row of a long batch (padding, say) is a
// chain of that many; splitting runs into partial sums, as PyTorch does,
// would be faster there but no longer equal to the CPU.
template <typename T>
__global__ void index_add_sorted_kernel(T* __restrict__ out, const int64_t* __restrict__ keys,
                                        const int64_t* __restrict__ items, const T* __restrict__ src, int64_t outer,
                                        int64_t n, int64_t dst_size, int64_t inner) {
  cuda::grid_stride_loop(outer * n * inner, [&](int64_t p) {
    const int64_t i = p % inner, q = (p / inner) % n, o = p / (inner * n);
    const int64_t k = keys[q];
    if (q > 0 && keys[q - 1] == k) return;
    T* dst = out + (o * dst_size + k) * inner + i;
    T acc = *dst;
    for (int64_t r = q; r < n && keys[r] == k; ++r) acc += src[(o * n + items[r]) * inner + i];
    *dst = acc;
  });
}

template <typename T>
__global__ void scatter_add_sorted_kernel(T* __restrict__ out, const int64_t* __restrict__ keys,
                                          const int64_t* __restrict__ items, const T* __restrict__ src, int64_t n) {
  cuda::grid_stride_loop(n, [&](int64_t q) {
    const int64_t k = keys[q];
    if (q > 0 && keys[q - 1] == k) return;
    T acc = out[k];
    for (int64_t r = q; r < n && keys[r] == k; ++r) acc += src[items[r]];
    out[k] = acc;
  });
}

// The n items sorted by key (every key below key_limit), ties in item
// order: `sorted` holds [keys | items] as two halves of one int64 tensor.
template <typename KeyFn>
Tensor sort_by_key(const KeyFn& key_of, int64_t n, int64_t key_limit, Device device, cudaStream_t stream) {
  // The sort counts in int: a digit's count must fit.
  EMBER_CHECK(n <= std::numeric_limits<int32_t>::max(), "index_add/scatter_add on CUDA: ", n,
              " indices; at most 2^31 - 1 are supported");
  int bits = 0;
  while (bits < 63 && (int64_t{1} << bits) < key_limit) ++bits;
  const int passes = std::max(1, (bits + kDigitBits - 1) / kDigitBits);
  Tensor scratch = Tensor::empty({4, n}, {DType::Int64, device});
  int64_t* base = static_cast<int64_t*>(scratch.raw_data());
  const SortBuffers buf{{base, base + 2 * n}, {base + n, base + 3 * n}};
  sort_by_key_kernel<KeyFn><<<1, kSortThreads, 0, stream>>>(key_of, n, passes, buf);
  EMBER_CUDA_CHECK(cudaGetLastError());
  return scratch.narrow(0, (passes - 1) & 1 ? 2 : 0, 2);
}

template <typename T>
void launch_index_add(Tensor& out, const Tensor& sorted, const Tensor& src, int64_t outer, int64_t n, int64_t dst_size,
                      int64_t inner, cudaStream_t stream) {
  const int64_t* keys = static_cast<const int64_t*>(sorted.raw_data());
  index_add_sorted_kernel<T><<<cuda::grid_for(outer * n * inner), cuda::kBlockSize, 0, stream>>>(
      out.data<T>(), keys, keys + n, src.data<T>(), outer, n, dst_size, inner);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_scatter_add(Tensor& out, const Tensor& sorted, const Tensor& src, int64_t n, cudaStream_t stream) {
  const int64_t* keys = static_cast<const int64_t*>(sorted.raw_data());
  scatter_add_sorted_kernel<T>
      <<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(out.data<T>(), keys, keys + n, src.data<T>(), n);
  EMBER_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

void index_add_cuda(Tensor& out, const Tensor& index, const Tensor& src, int64_t outer, int64_t dst_size,
                    int64_t inner) {
  const int64_t n = index.numel();
  if (outer * n * inner == 0) return;
  EMBER_CHECK(out.dtype() == DType::Float32 || out.dtype() == DType::Float64,
              "index_add: expected float32 or float64, got ", out.dtype());
  cuda::DeviceGuard guard(out);
  cudaStream_t stream = cuda::stream_for(out);
  const IndexKeys keys{static_cast<const int64_t*>(index.raw_data()), dst_size};
  const Tensor sorted = sort_by_key(keys, n, dst_size, out.device(), stream);
  if (out.dtype() == DType::Float64)
    launch_index_add<double>(out, sorted, src, outer, n, dst_size, inner, stream);
  else
    launch_index_add<float>(out, sorted, src, outer, n, dst_size, inner, stream);
}

void scatter_add_cuda(Tensor& out, const Tensor& index, const Tensor& src, int64_t dim) {
  const int64_t nd = index.dim(), n = index.numel();
  EMBER_CHECK(nd <= kMaxDims, "scatter_add: at most ", kMaxDims, " dims supported, got ", nd);
  if (n == 0) return;
  EMBER_CHECK(out.dtype() == DType::Float32 || out.dtype() == DType::Float64,
              "scatter_add: expected float32 or float64, got ", out.dtype());
  cuda::DeviceGuard guard(out);
  cudaStream_t stream = cuda::stream_for(out);
  // Keys are offsets into out: below 1 + the sum of (size - 1) * stride.
  int64_t limit = 1;
  for (int64_t d = 0; d < out.dim(); ++d) limit += (out.size(d) - 1) * out.stride(d);
  const bool scalar = out.dim() == 0;
  const StridedIter geom = index_geom(index, out, dim);
  const ScatterKeys keys{geom, cuda::size_divs(geom), static_cast<const int64_t*>(index.raw_data()),
                         scalar ? 0 : out.stride(dim), scalar ? 1 : out.size(dim)};
  const Tensor sorted = sort_by_key(keys, n, limit, out.device(), stream);
  if (out.dtype() == DType::Float64)
    launch_scatter_add<double>(out, sorted, src, n, stream);
  else
    launch_scatter_add<float>(out, sorted, src, n, stream);
}

}  // namespace ember
