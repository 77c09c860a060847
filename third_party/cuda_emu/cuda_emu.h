// cuda_emu.h: compile a .cu file as host C++ and run its kernels on the CPU.
// Force-included (g++ -include cuda_emu.h) into a .cu that cu2emu.py has
// rewritten: launches `K<<<g, b, smem, s>>>(args)` became
// ::emu::kernel(K, "K").cfg(g, b, smem, s)(args), and __shared__ declarations
// became thread_local statics followed by ::emu::shared_init. Each CUDA
// thread of a block is a fiber with its own stack, so __syncthreads and warp
// shuffles are fiber barriers and the kernel body runs unchanged. Device
// memory is host memory; cuda_runtime_emu.cc implements the runtime API, and
// launches are queued on their stream until a synchronisation point, as on a
// GPU (cuda_emu.cc runs them). The environment variables that tune it are
// listed at the top of those two files.
#pragma once

#include <cuda_runtime.h>  // the real types/enums/declarations (host-only mode)

#include <math.h>  // nvcc makes the C math library visible to every .cu
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#undef __noinline__
#define __global__
#define __device__
#define __host__
#define __constant__
#define __noinline__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// cu2emu.py rewrites every __shared__ declaration of a .cu (so that it is
// poisoned per block); one left here came from a header it never saw, and
// would silently keep the previous block's values.
#define __shared__ _Pragma("GCC error \"__shared__ outside a .cu rewritten by cu2emu.py (move it into the .cu)\"")

// Per OS thread; a block runs on one OS thread, so these are its values.
// Initial-exec: the emulated libraries are linked, never dlopen'd, and every
// kernel statement that names threadIdx would otherwise call __tls_get_addr.
#define EMU_TLS __attribute__((tls_model("initial-exec")))
extern thread_local uint3 threadIdx EMU_TLS;
extern thread_local uint3 blockIdx EMU_TLS;
extern thread_local dim3 blockDim EMU_TLS;
extern thread_local dim3 gridDim EMU_TLS;
constexpr int warpSize = 32;

namespace emu {

struct Site {
  const char* file;
  int line;
};
void syncthreads(Site s);
void syncwarp(Site s, unsigned mask = 0xffffffffu);
// Exchanges `bytes` of `v` within the warp; returns lane src's value.
const void* warp_exchange(unsigned mask, const void* v, size_t bytes, int src_lane, Site s);
int lane_id();
// Every lane of `mask` gives `bytes` (at most kGatherBytes) of `v`; after one
// warp barrier the caller reads lane i's bytes at result + i * kGatherBytes
// (lanes outside the mask: stale bytes), until the caller's next warp
// barrier. What 32 shuffles of one value from each lane return, for one
// barrier instead of 32: the emulated tensor-core primitives gather their
// operands' fragments with it.
constexpr size_t kGatherBytes = 32;
const unsigned char* warp_gather(unsigned mask, const void* v, size_t bytes, Site s);

template <typename T>
T shfl(unsigned mask, T v, int src, Site s) {
  static_assert(sizeof(T) <= 16 && std::is_trivially_copyable_v<T>);
  T r;
  std::memcpy(&r, warp_exchange(mask, &v, sizeof(T), src, s), sizeof(T));
  return r;
}

// Called where a block's fiber reaches a `__shared__` declaration: the first
// fiber of each block to get there fills it with poison (0xFF bytes: NaN for
// floats, -1 for integers), so a read before any write shows.
void shared_init(void* p, size_t bytes);
// The block's `extern __shared__` arena: the launch's smem bytes, poisoned
// at block start, 16-byte aligned; null when the launch asked for none.
void* dynamic_shared();

// cp.async (cuda_utils.cuh's cp_async, cp_async_commit, cp_async_wait_all),
// asynchronous as on a GPU: the `bytes` (at most 16) are read from src at
// the call, or zeros when !valid, but land in dst only when the issuing
// thread waits for their group; until then dst holds poison (0xFF bytes:
// NaN for floats). A tile read before its wait, or a copy issued over a
// tile that another warp still reads (a missing barrier before the next
// stage's load), reads poison. Both pointers must be aligned to `bytes`
// (PTX's rule; a GPU faults), checked at the call.
void cp_async(void* dst, const void* src, size_t bytes, bool valid, Site s);
// cp.async.commit_group: the thread's copies since the last commit are a group.
void cp_async_commit();
// cp.async.wait_group n: every group of the thread's but its n most recent
// lands; copies not yet committed stay in flight, as PTX has it.
void cp_async_wait(int n);

using Thunk = void (*)(void* ctx);
// Dies unless p is null or inside a cudaMalloc/cudaHostAlloc block: a host
// pointer passed to a kernel is an illegal address on a GPU.
void check_kernel_pointer(const void* p, const char* kernel, int arg);
// Records e for cudaGetLastError (when not cudaSuccess) and returns it.
cudaError_t set_error(cudaError_t e);
// Validates the configuration (an error is returned and left for
// cudaGetLastError, as CUDA does) and queues the grid on `stream`; `ctx`
// holds the copied parameters until the grid has run. `file` is the
// launching file (the launch record's).
cudaError_t launch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Thunk thunk, std::shared_ptr<void> ctx,
                   const char* name, const void* fn, const char* file = "");

template <typename T>
void check_arg(const T& v, const char* name, int i) {
  if constexpr (std::is_pointer_v<T>) check_kernel_pointer(static_cast<const void*>(v), name, i);
}

template <typename... P>
struct Kernel {
  void (*fn)(P...);
  const char* name;
  Site site;
  dim3 grid{1}, block{1};
  size_t smem = 0;
  cudaStream_t stream = nullptr;
  Kernel& cfg(dim3 g, dim3 b, size_t s = 0, cudaStream_t st = nullptr) {
    grid = g, block = b, smem = s, stream = st;
    return *this;
  }
  template <typename... A>
  void operator()(A&&... args) {
    // Parameters are copied at launch, as CUDA does: the caller may change or
    // destroy its arguments before the queued grid runs.
    struct Ctx {
      void (*fn)(P...);
      std::tuple<std::decay_t<P>...> params;
    };
    auto ctx = std::make_shared<Ctx>(Ctx{fn, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)});
    std::apply([&](const auto&... p) { int i = 0; (check_arg(p, name, i++), ...); }, ctx->params);
    launch(
        grid, block, smem, stream, [](void* c) { std::apply(static_cast<Ctx*>(c)->fn, static_cast<Ctx*>(c)->params); },
        ctx, name, reinterpret_cast<const void*>(fn), site.file);
  }
};
// `site` (the launching line, a #line of the .cu under cu2emu) goes into
// the launch record of a test process (cuda_emu.cc), where it tells two
// kernels of one name in two files apart.
template <typename... P>
Kernel<P...> kernel(void (*fn)(P...), const char* name = "", Site site = {__builtin_FILE(), __builtin_LINE()}) {
  return Kernel<P...>{fn, name, site};
}

}  // namespace emu

#define EMU_SITE ::emu::Site{__FILE__, __LINE__}
#define __syncthreads() ::emu::syncthreads(EMU_SITE)
#define __syncwarp(...) ::emu::syncwarp(EMU_SITE, ##__VA_ARGS__)
#define __shfl_sync(mask, v, src, ...) ::emu::shfl(mask, v, emu_shfl_src_idx(src, ##__VA_ARGS__), EMU_SITE)
#define __shfl_xor_sync(mask, v, m, ...) ::emu::shfl(mask, v, emu_shfl_src_xor(m, ##__VA_ARGS__), EMU_SITE)
#define __shfl_down_sync(mask, v, d, ...) ::emu::shfl(mask, v, emu_shfl_src_down(d, ##__VA_ARGS__), EMU_SITE)
#define __shfl_up_sync(mask, v, d, ...) ::emu::shfl(mask, v, emu_shfl_src_up(d, ##__VA_ARGS__), EMU_SITE)

// Source lane per CUDA's rules (width-segmented; out of range keeps own value).
inline int emu_shfl_src_idx(int src, int w = 32) { int l = ::emu::lane_id(); return (l & ~(w - 1)) + (src & (w - 1)); }
inline int emu_shfl_src_xor(int m, int w = 32) {
  int l = ::emu::lane_id(), s = l ^ m;
  return (s & ~(w - 1)) == (l & ~(w - 1)) ? s : l;
}
inline int emu_shfl_src_down(int d, int w = 32) { int l = ::emu::lane_id(); return ((l & (w - 1)) + d < w) ? l + d : l; }
inline int emu_shfl_src_up(int d, int w = 32) { int l = ::emu::lane_id(); return ((l & (w - 1)) - d >= 0) ? l - d : l; }

// Atomics are real host atomics: blocks of a grid run on several OS threads.
template <typename T>
inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <typename T>
inline T atomicSub(T* p, T v) { return std::atomic_ref<T>(*p).fetch_sub(v); }
template <typename T>
inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <typename T>
inline T atomicCAS(T* p, T cmp, T v) { std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v); return cmp; }
template <typename T>
inline T atomicMax(T* p, T v) { std::atomic_ref<T> a(*p); T o = a.load(); while (o < v && !a.compare_exchange_weak(o, v)) {} return o; }
template <typename T>
inline T atomicMin(T* p, T v) { std::atomic_ref<T> a(*p); T o = a.load(); while (v < o && !a.compare_exchange_weak(o, v)) {} return o; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <typename T>
inline T __ldg(const T* p) { return *p; }
