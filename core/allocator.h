// The one allocator interface every backend implements.
//
// An Allocator hands out DataPtrs: a pointer that owns its memory and knows
// its device, so storage never needs to ask who allocated it. The CPU
// allocator is 64-byte aligned and caches large blocks (allocator.cc); the
// CUDA one caches blocks per stream (cuda_allocator.cc); pinned host memory
// is a third allocator used for fast host<->device copies (allocator.cc).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "core/device.h"

namespace ember {

// Owning pointer + device. The deleter returns the memory to its allocator.
struct DataPtr {
  std::unique_ptr<void, std::function<void(void*)>> ptr;
  Device device;
  void* get() const { return ptr.get(); }
};

// What a block of memory holds, for the breakdown of a step's peak
// (parameters, gradients, optimizer state, gathered FSDP units, saved
// activations, and the rest: temporaries, communication buffers, caches).
// Allocations are charged to the kind of the MemoryKindScope active on the
// allocating thread (Other outside any); set_memory_kind (tensor.h)
// recharges a block once its role is known (a parameter's .grad).
enum class MemoryKind : uint8_t { Other, Parameters, Gradients, Optimizer, Gathered, Activations };
constexpr int kMemoryKinds = 6;
const char* memory_kind_name(MemoryKind k);  // "other", "params", "grads", "optimizer", "gathered", "activations"

class MemoryKindScope {
 public:
  explicit MemoryKindScope(MemoryKind kind);
  ~MemoryKindScope();
  MemoryKindScope(const MemoryKindScope&) = delete;
  MemoryKindScope& operator=(const MemoryKindScope&) = delete;

 private:
  MemoryKind prev_;
};

struct AllocatorStats {
  size_t allocated = 0;       // bytes handed to tensors now
  size_t reserved = 0;        // bytes held from the driver (allocated + cached)
  size_t peak_allocated = 0;  // high-water mark of `allocated`
  // Bytes the live tensors asked for (`allocated` counts the blocks that
  // serve them, rounded up to a size class or a larger cached block): what
  // an activation-memory figure compares across layouts.
  size_t requested = 0;
  size_t num_allocs = 0;         // allocate() calls
  size_t num_device_allocs = 0;  // calls that reached cudaMalloc / aligned_alloc
  // `requested` by MemoryKind (indexed by its value), now and at the
  // high-water mark of `requested` (peak_requested): the bytes the tensors
  // of each kind asked for, whatever blocks serve them (a cached block up to
  // twice a request's size may), so a breakdown and a plan compare tensor
  // bytes. Each sums to requested / peak_requested.
  size_t peak_requested = 0;
  std::array<size_t, kMemoryKinds> requested_by_kind{};
  std::array<size_t, kMemoryKinds> peak_by_kind{};
};

// The per-block kinds an allocator keeps under its own lock, and the
// by-kind figures of its stats.
class MemoryLedger {
 public:
  // After stats.requested grew by `bytes` for block p (the peak taken here).
  void on_alloc(void* p, size_t bytes, AllocatorStats& stats);
  // After stats.requested shrank by `bytes` for block p.
  void on_free(void* p, size_t bytes, AllocatorStats& stats);
  void set_kind(void* p, MemoryKind kind, AllocatorStats& stats);
  void reset_peak(AllocatorStats& stats) const {
    stats.peak_requested = stats.requested;
    stats.peak_by_kind = stats.requested_by_kind;
  }

 private:
  std::unordered_map<void*, std::pair<MemoryKind, size_t>> blocks_;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual DataPtr allocate(size_t nbytes) = 0;
  virtual AllocatorStats stats() const = 0;
  // Return cached, unused memory to the system (no-op where nothing is cached).
  virtual void empty_cache() {}
  // Restarts the high-water mark from what is allocated now (torch's
  // reset_peak_memory_stats), to measure the peak of one step; a no-op
  // where no peak is kept (pinned memory).
  virtual void reset_peak_stats() {}
  // Recharges the block at `ptr` (a DataPtr's get()) to `kind`; a no-op
  // where kinds are not kept.
  virtual void set_memory_kind(void* ptr, MemoryKind kind) { (void)ptr, (void)kind; }
};

// An allocator that keeps its stats and its blocks' kinds under one lock
// (the CPU and CUDA caching allocators): the stats, peak and kind calls,
// answered alike for every such allocator.
class LedgerAllocator : public Allocator {
 public:
  AllocatorStats stats() const override {
    std::lock_guard<std::mutex> g(mu_);
    return stats_;
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> g(mu_);
    stats_.peak_allocated = stats_.allocated;
    ledger_.reset_peak(stats_);
  }
  void set_memory_kind(void* ptr, MemoryKind kind) override {
    std::lock_guard<std::mutex> g(mu_);
    ledger_.set_kind(ptr, kind, stats_);
  }

 protected:
  mutable std::mutex mu_;
  AllocatorStats stats_;
  MemoryLedger ledger_;
};

Allocator* cpu_allocator();
Allocator* pinned_allocator();          // page-locked host memory (needs CUDA)
Allocator* cuda_allocator(int device);  // caching allocator for one GPU
Allocator* get_allocator(Device d);

// CUDA graphs (cuda_graph.h): the blocks the caching allocator keeps for
// `stream` are a graph's pool while `live` (empty_cache leaves them, since
// replays write into them); live = false waits for the stream and frees
// them. Whether the device's allocator caches (a graph needs it to).
void cuda_graph_pool(int device, void* stream, bool live);
bool cuda_allocator_caching(int device);

}  // namespace ember
