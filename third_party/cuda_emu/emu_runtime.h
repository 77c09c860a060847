// The emulator's internal API for the library emulations (cublas_emu.cc,
// cudnn_emu.cc): stream-ordered execution and device-memory checks, so an
// emulated library call behaves like a kernel launch on the caller's stream.
// Also the hooks the emulator's own tests use. Not for the project's code,
// which only sees the CUDA APIs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
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

// Kernel launches accepted so far (configuration errors excluded) and the
// distinct kernel names among them, sorted: a test's coverage figure.
struct LaunchStats {
  uint64_t launches = 0;
  std::vector<std::string> kernels;
};
LaunchStats launch_stats();

// Test hooks: override EMU_ORDER and EMU_THREADS for grids run from now on;
// each returns the previous setting, so that a test can restore it.
enum class Order { kForward, kReverse, kShuffle };
Order set_order(Order order);
int set_threads(int n);

}  // namespace emu
