// CUDA graphs (torch.cuda.CUDAGraph): the GPU work of a region captured
// once and replayed with one launch, so a step's hundreds of kernel
// launches cost the host one call.
//
//   CudaGraph graph(0);
//   graph.capture([&] { loss = step(static_x, static_y); });  // records, runs nothing
//   for (...) {
//     static_x.copy_(next_x);   // new inputs into the tensors the graph reads
//     graph.replay();           // the whole step, one launch
//   }
//
// A replay repeats exactly what was captured: the same kernels, on the same
// memory, with the same arguments. So:
//  - the tensors the region read and made are the graph's (static inputs
//    and outputs): write new inputs into them, read results from them;
//  - memory the region allocated comes from the graph's own pool (the
//    caching allocator's blocks of the graph's stream, whatever stream
//    the region used) and stays the graph's until it is destroyed, even
//    where the region freed it;
//  - tensors made before the capture that the region reads must stay
//    alive while the graph is replayed: a replay reads their memory,
//    which would otherwise go back to the allocator (PyTorch's rule too);
//  - every host number the region passed to a kernel is frozen at its
//    captured value (a learning rate, a loss scale);
//  - random numbers (dropout, attention dropout, rand/bernoulli) are drawn
//    anew at every replay, as the same eager steps would draw them (torch's
//    graph-safe Philox): their kernels read the generator's seed and offset
//    on the device, which replay() writes, and replay() advances the
//    generator by the draws the region made; the capture itself draws
//    nothing and leaves the generator as it was. A generator drawn from in
//    the region must outlive the graph and not be drawn from by another
//    thread while it captures or replays;
// What a capture cannot hold is refused with an error naming it, raised
// in the region: anything that waits for the GPU (item(), cpu(), a
// synchronisation), a copy between the CPU and the GPU, and optimizers
// whose step reads host state that changes from step to step.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"

namespace ember {

class Generator;

class CudaGraph {
 public:
  explicit CudaGraph(int device = 0);
  // Waits for the graph's last replay, then gives its pool back.
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Runs `region` with this graph's stream current on its device and
  // records its GPU work instead of running it; once only. Work queued
  // before is finished first (a synchronisation), so the graph starts
  // from it. An error inside the region (or a capture CUDA invalidated)
  // ends the capture, leaves the graph empty and is rethrown.
  void capture(const std::function<void()>& region);
  // Queues the captured work on the device's current stream.
  void replay();
  bool captured() const { return exec_ != nullptr; }
  int device() const { return device_; }
  // Replays queued so far.
  int64_t replays() const { return replays_; }

 private:
  int device_;
  std::shared_ptr<const Stream> stream_;  // the capture stream; its cached blocks are the graph's pool
  void* exec_ = nullptr;                  // cudaGraphExec_t
  int64_t replays_ = 0;
  // Each generator the region drew from: its {seed, offset base} on the
  // device (a slot of rng_state_), the generator's offset when the capture
  // first drew from it, and how far the region advanced it (what a replay
  // advances it by).
  struct RngSlot {
    Generator* gen;
    Tensor state;
    uint64_t base = 0, draws = 0;
  };
  std::vector<RngSlot> rng_;
  static constexpr size_t kRngSlots = 8;  // generators one region may draw from
  Tensor rng_state_;                      // their {seed, offset base}, [2 * kRngSlots] int64
  friend struct CapturedRngAccess;
};

// Random numbers inside a capture: where the kernel reads the generator's
// {seed, offset base} on the device, and the draw's offset relative to it.
struct CapturedRng {
  const uint64_t* state;
  uint64_t offset;
};
// While this thread captures on `device`: the next draw from `g` in the
// capturing graph (the generator advances as an eager draw would, so
// activation checkpointing's save and restore of its offset keep working;
// the capture's end puts it back). Otherwise nullopt: draw eagerly.
std::optional<CapturedRng> cuda_graph_rng(Generator& g, int device);

// Whether this thread is capturing a CUDA graph (on any device).
bool cuda_graph_capturing();
// Whether any thread is (the allocator then frees nothing: a cudaFree
// would invalidate a global-mode capture, whichever thread calls it).
bool cuda_graph_capture_active();
// The stream whose blocks are the pool of the graph this thread captures
// on `device`, or null: the caching allocator files every block allocated
// in the region there, whatever stream is current.
void* cuda_graph_capture_pool(int device);
// Raises an error naming `what` when this thread is capturing: called by
// what a graph cannot hold (a host synchronisation, a host copy, random
// numbers, a step of host state). `why` says what it would need.
void check_not_capturing(const char* what, const char* why = nullptr);

}  // namespace ember
