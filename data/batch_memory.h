// Memory for batches: a pool of recycled host buffers (plain or pinned),
// and a copier that moves batches to a GPU on its own stream.
//
// Recycling: a fresh batch buffer is a fresh heap block, and glibc returns
// freed blocks above its trim threshold to the OS, so every batch would
// page-fault its memory in again (15% of a Fashion-MNIST epoch went to the
// kernel zeroing pages); cudaHostAlloc for pinned memory costs far more.
//
// Copying: Tensor::to(cuda) blocks until the copy lands, so the GPU would sit
// idle while a batch crosses PCIe. The copier instead queues the copy on a
// side stream and makes the consumer's current stream wait on an event: the
// host never blocks and the copy of the next batch overlaps this batch's
// kernels.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"

namespace ember::data {

// Host tensors whose memory returns to the pool when the last tensor using
// it dies; a loader needs the same few sizes over and over. At most
// `max_cached` buffers are kept (a consumer that hoards batches and then
// drops them all must not leave them all cached).
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // `allocator`: cpu_allocator() or pinned_allocator().
  static std::shared_ptr<BufferPool> create(Allocator* allocator, size_t max_cached) {
    return std::shared_ptr<BufferPool>(new BufferPool(allocator, max_cached));
  }
  // A contiguous CPU tensor (uninitialized).
  Tensor empty(const Shape& shape, DType dtype);
  size_t cached_buffers() const;

 private:
  BufferPool(Allocator* allocator, size_t max_cached) : allocator_(allocator), max_cached_(max_cached) {}
  void give_back(size_t nbytes, DataPtr p);
  Allocator* allocator_;
  size_t max_cached_;
  mutable std::mutex mu_;
  std::multimap<size_t, DataPtr> free_;
};

class AsyncCopier {
 public:
  explicit AsyncCopier(Device device);
  ~AsyncCopier();  // waits for the copies still in flight
  AsyncCopier(const AsyncCopier&) = delete;
  AsyncCopier& operator=(const AsyncCopier&) = delete;

  struct Copy {
    std::vector<Tensor> device;   // not to be read before finish()
    std::shared_ptr<Event> done;  // recorded after the copy
  };
  // Queues copies of `host` (contiguous CPU tensors, pinned for a truly
  // asynchronous copy) into new tensors on the device. The host tensors are
  // kept alive until the copy has landed. Call from the consumer's thread:
  // the device memory belongs to its current stream.
  Copy start(const std::vector<Tensor>& host);
  // Makes the calling thread's current stream wait for the copy (the host
  // does not block) and returns the device tensors.
  std::vector<Tensor> finish(Copy copy);
  // Blocks until every queued copy has landed.
  void synchronize();

 private:
  void reap(bool block);
  Device device_;
  std::shared_ptr<const Stream> stream_;  // the side stream copies run on
  std::deque<std::pair<std::shared_ptr<Event>, std::vector<Tensor>>> in_flight_;
};

}  // namespace ember::data
