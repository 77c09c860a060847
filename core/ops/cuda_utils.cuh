// Shared plumbing for the .cu launchers: which device and stream a launch
// belongs to (an RAII DeviceGuard, because every cudaMalloc/launch/cuBLAS call
// acts on the *current* device, which may not be the tensor's), launch
// geometry, grid-stride loops, 16-byte vector access for contiguous fast paths,
// strided offset computation from a StridedIter passed by value as a kernel
// parameter, and warp shuffles that also accept the small integer types the
// reductions carry. Header-only: each helper is small enough to inline.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/ops/int_div.h"
#include "core/ops/kernels.h"
#include "core/tensor.h"

namespace ember::cuda {

constexpr int kMaxCudaDevices = 16;  // matches the per-thread stream table in device.cc
constexpr int kBlockSize = 256;
constexpr int kWarpSize = 32;
// Enough blocks to fill any current GPU many times over; past this a
// grid-stride loop covers the rest, so a launch never exceeds grid limits.
constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;

inline cudaStream_t stream_for(int device) { return static_cast<cudaStream_t>(Stream::current(device).handle); }
inline cudaStream_t stream_for(const Tensor& t) { return stream_for(t.device().index); }

// Device owning a pointer. StridedIter carries raw pointers but no device, so
// launchers taking one must ask the driver; a single-GPU process (the common
// case) skips the query.
inline int device_of_pointer(const void* p) {
  if (p == nullptr || cuda_device_count() <= 1) return 0;
  cudaPointerAttributes attr{};
  EMBER_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  return attr.device < 0 ? 0 : attr.device;
}
inline int device_of(const StridedIter& it) { return device_of_pointer(it.nops > 0 ? it.data[0] : nullptr); }

// Makes `device` current for the scope and restores the previous device, so a
// launcher can be called from code that is working with another GPU.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    EMBER_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) {
      EMBER_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  explicit DeviceGuard(const Tensor& t) : DeviceGuard(t.device().index) {}
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);  // destructors must not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

inline int sm_count(int device) {
  static std::atomic<int> cache[kMaxCudaDevices] = {};
  if (device < 0 || device >= kMaxCudaDevices) device = 0;
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    EMBER_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

// A library's handle on one device (cuBLAS, cuDNN), and the lock that
// serializes setting its stream and the calls that follow: the handle's
// stream is shared state, and two threads interleaving them would launch on
// each other's streams.
template <typename Handle>
struct HandleSlot {
  std::once_flag once;
  Handle handle = nullptr;
  std::mutex mu;
};

// `device`'s slot of the library whose handles are Handle, the handle made
// by create(&handle) on first use, on that device (a handle binds to the
// device current at creation). call_once retries if creation throws, so a
// transient failure is not sticky. The slots are leaked on purpose: a
// library's destroy at static-destruction time can run after the CUDA
// runtime has shut down.
template <typename Handle>
HandleSlot<Handle>* handle_slots() {
  static HandleSlot<Handle> slots[kMaxCudaDevices];
  return slots;
}
template <typename Handle, typename Create>
HandleSlot<Handle>& handle_slot(const char* op, int device, Create&& create) {
  EMBER_CHECK(device >= 0 && device < kMaxCudaDevices, op, ": CUDA device index ", device, " out of range");
  HandleSlot<Handle>& s = handle_slots<Handle>()[device];
  std::call_once(s.once, [&] {
    DeviceGuard guard(device);
    create(&s.handle);
  });
  return s;
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for n work items of `per_thread` elements each, capped (grid-stride
// loops handle the remainder). Always at least one block.
inline unsigned grid_for(int64_t n, int block = kBlockSize, int per_thread = 1) {
  int64_t blocks = ceil_div(std::max<int64_t>(n, 1), int64_t{block} * per_thread);
  return static_cast<unsigned>(std::min(blocks, kMaxGridBlocks));
}

// Threads per block for a 1-D problem of n items: a full block unless the
// problem is tiny, rounded up to whole warps.
inline int block_for(int64_t n, int max_block = kBlockSize) {
  int64_t b = std::min<int64_t>(max_block, std::max<int64_t>(n, 1));
  return static_cast<int>(ceil_div(b, kWarpSize) * kWarpSize);
}

__device__ __forceinline__ int64_t global_thread_id() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// for (i = thread; i < n; i += all threads) f(i);
template <typename F>
__device__ __forceinline__ void grid_stride_loop(int64_t n, F&& f) {
  for (int64_t i = global_thread_id(); i < n; i += grid_stride()) f(i);
}

// N elements moved as one 16-byte (or narrower) transaction.
template <typename T, int N>
struct alignas(sizeof(T) * N) VecN {
  T v[N];
};

template <typename T>
constexpr int vec_width() { return sizeof(T) >= 16 ? 1 : static_cast<int>(16 / sizeof(T)); }

template <typename T, int N>
inline bool is_aligned_for(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * N) == 0;
}

// Calls launch(VEC, grid) with VEC the 16-byte width of T where `divisible`
// holds and every non-null pointer is aligned for it, else 1, and the grid
// for n elements at VEC: the elementwise kernels' choice of vector loads.
// `divisible`: a kernel whose vectors must not straddle something (a row of
// a bias, say) passes whether the vector width divides it.
template <typename T, typename F>
void with_vec_width(int64_t n, std::initializer_list<const void*> ptrs, const F& launch, bool divisible = true) {
  constexpr int V = vec_width<T>();
  bool ok = divisible;
  for (const void* p : ptrs) ok = ok && (!p || is_aligned_for<T, V>(p));
  if (ok)
    launch(std::integral_constant<int, V>{}, grid_for(n, kBlockSize, V));
  else
    launch(std::integral_constant<int, 1>{}, grid_for(n));
}

// Visits [b, e) of an array starting at p, split among nt threads (this one
// is tid): elements before the first VEC-aligned address and after the last
// full vector go to scalar(i); each aligned run of VEC elements starting at
// index i goes to vec(i). Rows of a [outer, r] tensor start at arbitrary
// alignment, so this is what lets row kernels use 16-byte loads anyway.
template <int VEC, typename T, typename FS, typename FV>
__device__ __forceinline__ void for_each_aligned(const T* p, int64_t b, int64_t e, int tid, int nt, FS&& scalar,
                                                 FV&& vec) {
  if (e <= b) return;
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p + b) / sizeof(T) % VEC);
  const int64_t head = mis ? (VEC - mis < e - b ? VEC - mis : e - b) : 0;
  for (int64_t i = b + tid; i < b + head; i += nt) scalar(i);
  const int64_t vb = b + head, nvec = (e - vb) / VEC;
#pragma unroll 4
  for (int64_t v = tid; v < nvec; v += nt) vec(vb + v * VEC);
  for (int64_t i = vb + nvec * VEC + tid; i < e; i += nt) scalar(i);
}

// The iteration space's sizes as divisors made once a launch on the host
// (int_div.h): a strided kernel decomposes each element's linear index into
// coordinates, one division a dim. `narrow` where every linear index fits
// IntDiv<int32_t> (use_int_div32): a multiply-high, an add and a shift a
// dim, where `/` of 32 bits took about twenty instructions and one of 64
// bits a subroutine of about seventy.
struct SizeDivs {
  IntDiv<int32_t> size[kMaxDims];
  bool narrow = false;
};
inline SizeDivs size_divs(const StridedIter& it) {
  SizeDivs s;
  s.narrow = it.numel > 0 && use_int_div32(it.numel);  // an empty space may hold a size 0: no divisor
  if (s.narrow)
    for (int d = 1; d < it.ndim; ++d) s.size[d] = IntDiv<int32_t>(it.sizes[d]);  // dim 0 needs none
  return s;
}

// Element offsets (in elements, per operand) of linear index `linear` in the
// iteration space, innermost dim last. The loops run over the compile-time
// bound kMaxDims so every index into the parameter-space arrays is constant:
// a runtime index would make the compiler copy the whole StridedIter to local
// memory. The outermost coordinate is what is left: no division.
template <int NOPS>
__device__ __forceinline__ void strided_offsets(const StridedIter& it, const SizeDivs& divs, int64_t linear,
                                                int64_t (&off)[NOPS]) {
#pragma unroll
  for (int o = 0; o < NOPS; ++o) off[o] = 0;
  if (divs.narrow) {
    // The coordinate zero-extended and the products taken modulo 2^64 (right
    // for negative strides too): a 32 x 64-bit multiply-add is two
    // instructions, where a sign-extended one took four.
    int32_t rem = static_cast<int32_t>(linear);
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d >= it.ndim) continue;
      int32_t c = rem;
      if (d > 0) {
        const int32_t q = divs.size[d].div(rem);
        c = rem - q * divs.size[d].d;
        rem = q;
      }
      const uint64_t cu = static_cast<uint32_t>(c);
#pragma unroll
      for (int o = 0; o < NOPS; ++o)
        off[o] = static_cast<int64_t>(static_cast<uint64_t>(off[o]) + cu * static_cast<uint64_t>(it.strides[o][d]));
    }
  } else {
    int64_t rem = linear;
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d >= it.ndim) continue;
      int64_t c = rem;
      if (d > 0) {
        c = rem % it.sizes[d];
        rem /= it.sizes[d];
      }
#pragma unroll
      for (int o = 0; o < NOPS; ++o) off[o] += c * it.strides[o][d];
    }
  }
}

template <typename T>
__device__ __forceinline__ T* operand_ptr(const StridedIter& it, int o, int64_t off) {
  return reinterpret_cast<T*>(it.data[o]) + off;
}

// The value of host-scalar operand o (StridedIter::host_scalars) as the
// compute type C: exact for integers, as converted by the op for floats.
template <typename C>
__host__ __device__ __forceinline__ C host_scalar_value(const StridedIter& it, int o) {
  if constexpr (std::is_integral_v<C>) return static_cast<C>(it.scalar_i[o]);
  else return static_cast<C>(it.scalar_f[o]);
}

// Operand o's element at offset off, or its host-scalar value.
template <typename T, typename C>
__device__ __forceinline__ C operand_value(const StridedIter& it, int o, int64_t off) {
  if ((it.host_scalars >> o) & 1u) return host_scalar_value<C>(it, o);
  return static_cast<C>(*operand_ptr<const T>(it, o, off));
}

// Warp shuffles for the value types reductions carry: the intrinsics have no
// bool/uint8 overloads, so narrow integers travel as int.
enum class Shuffle { Down, Xor };
template <Shuffle K, typename V>
__device__ __forceinline__ V shfl(V v, int arg) {
  if constexpr (std::is_integral_v<V> && sizeof(V) < 4) {
    return static_cast<V>(shfl<K>(static_cast<int>(v), arg));
  } else if constexpr (K == Shuffle::Down) {
    return __shfl_down_sync(0xffffffffu, v, arg);
  } else {
    return __shfl_xor_sync(0xffffffffu, v, arg);
  }
}
template <typename V>
__device__ __forceinline__ V shfl_down(V v, int delta) {
  return shfl<Shuffle::Down>(v, delta);
}
template <typename V>
__device__ __forceinline__ V shfl_xor(V v, int mask) {
  return shfl<Shuffle::Xor>(v, mask);
}

// A floating value summed (or maxed) over a warp's lanes, every lane taking
// part and getting the result: the warp-per-row kernels' reductions.
template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
  for (int m = kWarpSize / 2; m > 0; m /= 2) v += shfl_xor(v, m);
  return v;
}
template <typename V>
__device__ __forceinline__ V warp_max(V v) {
  for (int m = kWarpSize / 2; m > 0; m /= 2) v = fmax(v, shfl_xor(v, m));
  return v;
}

// Errors a kernel finds in its input (an index or target out of range;
// device.h's DeviceErrorSlot): the first thread to find one claims the
// device's slot and fills it in, and the op returns without waiting.
__device__ __forceinline__ void record_error(DeviceErrorSlot* slot, int32_t op, int32_t kind, int64_t value, int64_t a,
                                             int64_t b) {
  if (atomicCAS(&slot->op, 0, op) == 0) {
    slot->kind = kind;
    slot->value = value;
    slot->a = a;
    slot->b = b;
  }
}
// After such a launch: nothing to wait for, unless EMBER_SYNC_CHECKS asks
// for the error at the op.
inline void maybe_check_now(int device, cudaStream_t stream) {
  if (cuda_sync_checks()) cuda_error_check_now(Stream{device, stream});
}

// Kernels templated on <T, C>: T the tensors' dtype, read and written as
// it is, C the dtype they compute in (float32 for 16-bit and float32
// tensors, float64 for float64): f.operator()<T, C>() for dt (the norms,
// the rotary embedding).
template <typename F>
void dispatch_io(DType dt, F&& f) {
  switch (dt) {
    case DType::Float64:
      f.template operator()<double, double>();
      break;
    case DType::BFloat16:
      f.template operator()<BFloat16, float>();
      break;
    case DType::Float16:
      f.template operator()<Half, float>();
      break;
    default:
      f.template operator()<float, float>();
      break;
  }
}

// Tensor cores, one warp: C[16x8] += A[16x16] B[16x8] for 16-bit A and B
// (Half or BFloat16 bits, two to a register) with float32 accumulation:
// PTX's mma.sync.m16n8k16.row.col, whose fragment layouts are fixed by the
// ISA, so kernels can move values between fragments in registers (the
// flash-attention trick: an accumulator tile becomes the next A operand).
// Lane l = 4 g + t holds, lower index in the lower half of each register:
//   a[0] A(g, 2t..2t+1)  a[1] A(g+8, 2t..)  a[2] A(g, 2t+8..)  a[3] A(g+8, 2t+8..)
//   b[0] B(2t..2t+1, g)  b[1] B(2t+8..2t+9, g)
//   c[0..1] C(g, 2t..2t+1)  c[2..3] C(g+8, 2t..2t+1)
// Under the host emulation (no __CUDA_ARCH__) the warp gathers every lane's
// fragments and each lane computes its own four outputs (emulated_mma), so
// the layout contract above is what the emulated tests check.
template <typename T>
__device__ __forceinline__ uint32_t pack16(float lo, float hi) {
  return static_cast<uint32_t>(T::from_float(lo)) | (static_cast<uint32_t>(T::from_float(hi)) << 16);
}
#if !defined(__CUDA_ARCH__) && !defined(__CUDACC__)
// One warp's m16n8kK product under the emulation (this one and mma_tiles.cuh's
// TF32 one): every lane's four A and two B registers gathered (one warp
// barrier, emu::warp_gather: 32 shuffles' worth), unpack(g, t, regs, A, B)
// placing lane (g, t)'s into A [16][K] and B [K][8] as the ISA lays them
// out, then this lane's four outputs (C's layout, shared by both shapes).
template <int K, typename Unpack>
inline void emulated_mma(float c[4], const uint32_t a[4], const uint32_t b[2], const Unpack& unpack, ::emu::Site site) {
  float A[16][K], B[K][8];
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const unsigned char* all = ::emu::warp_gather(0xffffffffu, mine, sizeof mine, site);
  for (int src = 0; src < kWarpSize; ++src) {
    uint32_t regs[6];
    std::memcpy(regs, all + src * ::emu::kGatherBytes, sizeof regs);
    unpack(src / 4, src % 4, regs, A, B);
  }
  const int lane = static_cast<int>(threadIdx.x % kWarpSize), g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    float acc = c[e];
    for (int kk = 0; kk < K; ++kk) acc += A[row][kk] * B[kk][col];
    c[e] = acc;
  }
}
#endif
template <typename T>
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, BFloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif !defined(__CUDACC__)  // the emulation (nvcc's host pass compiles no body)
  const auto lo = [](uint32_t r) { return T::to_float(static_cast<uint16_t>(r & 0xffffu)); };
  const auto hi = [](uint32_t r) { return T::to_float(static_cast<uint16_t>(r >> 16)); };
  emulated_mma<16>(
      c, a, b,
      [&](int g, int t, const uint32_t* regs, float(&A)[16][16], float(&B)[16][8]) {
        for (int r = 0; r < 4; ++r) {
          const int row = g + 8 * (r % 2), col = 2 * t + 8 * (r / 2);
          A[row][col] = lo(regs[r]), A[row][col + 1] = hi(regs[r]);
        }
        for (int r = 0; r < 2; ++r) B[2 * t + 8 * r][g] = lo(regs[4 + r]), B[2 * t + 8 * r + 1][g] = hi(regs[4 + r]);
      },
      EMU_SITE);
#endif
}

// ldmatrix.x4: four 8 x 8 tiles of 16-bit values from shared memory, lane l
// giving the address of row l % 8 of tile l / 8 (each row 16 contiguous,
// 16-byte aligned bytes); r[i] of lane l = tile i's row l / 4, columns
// 2 (l % 4) and + 1, or with Trans tile i's transpose there (column l / 4,
// rows 2 (l % 4) and + 1): exactly the mma fragments above. The emulation
// reads the rows through the lanes' gathered addresses.
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const uint16_t* row) {
#if defined(__CUDA_ARCH__)
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#elif !defined(__CUDACC__)
  const int lane = static_cast<int>(threadIdx.x % kWarpSize), g = lane / 4, t = lane % 4;
  const unsigned char* all = ::emu::warp_gather(0xffffffffu, &row, sizeof row, EMU_SITE);
  const auto row_of = [all](int src) {
    const uint16_t* p;
    std::memcpy(&p, all + src * ::emu::kGatherBytes, sizeof p);
    return p;
  };
  for (int i = 0; i < 4; ++i) {
    if constexpr (Trans) {
      const uint16_t* r0 = row_of(i * 8 + 2 * t);
      const uint16_t* r1 = row_of(i * 8 + 2 * t + 1);
      r[i] = static_cast<uint32_t>(r0[g]) | (static_cast<uint32_t>(r1[g]) << 16);
    } else {
      const uint16_t* rr = row_of(i * 8 + g);
      r[i] = static_cast<uint32_t>(rr[2 * t]) | (static_cast<uint32_t>(rr[2 * t + 1]) << 16);
    }
  }
#endif
}

// cp.async: N bytes global -> shared without holding registers, zeros
// when !valid (src must still be a valid address): 16 (.cg, past L1) for
// tiles, 4 or 8 (.ca: .cg takes 16 only) for rows of scalars without
// 16-byte alignment. cp_async_commit() closes a group and
// cp_async_wait_all() waits for the thread's groups (then a __syncthreads
// publishes them to the block). The emulation is asynchronous too: a copy
// lands at its thread's wait, and its destination holds poison until then
// (cuda_emu.h), so a read before the wait or a load over a tile still read
// shows as NaNs.
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid
#if !defined(__CUDA_ARCH__) && !defined(__CUDACC__)
                                         ,  // the emulation's reports name the caller's line
                                         ::emu::Site site = {__builtin_FILE(), __builtin_LINE()}
#endif
) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__)
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(valid ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(addr), "l"(src), "n"(N), "r"(valid ? N : 0));
#elif !defined(__CUDACC__)
  ::emu::cp_async(dst, src, N, valid, site);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif !defined(__CUDACC__)
  ::emu::cp_async_commit();
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#elif !defined(__CUDACC__)
  ::emu::cp_async_wait(0);
#endif
}

// 2^x as one MUFU.EX2 (PTX ex2.approx.ftz: relative error about 2^-22,
// subnormal inputs and results flushed to zero), what nvcc's exp2f becomes
// under --use_fast_math, which FlashAttention builds with; without it
// exp2f adds a range check and two multiplies for subnormals, on the
// softmax's every score. The emulation computes it exactly and flushes
// the same.
__device__ __forceinline__ float exp2_ftz(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = std::exp2(std::fpclassify(x) == FP_SUBNORMAL ? 0.f : x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
#endif
}

// p[0] += x, p[1] += y atomically per element, p 8-byte aligned: one
// vector reduction on sm_90 (atomicAdd on float2, half the instructions of
// two scalar ones), two scalar atomics elsewhere and under the emulation.
__device__ __forceinline__ void atomic_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(x, y));
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
#endif
}

// Element conversions are ember::cast_value (dtype.h), shared with the CPU.
using ::ember::cast_value;

}  // namespace ember::cuda
