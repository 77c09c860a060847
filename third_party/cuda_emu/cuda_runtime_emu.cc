// cuda_runtime_emu.cc: the CUDA runtime API the project calls, on host
// memory, with a GPU's ordering rules. Kernel launches, async copies and
// memsets, host functions, event records/waits and library calls
// (emu::enqueue) go into per-stream FIFO queues and run only when the host
// must see their effects, so a missing stream wait or event shows up as a
// wrong result instead of passing by luck:
//   - cudaStreamSynchronize(s) runs s's queue; cudaEventSynchronize(e) runs
//     the recording stream up to e; a cudaStreamWaitEvent item, when its
//     stream reaches it, first runs the recording stream up to the event.
//   - cudaEventQuery runs nothing: an event that no synchronisation has
//     reached answers cudaErrorNotReady, as a slow GPU would, so work that
//     only a query ever waited for stays pending. The kQueryPatience-th query
//     of one record runs up to the event, so that a polling loop ends.
//   - The legacy default stream (nullptr) waits for earlier work of the
//     device's blocking streams, and their work waits for earlier default-
//     stream work; cudaStreamNonBlocking streams do neither.
//   - cudaMemcpy/cudaMemset are default-stream items the host waits for;
//     cudaDeviceSynchronize, cudaFree and cudaFreeHost run everything (CUDA's
//     cudaFree synchronizes the device); cudaStreamDestroy runs the stream.
// Async copies involving pageable host memory follow CUDA's documented rules
// (the source is staged at the call; a copy into it completes before the
// call returns); with pinned memory they are fully deferred.
// Allocations are exact-sized (no rounding), so ASan catches an access past
// the end, and filled with 0xFF bytes (NaN, -1): CUDA leaves new memory
// uninitialised, so code that counts on zeros must fail here too.
//
// Environment: EMU_DEVICES=N  devices reported (default 1).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "third_party/cuda_emu/cuda_emu.h"
#include "third_party/cuda_emu/emu_runtime.h"

namespace emu {

void die(const std::string& msg) {
  std::fprintf(stderr, "[cuda-emu] ERROR: %s\n", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

namespace {

int device_count() {
  static const int n = [] {
    const char* v = std::getenv("EMU_DEVICES");
    return v && *v ? std::max(1, std::atoi(v)) : 1;
  }();
  return n;
}
thread_local cudaError_t g_last = cudaSuccess;
thread_local int g_device = 0;

// ---- Allocations: for pointer checks, copy directions and attributes ----
struct Alloc {
  size_t size;
  int device;
};
std::mutex g_mem_mu;
std::map<uintptr_t, Alloc> g_dev, g_pinned;

// The allocation holding [p, p + bytes) (p may be one past the end when
// bytes == 0), or null.
const Alloc* find(const std::map<uintptr_t, Alloc>& m, const void* p, size_t bytes = 0) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = m.upper_bound(a);
  if (it == m.begin()) return nullptr;
  --it;
  return a + bytes <= it->first + it->second.size ? &it->second : nullptr;
}
bool is_dev(const void* p, size_t n) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  return find(g_dev, p, n) != nullptr;
}

// ---- Streams and events ----
struct Stream;
using StreamRef = std::shared_ptr<Stream>;
struct Op {
  std::function<void()> fn;  // empty for event records and waits
  const char* what;
  std::vector<std::pair<StreamRef, uint64_t>> deps;  // streams to run up to these counts first
};
struct Capture;
struct Stream {
  Stream(int d, bool l, bool b) : device(d), legacy(l), blocking(b) {}
  int device;
  bool legacy, blocking;
  std::deque<Op> q;
  uint64_t enqueued = 0, done = 0;
  bool running = false;
  std::shared_ptr<Capture> capture;  // set while the stream is being captured
  // Inside a capture: work recorded from this stream, and how much of it a
  // wait on one of its events has joined back (cudaErrorStreamCaptureUnjoined
  // at the end otherwise, for a stream that joined the capture).
  uint64_t captured_ops = 0, joined_upto = 0;
};
// A stream capture (cudaStreamBeginCapture .. cudaStreamEndCapture): the
// work pushed on the origin stream and on every stream that joined it (by
// waiting on an event recorded inside it), in issue order. Issue order is
// one valid order of the graph's nodes, and the only one the emulation runs.
struct Capture {
  std::vector<Op> ops;
  StreamRef origin;
  std::vector<StreamRef> joined;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;             // the thread that began it
  cudaError_t invalid = cudaSuccess;  // the first violation, which invalidates it
  std::string why;
};
struct Graph {
  std::vector<Op> ops;
};
struct GraphExec {
  std::shared_ptr<const std::vector<Op>> ops;
};
struct Event {
  StreamRef stream;  // null until recorded
  std::shared_ptr<Capture> captured;  // recorded inside this capture (no runnable point)
  StreamRef captured_on;              // the stream it was recorded on, and its captured_ops then
  uint64_t captured_at = 0;
  uint64_t seq = 0;
  int not_ready_answers = 0;
  bool timing = true;  // false: cudaEventDisableTiming
  // When the queue reached the record (steady clock, ns; -1 before): the
  // emulated device's time, for cudaEventElapsedTime.
  std::shared_ptr<std::atomic<int64_t>> when;
};
constexpr int kQueryPatience = 64;

// Guards the queues and is held while queued work runs: one device, one
// thing at a time.
std::mutex g_exec;
std::map<cudaStream_t, StreamRef> g_streams;  // created, not destroyed
std::vector<StreamRef> g_legacy;              // per device, created on use
std::set<cudaEvent_t> g_events;
thread_local const char* g_running = nullptr;  // the queued work this thread runs

// CUDA forbids CUDA calls from a stream callback (and an emulated library
// call must not make them): they would re-enter the queues.
std::unique_lock<std::mutex> api(const char* fn) {
  if (g_running) die(std::string(fn) + " called from queued work (" + g_running + "), which CUDA forbids");
  return std::unique_lock<std::mutex>(g_exec);
}

StreamRef legacy(int device) {
  if (g_legacy.empty()) g_legacy.resize(device_count());
  if (!g_legacy[device]) g_legacy[device] = std::make_shared<Stream>(device, true, true);
  return g_legacy[device];
}
StreamRef resolve(cudaStream_t s, const char* fn) {
  if (s == nullptr || s == cudaStreamLegacy) return legacy(g_device);
  if (s == cudaStreamPerThread) die(std::string(fn) + ": cudaStreamPerThread is not emulated");
  auto it = g_streams.find(s);
  if (it == g_streams.end()) die(std::string(fn) + ": invalid or destroyed stream handle");
  return it->second;
}

// Captures in progress, and this thread's capture mode
// (cudaThreadExchangeStreamCaptureMode).
std::vector<std::shared_ptr<Capture>> g_captures;
thread_local cudaStreamCaptureMode g_thread_mode = cudaStreamCaptureModeGlobal;

void invalidate(Capture& c, cudaError_t e, const std::string& why) {
  if (c.invalid != cudaSuccess) return;
  c.invalid = e;
  c.why = why;
  if (std::getenv("EMU_VERBOSE")) std::fprintf(stderr, "[cuda-emu] capture invalidated: %s\n", why.c_str());
}

// A call CUDA refuses while a capture is under way (cudaMalloc, cudaFree,
// a synchronous copy or memset, a device synchronisation: "potentially
// unsafe"), by the calling thread's mode (cudaThreadExchangeStreamCaptureMode):
// relaxed, never; thread-local, while this thread has a capture that was
// not begun relaxed; global (the default), that or while any thread has a
// global-mode capture. Returns the error, having invalidated the
// captures concerned, or cudaSuccess.
cudaError_t unsafe_during_capture(const char* fn) {
  if (g_thread_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  cudaError_t e = cudaSuccess;
  const std::thread::id me = std::this_thread::get_id();
  for (auto& c : g_captures) {
    const bool mine = c->thread == me && c->mode != cudaStreamCaptureModeRelaxed;
    const bool global_other = g_thread_mode == cudaStreamCaptureModeGlobal && c->mode == cudaStreamCaptureModeGlobal;
    if (mine || global_other) {
      invalidate(*c, cudaErrorStreamCaptureUnsupported, std::string(fn) + " during a stream capture");
      e = cudaErrorStreamCaptureUnsupported;
    }
  }
  return e;
}

void push(const StreamRef& s, Op op) {
  if (s->capture) {  // recorded into the graph, not run; no cross-stream deps inside it
    op.deps.clear();
    s->capture->ops.push_back(std::move(op));
    s->captured_ops++;
    return;
  }
  if (s->legacy) {
    for (auto& c : g_captures)  // the legacy stream would wait for a capturing blocking stream
      if (c->origin->device == s->device && c->origin->blocking)
        invalidate(*c, cudaErrorStreamCaptureImplicit, std::string(op.what) + " on the legacy default stream");
    for (auto& [h, t] : g_streams)
      if (t->device == s->device && t->blocking && t->enqueued > t->done) op.deps.emplace_back(t, t->enqueued);
  } else if (s->blocking) {
    StreamRef d = legacy(s->device);
    if (d->enqueued > d->done) op.deps.emplace_back(d, d->enqueued);
  }
  s->q.push_back(std::move(op));
  s->enqueued++;
}

// Runs s's queue until n items are done. Every dependency points to work
// enqueued before the item that has it, so the recursion ends.
void run_until(const StreamRef& s, uint64_t n) {
  while (s->done < n) {
    if (s->running) die("internal: cycle between stream dependencies");
    s->running = true;
    Op op = std::move(s->q.front());
    s->q.pop_front();
    for (auto& [t, m] : op.deps) run_until(t, m);
    if (op.fn) {
      g_running = op.what;
      try {
        op.fn();
      } catch (const std::exception& e) {
        die(std::string(op.what) + ": " + e.what());
      }
      g_running = nullptr;
    }
    s->done++;
    s->running = false;
  }
}
void run_all() {
  for (auto& s : g_legacy)
    if (s) run_until(s, s->enqueued);
  for (auto& [h, s] : g_streams) run_until(s, s->enqueued);
}
// Queues on the legacy default stream and waits for it: a synchronous call.
void run_now(Op op) {
  StreamRef d = legacy(g_device);
  push(d, std::move(op));
  run_until(d, d->enqueued);
}

struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched",
     "capture was not ended in the same stream as it began"},
    {cudaErrorStreamCaptureIsolation, "cudaErrorStreamCaptureIsolation",
     "dependency created on uncaptured work in another stream"},
    {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {cudaErrorIllegalState, "cudaErrorIllegalState", "the operation is not permitted in the current state"},
    {cudaErrorStreamCaptureUnjoined, "cudaErrorStreamCaptureUnjoined",
     "capture a stream that was forked from the origin stream without joining it back"},
};
const ErrorText& error_text(cudaError_t e) {
  static constexpr ErrorText kUnknown{cudaErrorUnknown, "cudaErrorUnknown", "unknown error"};
  for (const ErrorText& t : kErrors)
    if (t.error == e) return t;
  return kUnknown;
}

}  // namespace

cudaError_t set_error(cudaError_t e) {
  if (e != cudaSuccess) g_last = e;
  return e;
}

void enqueue(cudaStream_t stream, std::function<void()> fn, const char* what) {
  auto l = api(what);
  StreamRef s = resolve(stream, what);
  // Work on a stream whose capture was invalidated fails, as CUDA's next
  // call there does (the launch's cudaGetLastError sees it).
  if (s->capture && s->capture->invalid != cudaSuccess) set_error(cudaErrorStreamCaptureInvalidated);
  push(s, Op{std::move(fn), what, {}});
}

void check_kernel_pointer(const void* p, const char* kernel, int arg) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> l(g_mem_mu);
  if (!find(g_dev, p) && !find(g_pinned, p))
    die(std::string(kernel) + ": pointer argument " + std::to_string(arg) + " is not device memory");
}

void check_device_range(const void* p, size_t bytes, const char* what) {
  if (bytes == 0 && p == nullptr) return;
  if (is_dev(p, bytes)) return;
  char at[32];
  std::snprintf(at, sizeof at, "%p", p);
  die(std::string(what) + ": " + std::to_string(bytes) + " bytes at " + at + " are not inside one device allocation");
}

}  // namespace emu

// Host synchronisations (emu::LaunchStats::host_syncs): every call that
// makes the host wait for device work.
static std::atomic<uint64_t> g_host_syncs{0};
namespace emu {
uint64_t host_sync_count() { return g_host_syncs.load(); }
}  // namespace emu

extern "C" {
using namespace emu;

cudaError_t cudaGetLastError(void) { cudaError_t e = g_last; g_last = cudaSuccess; return e; }
cudaError_t cudaPeekAtLastError(void) { return g_last; }
const char* cudaGetErrorString(cudaError_t e) { return error_text(e).text; }
const char* cudaGetErrorName(cudaError_t e) { return error_text(e).name; }

cudaError_t cudaGetDeviceCount(int* n) { *n = device_count(); return cudaSuccess; }
cudaError_t cudaGetDevice(int* d) { *d = g_device; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= device_count()) return set_error(cudaErrorInvalidDevice);
  g_device = d;
  return cudaSuccess;
}
// The emulated device names itself, so a test can tell the emulation from a
// GPU where their results legitimately differ (which algorithm cuDNN picks).
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int) {
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "%s", "CUDA emulation");
  prop->multiProcessorCount = 4;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrMultiProcessorCount            ? 4
       : a == cudaDevAttrMaxThreadsPerBlock           ? 1024
       : a == cudaDevAttrWarpSize                     ? 32
       : a == cudaDevAttrMaxSharedMemoryPerBlockOptin ? 227 * 1024  // sm_90's, as cudaFuncSetAttribute's limit here
                                                      : 0;
  return cudaSuccess;
}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void*, int, size_t) { *n = 4; return cudaSuccess; }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, const void*, int, size_t, unsigned int) {
  *n = 4;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  g_host_syncs++;
  auto l = api("cudaDeviceSynchronize");
  if (cudaError_t e = unsafe_during_capture("cudaDeviceSynchronize")) return set_error(e);
  run_all();
  return cudaSuccess;
}

// ---- Memory ----
cudaError_t cudaMalloc(void** p, size_t n) {
  *p = nullptr;
  {
    auto l = api("cudaMalloc");
    if (cudaError_t e = unsafe_during_capture("cudaMalloc")) return set_error(e);
  }
  if (n == 0) return cudaSuccess;
  if (posix_memalign(p, 256, n) != 0) return set_error(cudaErrorMemoryAllocation);
  std::memset(*p, 0xFF, n);
  std::lock_guard<std::mutex> l(g_mem_mu);
  g_dev[reinterpret_cast<uintptr_t>(*p)] = Alloc{n, g_device};
  return cudaSuccess;
}
static cudaError_t free_in(std::map<uintptr_t, Alloc>& m, void* p, const char* fn) {
  if (!p) return cudaSuccess;
  auto l = api(fn);
  if (cudaError_t e = unsafe_during_capture(fn)) return set_error(e);
  run_all();  // queued work may still use p
  {
    std::lock_guard<std::mutex> g(g_mem_mu);
    if (!m.erase(reinterpret_cast<uintptr_t>(p))) return set_error(cudaErrorInvalidValue);
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) { return free_in(g_dev, p, "cudaFree"); }
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) {
  {
    auto l = api("cudaHostAlloc");
    if (cudaError_t e = unsafe_during_capture("cudaHostAlloc")) return set_error(e);
  }
  if (posix_memalign(p, 256, std::max<size_t>(n, 1)) != 0) return set_error(cudaErrorMemoryAllocation);
  std::memset(*p, 0xFF, n);
  std::lock_guard<std::mutex> l(g_mem_mu);
  g_pinned[reinterpret_cast<uintptr_t>(*p)] = Alloc{n, g_device};
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t n) { return cudaHostAlloc(p, n, 0); }
cudaError_t cudaFreeHost(void* p) { return free_in(g_pinned, p, "cudaFreeHost"); }
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  *a = cudaPointerAttributes{};
  const Alloc* d = find(g_dev, p);
  const Alloc* h = d ? nullptr : find(g_pinned, p);
  a->type = d ? cudaMemoryTypeDevice : h ? cudaMemoryTypeHost : cudaMemoryTypeUnregistered;
  a->device = d ? d->device : h ? h->device : -1;
  a->devicePointer = d ? const_cast<void*>(p) : nullptr;
  a->hostPointer = d ? nullptr : const_cast<void*>(p);
  return cudaSuccess;
}

// A copy whose kind contradicts its pointers is an error CUDA reports (or a
// fault); the range must also fit inside the device allocation.
static cudaError_t check_copy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  if (n == 0) return cudaSuccess;
  const bool dd = is_dev(dst, n), sd = is_dev(src, n);
  const bool ok = (k == cudaMemcpyDefault) || (k == cudaMemcpyHostToDevice && dd && !sd) ||
                  (k == cudaMemcpyDeviceToHost && sd && !dd) || (k == cudaMemcpyDeviceToDevice && sd && dd) ||
                  (k == cudaMemcpyHostToHost && !sd && !dd);
  if (!ok) {
    std::fprintf(stderr, "[cuda-emu] cudaMemcpy kind %d does not match its pointers (or the range exceeds the allocation)\n", k);
    return set_error(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}
static Op copy_op(void* dst, const void* src, size_t n, const char* what) {
  return Op{[=] { std::memmove(dst, src, n); }, what, {}};
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  if (cudaError_t e = check_copy(dst, src, n, k)) return e;
  g_host_syncs++;
  auto l = api("cudaMemcpy");
  if (cudaError_t e = unsafe_during_capture("cudaMemcpy")) return set_error(e);
  run_now(copy_op(dst, src, n, "cudaMemcpy"));
  return cudaSuccess;
}
static bool is_pageable(const void* p, size_t n) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  return !find(g_dev, p, n) && !find(g_pinned, p, n);
}
// CUDA's documented rules for pageable host memory ("API synchronization
// behavior"): a copy from it is staged before the call returns, so the
// source may be reused at once (core/ops/optimizer.cu relies on this); a copy
// to it returns only once complete. Pinned memory gets neither: the copy runs
// when its stream does, so a missing synchronisation shows.
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind k, cudaStream_t s) {
  if (cudaError_t e = check_copy(dst, src, n, k)) return e;
  auto l = api("cudaMemcpyAsync");
  StreamRef st = resolve(s, "cudaMemcpyAsync");
  if (st->capture && st->capture->invalid != cudaSuccess) return set_error(cudaErrorStreamCaptureInvalidated);
  if (st->capture && n > 0 && (is_pageable(src, n) || is_pageable(dst, n))) {
    // A graph's copy node replays from its addresses; pageable memory is
    // staged or waited for at the call, which a graph cannot do.
    invalidate(*st->capture, cudaErrorStreamCaptureUnsupported, "cudaMemcpyAsync with pageable host memory");
    return set_error(cudaErrorStreamCaptureUnsupported);
  }
  if (n > 0 && is_pageable(src, n) && !is_pageable(dst, n)) {
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + n);
    push(st, Op{[=] { std::memcpy(dst, staged->data(), n); }, "cudaMemcpyAsync", {}});
  } else {
    push(st, copy_op(dst, src, n, "cudaMemcpyAsync"));
    if (n > 0 && is_pageable(dst, n) && !is_pageable(src, n)) {
      g_host_syncs++;  // a copy into pageable memory returns once complete
      run_until(st, st->enqueued);
    }
  }
  return cudaSuccess;
}
static Op memset_op(void* p, size_t pitch, int v, size_t w, size_t h, const char* what) {
  return Op{[=] { for (size_t r = 0; r < h; ++r) std::memset(static_cast<char*>(p) + r * pitch, v, w); }, what, {}};
}
static cudaError_t check_memset(void* p, size_t pitch, size_t w, size_t h) {
  if (w == 0 || h == 0 || is_dev(p, pitch * (h - 1) + w)) return cudaSuccess;
  std::fprintf(stderr, "[cuda-emu] cudaMemset: the range is not inside one device allocation\n");
  return set_error(cudaErrorInvalidValue);
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  if (cudaError_t e = check_memset(p, n, n, 1)) return e;
  g_host_syncs++;
  auto l = api("cudaMemset");
  if (cudaError_t e = unsafe_during_capture("cudaMemset")) return set_error(e);
  run_now(memset_op(p, n, v, n, 1, "cudaMemset"));
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  if (cudaError_t e = check_memset(p, n, n, 1)) return e;
  auto l = api("cudaMemsetAsync");
  StreamRef st = resolve(s, "cudaMemsetAsync");
  if (st->capture && st->capture->invalid != cudaSuccess) return set_error(cudaErrorStreamCaptureInvalidated);
  push(st, memset_op(p, n, v, n, 1, "cudaMemsetAsync"));
  return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void* p, size_t pitch, int v, size_t w, size_t h, cudaStream_t s) {
  if (cudaError_t e = check_memset(p, pitch, w, h)) return e;
  auto l = api("cudaMemset2DAsync");
  StreamRef st = resolve(s, "cudaMemset2DAsync");
  if (st->capture && st->capture->invalid != cudaSuccess) return set_error(cudaErrorStreamCaptureInvalidated);
  push(st, memset_op(p, pitch, v, w, h, "cudaMemset2DAsync"));
  return cudaSuccess;
}

// ---- Streams, events, host functions ----
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  auto l = api("cudaStreamCreateWithFlags");
  auto st = std::make_shared<Stream>(g_device, false, !(flags & cudaStreamNonBlocking));
  *s = reinterpret_cast<cudaStream_t>(st.get());
  g_streams[*s] = std::move(st);
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  auto l = api("cudaStreamDestroy");
  auto it = g_streams.find(s);
  if (it == g_streams.end()) return set_error(cudaErrorInvalidResourceHandle);
  StreamRef st = it->second;
  run_until(st, st->enqueued);
  g_streams.erase(it);  // waits that still name it hold a reference
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  g_host_syncs++;
  auto l = api("cudaStreamSynchronize");
  StreamRef st = resolve(s, "cudaStreamSynchronize");
  if (st->capture) {
    invalidate(*st->capture, cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize of the capturing stream");
    return set_error(cudaErrorStreamCaptureUnsupported);
  }
  // The legacy stream also waits for earlier blocking-stream work: a marker
  // item carries that dependency.
  if (st->legacy) push(st, Op{{}, "cudaStreamSynchronize", {}});
  run_until(st, st->enqueued);
  return cudaSuccess;
}
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* data) {
  auto l = api("cudaLaunchHostFunc");
  push(resolve(s, "cudaLaunchHostFunc"), Op{[=] { fn(data); }, "cudaLaunchHostFunc", {}});
  return cudaSuccess;
}

static Event* event(cudaEvent_t e, const char* fn) {
  if (!g_events.count(e)) die(std::string(fn) + ": invalid or destroyed event");
  return reinterpret_cast<Event*>(e);
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  auto l = api("cudaEventCreateWithFlags");
  auto* ev = new Event;
  ev->timing = (flags & cudaEventDisableTiming) == 0;
  *e = reinterpret_cast<cudaEvent_t>(ev);
  g_events.insert(*e);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  auto l = api("cudaEventDestroy");
  delete event(e, "cudaEventDestroy");  // waits already queued captured the record, not the event
  g_events.erase(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  auto l = api("cudaEventRecord");
  Event* ev = event(e, "cudaEventRecord");
  StreamRef st = resolve(s, "cudaEventRecord");
  auto when = std::make_shared<std::atomic<int64_t>>(-1);
  Op op{{}, "cudaEventRecord", {}};
  if (ev->timing)
    op.fn = [when] {
      *when = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
                  .count();
    };
  if (st->capture) {  // a point inside the graph: other streams may join by waiting on it
    *ev = Event{nullptr, st->capture, st, st->captured_ops, 0, 0, ev->timing, when};
    return cudaSuccess;
  }
  push(st, std::move(op));
  *ev = Event{st, nullptr, nullptr, 0, st->enqueued, 0, ev->timing, when};
  return cudaSuccess;
}
// The time between two recorded points as the emulated device ran them
// (the host's time running the queued work in between); NotReady until the
// queue reached both, as CUDA's.
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  auto l = api("cudaEventElapsedTime");
  Event* a = event(start, "cudaEventElapsedTime");
  Event* b = event(end, "cudaEventElapsedTime");
  if (!a->timing || !b->timing || !a->stream || !b->stream) return cudaErrorInvalidResourceHandle;
  const int64_t ta = *a->when, tb = *b->when;
  if (ta < 0 || tb < 0) return cudaErrorNotReady;
  *ms = static_cast<float>(static_cast<double>(tb - ta) / 1e6);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  g_host_syncs++;
  auto l = api("cudaEventSynchronize");
  Event* ev = event(e, "cudaEventSynchronize");
  if (ev->captured) {
    invalidate(*ev->captured, cudaErrorStreamCaptureUnsupported,
               "cudaEventSynchronize of an event recorded in a capture");
    return set_error(cudaErrorStreamCaptureUnsupported);
  }
  if (ev->stream) run_until(ev->stream, ev->seq);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto l = api("cudaEventQuery");
  Event* ev = event(e, "cudaEventQuery");
  if (ev->captured) {
    invalidate(*ev->captured, cudaErrorStreamCaptureUnsupported, "cudaEventQuery of an event recorded in a capture");
    return set_error(cudaErrorStreamCaptureUnsupported);
  }
  if (!ev->stream || ev->stream->done >= ev->seq) return cudaSuccess;
  if (++ev->not_ready_answers < kQueryPatience) return cudaErrorNotReady;
  run_until(ev->stream, ev->seq);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  auto l = api("cudaStreamWaitEvent");
  Event* ev = event(e, "cudaStreamWaitEvent");
  StreamRef st = resolve(s, "cudaStreamWaitEvent");
  if (ev->captured) {
    if (!st->capture) {  // the stream joins the capture (a fork)
      if (st->legacy) {
        invalidate(*ev->captured, cudaErrorStreamCaptureImplicit, "the legacy stream waiting on a captured event");
        return set_error(cudaErrorStreamCaptureImplicit);
      }
      st->capture = ev->captured;
      st->captured_ops = st->joined_upto = 0;
      ev->captured->joined.push_back(st);
      return cudaSuccess;
    }
    if (st->capture != ev->captured) {
      invalidate(*st->capture, cudaErrorStreamCaptureIsolation, "waiting on an event of another capture");
      invalidate(*ev->captured, cudaErrorStreamCaptureIsolation, "waiting on an event of another capture");
      return set_error(cudaErrorStreamCaptureIsolation);
    }
    // Inside one capture, issue order already orders it; the wait joins
    // the recording stream's work up to the event back.
    if (ev->captured_on) ev->captured_on->joined_upto = std::max(ev->captured_on->joined_upto, ev->captured_at);
    return cudaSuccess;
  }
  if (st->capture && ev->stream) {  // CUDA: only with cudaEventWaitExternal, which nothing here uses
    invalidate(*st->capture, cudaErrorStreamCaptureIsolation, "a capturing stream waiting on an uncaptured event");
    return set_error(cudaErrorStreamCaptureIsolation);
  }
  Op op{{}, "cudaStreamWaitEvent", {}};
  if (ev->stream) op.deps.emplace_back(ev->stream, ev->seq);
  push(st, std::move(op));
  return cudaSuccess;
}

// ---- Stream capture and graphs ----
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  auto l = api("cudaStreamBeginCapture");
  StreamRef st = resolve(s, "cudaStreamBeginCapture");
  if (st->legacy) return set_error(cudaErrorStreamCaptureUnsupported);  // the legacy stream cannot be captured
  if (st->capture) return set_error(cudaErrorIllegalState);
  auto c = std::make_shared<Capture>();
  c->origin = st;
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  st->capture = c;
  g_captures.push_back(c);
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  auto l = api("cudaStreamEndCapture");
  *graph = nullptr;
  StreamRef st = resolve(s, "cudaStreamEndCapture");
  if (!st->capture) return set_error(cudaErrorIllegalState);
  std::shared_ptr<Capture> c = st->capture;
  if (c->origin != st) {
    invalidate(*c, cudaErrorStreamCaptureUnmatched, "cudaStreamEndCapture on a stream that joined the capture");
    return set_error(cudaErrorStreamCaptureUnmatched);
  }
  st->capture = nullptr;
  for (auto& j : c->joined) {
    if (j->captured_ops > j->joined_upto)
      invalidate(*c, cudaErrorStreamCaptureUnjoined, "a stream that joined the capture did not rejoin it");
    j->capture = nullptr;
  }
  // Its events are points of the graph, not of any stream: a wait on one
  // after the capture orders nothing (CUDA: they name no work to wait for).
  for (cudaEvent_t e : g_events) {
    Event* ev = reinterpret_cast<Event*>(e);
    if (ev->captured == c) {
      ev->captured = nullptr;
      ev->captured_on = nullptr;
    }
  }
  g_captures.erase(std::find(g_captures.begin(), g_captures.end(), c));
  if (c->invalid == cudaErrorStreamCaptureUnjoined) return set_error(cudaErrorStreamCaptureUnjoined);
  if (c->invalid != cudaSuccess) return set_error(cudaErrorStreamCaptureInvalidated);
  *graph = reinterpret_cast<cudaGraph_t>(new Graph{std::move(c->ops)});
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  auto l = api("cudaStreamIsCapturing");
  StreamRef st = resolve(s, "cudaStreamIsCapturing");
  *status = !st->capture                          ? cudaStreamCaptureStatusNone
            : st->capture->invalid == cudaSuccess ? cudaStreamCaptureStatusActive
                                                  : cudaStreamCaptureStatusInvalidated;
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  std::swap(*mode, g_thread_mode);
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  auto l = api("cudaGraphInstantiate");
  if (!graph) return set_error(cudaErrorInvalidValue);
  auto ops = std::make_shared<const std::vector<Op>>(reinterpret_cast<Graph*>(graph)->ops);
  *exec = reinterpret_cast<cudaGraphExec_t>(new GraphExec{std::move(ops)});
  return cudaSuccess;
}
// One item on the stream runs every node, in capture order: the launch
// arguments, copy and memset addresses and library calls exactly as they
// were captured, as a GPU replays them.
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  auto l = api("cudaGraphLaunch");
  if (!exec) return set_error(cudaErrorInvalidValue);
  std::shared_ptr<const std::vector<Op>> ops = reinterpret_cast<GraphExec*>(exec)->ops;
  push(resolve(s, "cudaGraphLaunch"), Op{[ops] {
                                           for (const Op& op : *ops)
                                             if (op.fn) {
                                               g_running = op.what;
                                               op.fn();
                                             }
                                           g_running = "cudaGraphLaunch";
                                         },
                                         "cudaGraphLaunch",
                                         {}});
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  auto l = api("cudaGraphExecDestroy");
  delete reinterpret_cast<GraphExec*>(exec);  // a launch still queued holds the nodes
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  auto l = api("cudaGraphDestroy");
  delete reinterpret_cast<Graph*>(graph);
  return cudaSuccess;
}
}  // extern "C"
