// CUDA graph capture and replay (cuda_graph.h) over the runtime's stream
// capture: cudaStreamBeginCapture on a stream of the graph's own, the
// region's ops launching on it, cudaStreamEndCapture, one instantiation,
// cudaGraphLaunch per replay. The graph's memory pool is the caching
// allocator's free list of that stream (cuda_allocator.cc keys its blocks
// by stream), kept out of empty_cache() while the graph lives.
#include "core/cuda_graph.h"

#include <atomic>
#include <exception>
#include <string>

#include "core/allocator.h"
#include "core/device.h"
#include "core/exception.h"
#include "core/ops.h"
#include "core/ops/kernels.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace ember {

namespace {
thread_local int t_capturing = -1;          // the device this thread captures on, or -1
thread_local void* t_pool = nullptr;        // that graph's stream (its pool)
thread_local CudaGraph* t_graph = nullptr;  // the graph capturing
std::atomic<int> g_active_captures{0};      // captures under way, any thread
}  // namespace

struct CapturedRngAccess {
  static std::optional<CapturedRng> draw(CudaGraph& graph, Generator& g) {
    CudaGraph::RngSlot* slot = nullptr;
    for (auto& s : graph.rng_)
      if (s.gen == &g) slot = &s;
    if (!slot) {
      // A slot of the buffer made before the capture: not the graph's pool,
      // whose blocks the region's earlier kernels (replayed before the
      // draw) may have used and would overwrite.
      const size_t i = graph.rng_.size();
      EMBER_CHECK(i < CudaGraph::kRngSlots, "CudaGraph::capture: the region draws random numbers from more than ",
                  CudaGraph::kRngSlots, " generators");
      graph.rng_.push_back({&g, graph.rng_state_.narrow(0, 2 * static_cast<int64_t>(i), 2), g.offset(), 0});
      slot = &graph.rng_.back();
    }
    const uint64_t at = g.next_offset();
    EMBER_INTERNAL_ASSERT(at >= slot->base, "cuda_graph_rng: the generator went back before the capture began");
    return CapturedRng{static_cast<const uint64_t*>(slot->state.raw_data()), at - slot->base};
  }
  // The capture's end: each generator's draws, and the generator put back.
  static void close(CudaGraph& graph) {
    for (auto& s : graph.rng_) {
      s.draws = s.gen->offset() - s.base;
      s.gen->set_offset(s.base);
    }
  }
};

std::optional<CapturedRng> cuda_graph_rng(Generator& g, int device) {
  if (t_graph == nullptr || t_capturing != device) return std::nullopt;
  return CapturedRngAccess::draw(*t_graph, g);
}

bool cuda_graph_capturing() { return t_capturing >= 0; }
bool cuda_graph_capture_active() { return g_active_captures.load() > 0; }
void* cuda_graph_capture_pool(int device) { return t_capturing == device ? t_pool : nullptr; }

void check_not_capturing(const char* what, const char* why) {
  if (t_capturing < 0) return;
  EMBER_CHECK(false, what, " inside a CUDA graph capture (cuda:", t_capturing,
              "): ", why ? why : "it waits for the GPU, which a captured region cannot do",
              "; do it outside the captured region (before capture(), or after replay())");
}

#if EMBER_WITH_CUDA
namespace {
// `device` current for the scope; the caller's device restored after,
// without throwing (destructors use it).
struct OnDevice {
  explicit OnDevice(int device) {
    if (cudaGetDevice(&prev) != cudaSuccess) {
      cudaGetLastError();
      prev = -1;  // unknown: nothing to restore
    }
    if (prev != device) EMBER_CUDA_CHECK(cudaSetDevice(device));
  }
  ~OnDevice() {
    if (prev >= 0) cudaSetDevice(prev);
  }
  int prev = 0;
};
}  // namespace

CudaGraph::CudaGraph(int device) : device_(device) {
  EMBER_CHECK(cuda_is_available(), "CudaGraph: no CUDA device: ", cuda_unavailable_reason());
  EMBER_CHECK(device >= 0 && device < cuda_device_count(), "CudaGraph: device cuda:", device, " does not exist (",
              cuda_device_count(), " devices)");
  // The device's error slot is made on first use with cudaMalloc, which a
  // capture would refuse: made now, so an index check in the region works.
  (void)cuda_error_slot(device);
  stream_ = new_stream(device);
  cuda_graph_pool(device, stream_->handle, true);
}

// Never throws: a sticky device error is reported by the next call.
CudaGraph::~CudaGraph() {
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  // The last replay may still be running on the pool's memory, on
  // whichever stream it was queued.
  if (cudaSetDevice(device_) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (prev >= 0) cudaSetDevice(prev);
  try {
    rng_.clear();
    rng_state_ = Tensor();
    cuda_graph_pool(device_, stream_->handle, false);
  } catch (...) {
  }
}

void CudaGraph::capture(const std::function<void()>& region) {
  EMBER_CHECK(!exec_, "CudaGraph::capture: this graph already holds a capture (make a new graph to capture again)");
  EMBER_CHECK(t_capturing < 0, "CudaGraph::capture: this thread is already capturing a graph (captures do not nest)");
  EMBER_CHECK(cuda_allocator_caching(device_),
              "CudaGraph::capture: CUDA graphs need the caching allocator, whose blocks are the graph's pool "
              "(EMBER_NO_CUDA_MEMORY_CACHING is set)");
  OnDevice on(device_);
  rng_.clear();  // a capture that failed before left its slots
  // The generators' states the region's random kernels will read, outside
  // the graph's pool (a block the region frees and reuses is rewritten by
  // its earlier kernels at every replay).
  rng_state_ = Tensor::empty({2 * static_cast<int64_t>(kRngSlots)}, {DType::Int64, Device(DeviceType::CUDA, device_)});
  // The graph starts from everything queued before it: its stream does not
  // order itself after other streams' work, and capture cannot wait.
  cuda_synchronize();
  auto stream = static_cast<cudaStream_t>(stream_->handle);
  EMBER_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  g_active_captures++;
  t_capturing = device_;
  t_pool = stream_->handle;
  t_graph = this;
  std::exception_ptr failure;
  try {
    StreamGuard guard(*stream_);
    region();
  } catch (...) {
    failure = std::current_exception();
  }
  t_capturing = -1;
  t_pool = nullptr;
  t_graph = nullptr;
  CapturedRngAccess::close(*this);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  g_active_captures--;
  if (end != cudaSuccess) cudaGetLastError();
  if (failure) {
    if (graph) cudaGraphDestroy(graph);
    rng_.clear();
    std::rethrow_exception(failure);
  }
  EMBER_CHECK(end == cudaSuccess && graph != nullptr, "CudaGraph::capture: CUDA ended the capture with ",
              cudaGetErrorName(end), " (", cudaGetErrorString(end),
              "): something in the region made a call a capture cannot hold (a synchronisation, an allocation "
              "outside the caching allocator, a copy with pageable host memory, the legacy default stream, a "
              "side stream that did not rejoin the capture)");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  EMBER_CUDA_CHECK(inst);
  exec_ = exec;
}

void CudaGraph::replay() {
  EMBER_CHECK(exec_, "CudaGraph::replay: nothing captured (call capture() first)");
  check_not_capturing("CudaGraph::replay", "a graph replays outside captures");
  OnDevice on(device_);
  // The draws of this replay: the generators' state now, then advanced by
  // what the region draws (an eager run of it would have).
  for (RngSlot& s : rng_) {
    write_rng_state_cuda(static_cast<uint64_t*>(s.state.raw_data()), s.gen->seed(), s.gen->offset(), device_);
    s.gen->set_offset(s.gen->offset() + s.draws);
  }
  EMBER_CUDA_CHECK(
      cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(Stream::current(device_).handle)));
  ++replays_;
}
#else
CudaGraph::CudaGraph(int device) : device_(device) {
  EMBER_CHECK(false, "CudaGraph: ember was built without CUDA (CPU-only configuration)");
}
CudaGraph::~CudaGraph() = default;
void CudaGraph::capture(const std::function<void()>&) { EMBER_CHECK(false, "CudaGraph: built without CUDA"); }
void CudaGraph::replay() { EMBER_CHECK(false, "CudaGraph: built without CUDA"); }
#endif

}  // namespace ember
