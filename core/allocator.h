// The one allocator interface every backend implements.
//
// An Allocator hands out DataPtrs: a pointer that owns its memory and knows
// its device, so storage never needs to ask who allocated it. The CPU
// allocator is 64-byte aligned and caches large blocks (allocator.cc); the
// CUDA one caches blocks per stream (cuda_allocator.cc); pinned host memory
// is a third allocator used for fast host<->device copies (allocator.cc).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "core/device.h"

namespace ember {

// Owning pointer + device. The deleter returns the memory to its allocator.
struct DataPtr {
  std::unique_ptr<void, std::function<void(void*)>> ptr;
  Device device;
  void* get() const { return ptr.get(); }
};

struct AllocatorStats {
  size_t allocated = 0;       // bytes handed to tensors now
  size_t reserved = 0;        // bytes held from the driver (allocated + cached)
  size_t peak_allocated = 0;  // high-water mark of `allocated`
  // Bytes the live tensors asked for (`allocated` counts the blocks that
  // serve them, rounded up to a size class or a larger cached block): what
  // an activation-memory figure compares across layouts. CPU allocator only
  // (0 elsewhere).
  size_t requested = 0;
  size_t num_allocs = 0;         // allocate() calls
  size_t num_device_allocs = 0;  // calls that reached cudaMalloc / aligned_alloc
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
};

Allocator* cpu_allocator();
Allocator* pinned_allocator();          // page-locked host memory (needs CUDA)
Allocator* cuda_allocator(int device);  // caching allocator for one GPU
Allocator* get_allocator(Device d);

}  // namespace ember
