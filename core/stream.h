// Streams and events as values (torch.cuda.Stream / torch.cuda.Event): a
// CUDA stream is its device and its handle, an event records a point in a
// stream that other streams or the host wait for. Every place that orders
// GPU work (ops launching on the current stream, copies, the NCCL group's
// communication stream, the device error slot) speaks these types instead
// of an opaque void*.
//
//   Stream side = ...;                    // e.g. a communication stream
//   { StreamGuard g(side); y = x * 2.0; } // ops in the scope launch on `side`
//   Event done(0);
//   done.record(side);                    // the point after y
//   done.block(Stream::current(0));       // later work on the current stream waits; the host does not
//
// Built without CUDA, Stream::current is the (null) default stream and an
// Event is an error to create.
#pragma once

#include <memory>

namespace ember {

struct Stream {
  int device = 0;
  void* handle = nullptr;  // the cudaStream_t; null: the legacy default stream
  // The stream this thread launches kernels on for `device` (the legacy
  // default stream unless a StreamGuard or set_current says otherwise).
  static Stream current(int device);
  // Makes `s` this thread's current stream on its device.
  static void set_current(Stream s);
  bool operator==(const Stream& o) const { return device == o.device && handle == o.handle; }
  bool operator!=(const Stream& o) const { return !(*this == o); }
};

// A new stream on `device` that does not serialise with the legacy default
// stream (cudaStreamNonBlocking; torch.cuda.Stream()), destroyed when the
// last handle goes: side streams for copies and communication.
std::shared_ptr<const Stream> new_stream(int device);

// `s` is the current stream of its device for this thread while the guard
// lives (torch.cuda.stream(s)); the previous one comes back after.
class StreamGuard {
 public:
  explicit StreamGuard(Stream s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream prev_;
};

// A CUDA event on `device`, without timing (cudaEventDisableTiming) unless
// asked for (the profiler's GPU time per op).
class Event {
 public:
  explicit Event(int device, bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  int device() const { return device_; }
  // Marks the point after the work queued on `s` so far.
  void record(Stream s);
  // Work queued on `s` after this call waits for the recorded point; the
  // host does not wait (cudaStreamWaitEvent).
  void block(Stream s) const;
  // Whether the recorded work is done (true when nothing was recorded).
  // A CUDA error found on the way is thrown.
  bool query() const;
  // The host waits for the recorded work.
  void synchronize() const;
  // Milliseconds of device time from this event's point to `end`'s (both
  // timing events, recorded; the host waits for `end`).
  double elapsed_ms(const Event& end) const;

 private:
  int device_;
  void* handle_ = nullptr;  // the cudaEvent_t
};

}  // namespace ember
