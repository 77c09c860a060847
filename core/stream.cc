// Streams and events (stream.h): the per-thread current stream of each
// device and thin RAII wrappers of the CUDA runtime's events.
#include "core/stream.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif
#include "core/cuda_graph.h"
#include "core/exception.h"

namespace ember {

namespace {
constexpr int kMaxDevices = 16;
thread_local void* tls_streams[kMaxDevices] = {};

void check_device(int device, const char* what) {
  EMBER_CHECK(device >= 0 && device < kMaxDevices, what, ": device index ", device, " out of range [0, ", kMaxDevices,
              ")");
}

#if EMBER_WITH_CUDA
// Runs with `device` current, then restores the caller's device.
struct OnDevice {
  explicit OnDevice(int device) {
    EMBER_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != device) EMBER_CUDA_CHECK(cudaSetDevice(device));
    changed = prev != device;
  }
  ~OnDevice() {
    if (changed) cudaSetDevice(prev);
  }
  int prev = 0;
  bool changed = false;
};
#endif
}  // namespace

Stream Stream::current(int device) {
  check_device(device, "Stream::current");
  return Stream{device, tls_streams[device]};
}

void Stream::set_current(Stream s) {
  check_device(s.device, "Stream::set_current");
  tls_streams[s.device] = s.handle;
}

StreamGuard::StreamGuard(Stream s) : prev_(Stream::current(s.device)) { Stream::set_current(s); }
StreamGuard::~StreamGuard() { Stream::set_current(prev_); }

#if EMBER_WITH_CUDA
std::shared_ptr<const Stream> new_stream(int device) {
  check_device(device, "new_stream");
  OnDevice on(device);
  cudaStream_t s = nullptr;
  EMBER_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return std::shared_ptr<const Stream>(new Stream{device, s}, [](const Stream* p) {
    cudaStreamDestroy(static_cast<cudaStream_t>(p->handle));
    delete p;
  });
}

Event::Event(int device, bool timing) : device_(device) {
  check_device(device, "Event");
  OnDevice on(device);
  cudaEvent_t e = nullptr;
  EMBER_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  handle_ = e;
}

Event::~Event() {
  if (handle_) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}

void Event::record(Stream s) {
  EMBER_CHECK(s.device == device_, "Event::record: an event of device ", device_, " on a stream of device ", s.device);
  OnDevice on(device_);
  EMBER_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(s.handle)));
}

void Event::block(Stream s) const {
  OnDevice on(s.device);
  EMBER_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.handle), static_cast<cudaEvent_t>(handle_), 0));
}

bool Event::query() const {
  const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (q == cudaErrorNotReady) return false;
  EMBER_CUDA_CHECK(q);
  return true;
}

void Event::synchronize() const {
  check_not_capturing("Event::synchronize()");
  EMBER_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
}

double Event::elapsed_ms(const Event& end) const {
  end.synchronize();
  float ms = 0;
  EMBER_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_), static_cast<cudaEvent_t>(end.handle_)));
  return ms;
}
#else
std::shared_ptr<const Stream> new_stream(int device) {
  EMBER_CHECK(false, "new_stream: ember was built without CUDA (no device ", device, ")");
  return nullptr;
}

Event::Event(int device, bool) : device_(device) {
  EMBER_CHECK(false, "Event: ember was built without CUDA (no device ", device, ")");
}
Event::~Event() = default;
void Event::record(Stream) {}
void Event::block(Stream) const {}
bool Event::query() const { return true; }
void Event::synchronize() const {}
double Event::elapsed_ms(const Event&) const { return 0; }
#endif

}  // namespace ember
