// The emulator's internal API for the library emulations (cublas_emu.cc,
// cudnn_emu.cc): stream-ordered execution and device-memory checks, so an
// emulated library call behaves like a kernel launch on the caller's stream.
// Also the hooks the emulator's own tests use. Not for the project's code,
// which only sees the CUDA APIs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace emu {

// Runs `fn` in stream order on `stream` (nullptr: the legacy default
// stream). Work is deferred until a synchronisation point (stream/event/
// device synchronize, a synchronous copy, cudaFree), exactly as a GPU may run
// it later, so `fn` must copy (not reference) the caller's scalars, and must
// not call CUDA runtime functions itself; `what` names the work in error
// messages.
void enqueue(cudaStream_t stream, std::function<void()> fn, const char* what);

// Dies with `what` unless [p, p + bytes) lies inside one device allocation
// (cudaMalloc); bytes == 0 only checks p (which may then be null).
void check_device_range(const void* p, size_t bytes, const char* what);

// Prints "[cuda-emu] ERROR: msg" and aborts: misuse that the hardware would
// turn into undefined behaviour or a sticky error.
[[noreturn]] void die(const std::string& msg);

// A float rounded to TF32 (nearest even at 10 mantissa bits), as Ampere+
// tensor cores read float32 operands when a library call allows TF32.
inline float round_tf32(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
  std::memcpy(&v, &u, 4);
  return v;
}

// r at the r-th call: which output element an emulated cuDNN algorithm or
// engine marked nondeterministic disturbs in its run (cudnn_emu.cc), so
// that its results change from run to run as atomics' order changes a
// GPU's last bits.
uint64_t next_nondeterministic_run();

// Kernel launches accepted so far (configuration errors excluded) and the
// distinct kernel names among them, sorted: a test's coverage figure.
// host_syncs counts the calls that made the host wait for the device:
// stream, event and device synchronisation, synchronous copies and memsets,
// and asynchronous copies into pageable host memory.
struct LaunchStats {
  uint64_t launches = 0;
  std::vector<std::string> kernels;
  uint64_t host_syncs = 0;
};
uint64_t host_sync_count();
LaunchStats launch_stats();

// Test hooks: override EMU_ORDER and EMU_THREADS for grids run from now on;
// each returns the previous setting, so that a test can restore it.
enum class Order { kForward, kReverse, kShuffle };
Order set_order(Order order);
int set_threads(int n);

}  // namespace emu
