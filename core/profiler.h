// The profiler: where a step spends its time, per thread and per rank.
//
// Code marks what it does with RAII scopes; while a session runs (start()
// .. stop()) each scope becomes one event (name, kind, start, duration, self
// time, thread, arguments such as input shapes or a collective's bytes).
// Ops record themselves (differentiable() and the op entry points), the
// autograd engine records each backward node, the process groups each
// collective and each wait on one, the data loader each batch, optimizers
// each step and checkpoints each save. User code adds ranges:
//
//   EMBER_PROFILE_RANGE("forward");            // until the end of the block
//   profiler::start();  ...  profiler::stop();
//   write_file("trace.json", profiler::chrome_trace(profiler::events(), /*pid=*/rank));
//   std::cout << profiler::summary_table(profiler::events());
//
// Off (the default), a scope costs one relaxed atomic load and a branch: the
// hooks stay compiled into every op. On, each event costs two clock reads
// and an append to its thread's buffer (no lock shared between threads on
// the hot path: each thread's buffer has its own mutex, taken by the
// recording thread and by events() only).
//
// With CUDA, scopes also push NVTX ranges so Nsight Systems shows the same
// names on its timeline (Options::nvtx).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ember::profiler {

namespace detail {
struct CudaSpan;
}  // namespace detail

// What an event is; the Chrome trace's "cat" and the summary's column.
enum class Kind : uint8_t { Op, Backward, Collective, Wait, Data, Optimizer, Checkpoint, User };
const char* kind_name(Kind k);

struct Event {
  std::string name;
  Kind kind = Kind::User;
  int64_t start_ns = 0;  // steady clock (CLOCK_MONOTONIC: one clock for every process on a host)
  int64_t dur_ns = 0;
  int64_t self_ns = 0;   // dur_ns minus the time of the events nested directly inside
  uint32_t tid = 0;      // small per-process thread number, 0 for the first thread seen
  uint32_t depth = 0;    // nesting depth on its thread
  bool nested_in_same = false;  // inside an event of the same name (its total is not counted twice)
  std::string args;      // members of a JSON object, e.g. "\"bytes\":4096,\"seq\":3"
  // GPU time (Options::cuda_time): from an event pair recorded on the
  // device's current stream at the scope's open and close (no host sync;
  // events() waits for them). Total and self (minus the events nested
  // directly inside); -1 where none was recorded.
  int64_t cuda_ns = -1;
  int64_t cuda_self_ns = -1;
  // How long the stream sat idle before this event's GPU work: from the end
  // of the previous outermost GPU-timed event on its thread to this one's
  // start (outermost events only: a nested one's gap is its parent's
  // business); -1 where there is none. Where the host, not the GPU, holds a
  // step back, the time shows up here, at the op the GPU waited for.
  int64_t cuda_gap_ns = -1;
  std::shared_ptr<detail::CudaSpan> cuda_span;  // the unresolved pair, until events() reads it
};

struct Options {
  bool record_shapes = true;  // input shapes, dtypes and devices of ops
  bool nvtx = true;           // NVTX ranges too (CUDA builds; a no-op without a tool attached)
  // GPU time per op, backward node and optimizer step of the thread that
  // called start(): a CUDA event pair on the current stream of its current
  // device (one GPU per process, as ember's ranks), when a GPU (or the
  // emulation) is there. An op's GPU time is that of the work it queued
  // between the pair; a host-bound op that queued nothing shows about 0.
  // The table gains CUDA self/total columns and the trace a cuda_us
  // argument; host times stay as they are.
  bool cuda_time = true;
};

namespace detail {
extern std::atomic<bool> g_on;
struct Frame;
struct CudaSpan;
}  // namespace detail

// Building with -DEMBER_PROFILER_HOOKS=0 compiles every hook out (for
// measuring what the off state costs: bench/train_bench's BM_ResNet18Step
// built both ways).
#ifndef EMBER_PROFILER_HOOKS
#define EMBER_PROFILER_HOOKS 1
#endif
inline bool enabled() {
#if EMBER_PROFILER_HOOKS
  return detail::g_on.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// Starts a session: clears what earlier sessions recorded. Throws when one
// is already running.
void start(Options options = {});
// Ends the session; scopes still open keep recording until they close.
void stop();
bool running();
// Every event of the last (or running) session, all threads, ordered by
// start time.
std::vector<Event> events();
// Names this thread's track in traces ("gloo worker (group 1)").
void set_thread_name(const std::string& name);

// One open range on this thread. Inactive (and free beyond one load) when
// the profiler is off at construction, or the name is null.
class Scope {
 public:
  Scope(Kind kind, const char* name) {
    if (name != nullptr && enabled()) begin(kind, name);
  }
  Scope(Kind kind, const std::string& name) {
    if (enabled()) begin(kind, name.c_str());
  }
  ~Scope() {
    if (frame_ != nullptr) end();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  bool active() const { return frame_ != nullptr; }
  // Arguments shown with the event (no-ops when inactive).
  void arg(const char* key, int64_t value);
  void arg(const char* key, const std::string& value);
  // Input shapes, dtypes and devices (Options::record_shapes); undefined
  // tensors show as [].
  void inputs(const std::vector<Tensor>& ts);
  template <typename... Ts>
  void inputs(const Ts&... ts) {
    if (frame_ != nullptr) inputs(std::vector<Tensor>{ts...});
  }
  // Ends the range now instead of at destruction.
  void close() {
    if (frame_ != nullptr) end();
  }

 private:
  static bool record_shapes();
  void begin(Kind kind, const char* name);
  void end();
  detail::Frame* frame_ = nullptr;
};

// ---- Output ----
// The Chrome trace event objects (comma-separated, no brackets) of `events`
// on track `pid`, times shifted by `offset_ns`, with metadata naming the
// process `process_name` and each thread. Joining several ranks' bodies
// with commas and wrapping them gives one timeline with a track per rank.
std::string chrome_trace_events(const std::vector<Event>& events, int pid, const std::string& process_name,
                                int64_t offset_ns = 0);
// A whole trace file (Perfetto and chrome://tracing open it) from bodies.
std::string chrome_trace(const std::vector<std::string>& bodies);
inline std::string chrome_trace(const std::vector<Event>& events, int pid = 0) {
  return chrome_trace({chrome_trace_events(events, pid, "rank " + std::to_string(pid))});
}

// torch.profiler's key_averages().table(): per (name, kind), calls, self and
// total time, sorted by self time; `top` rows (0: all). Total time of a
// name nested in itself counts once.
struct Average {
  std::string name;
  Kind kind = Kind::User;
  int64_t calls = 0, self_ns = 0, total_ns = 0;
  int64_t cuda_self_ns = 0, cuda_total_ns = 0;  // GPU time (zero without it)
  int64_t cuda_gap_ns = 0;                      // GPU idle before its calls (Event::cuda_gap_ns)
};
std::vector<Average> key_averages(const std::vector<Event>& events);
std::string summary_table(const std::vector<Event>& events, int top = 25);

// The steady clock profiler events use, in ns.
int64_t now_ns();

}  // namespace ember::profiler

#define EMBER_PROFILE_CONCAT_(a, b) a##b
#define EMBER_PROFILE_CONCAT(a, b) EMBER_PROFILE_CONCAT_(a, b)
// A user range until the end of the enclosing block.
#define EMBER_PROFILE_RANGE(name) \
  ::ember::profiler::Scope EMBER_PROFILE_CONCAT(ember_profile_range_, __LINE__)(::ember::profiler::Kind::User, name)
// An op's range with its inputs' shapes: EMBER_PROFILE_OP("conv2d", x, w, b).
#define EMBER_PROFILE_OP(name, ...)                                                    \
  ::ember::profiler::Scope ember_profile_op_(::ember::profiler::Kind::Op, name);        \
  if (ember_profile_op_.active()) ember_profile_op_.inputs(__VA_ARGS__)
