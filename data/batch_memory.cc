// BufferPool and AsyncCopier (see batch_memory.h).
//
// Ordering, since the caching allocator hands a freed block to the next
// request on the same stream without events: device batches are allocated
// on the consumer's stream, so a block's previous user (a kernel queued on
// that stream) may still be reading it when we reuse it. The side stream
// therefore first waits for an event recorded on the consumer's stream at
// allocation, then copies; the consumer's stream waits for the copy before
// the batch is handed over. Every read and write of the block is ordered.
#include "data/batch_memory.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace ember::data {
#if EMBER_WITH_CUDA
namespace {

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    EMBER_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) EMBER_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

}  // namespace
#endif

Tensor BufferPool::empty(const Shape& shape, DType dtype) {
  const size_t nbytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  DataPtr raw;
  size_t have = nbytes;
  {
    std::lock_guard<std::mutex> g(mu_);
    // Any cached buffer up to twice the size will do: the last, smaller
    // batch of an epoch can reuse a full batch's buffer.
    auto it = free_.lower_bound(nbytes);
    if (it != free_.end() && it->first <= 2 * nbytes + 4096) {
      have = it->first;
      raw = std::move(it->second);
      free_.erase(it);
    }
  }
  if (raw.get() == nullptr) raw = allocator_->allocate(nbytes);
  void* p = raw.get();
  auto holder = std::make_shared<DataPtr>(std::move(raw));
  auto self = shared_from_this();
  auto impl = std::make_shared<TensorImpl>();
  impl->sizes = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->storage = std::make_shared<Storage>();
  impl->storage->nbytes = nbytes;
  impl->storage->data = DataPtr{{p, [self, holder, have](void*) { self->give_back(have, std::move(*holder)); }}, kCPU};
  return Tensor(std::move(impl));
}

void BufferPool::give_back(size_t nbytes, DataPtr p) {
  std::lock_guard<std::mutex> g(mu_);
  if (free_.size() < max_cached_) free_.emplace(nbytes, std::move(p));
  // Otherwise `p` goes back to its allocator here.
}

size_t BufferPool::cached_buffers() const {
  std::lock_guard<std::mutex> g(mu_);
  return free_.size();
}

AsyncCopier::AsyncCopier(Device device) : device_(device) {
  EMBER_CHECK(device.is_cuda(), "AsyncCopier: expected a CUDA device, got ", device);
  EMBER_CHECK(cuda_is_available(), "AsyncCopier: no CUDA device: ", cuda_unavailable_reason());
#if EMBER_WITH_CUDA  // else the check above has failed: no copier exists
  // Non-blocking: the legacy default stream must not serialize with it.
  stream_ = new_stream(device.index);
#endif
}

#if !EMBER_WITH_CUDA
AsyncCopier::~AsyncCopier() = default;
AsyncCopier::Copy AsyncCopier::start(const std::vector<Tensor>&) { return {}; }
std::vector<Tensor> AsyncCopier::finish(Copy copy) { return std::move(copy.device); }
void AsyncCopier::synchronize() {}
void AsyncCopier::reap(bool) {}
#else

AsyncCopier::~AsyncCopier() {
  try {
    synchronize();
  } catch (...) {
    // A failed device cannot be waited on; the buffers are released anyway.
  }
  in_flight_.clear();
  stream_.reset();
}

AsyncCopier::Copy AsyncCopier::start(const std::vector<Tensor>& host) {
  DeviceGuard g(device_.index);
  reap(false);
  const Stream side = *stream_;
  auto copy_stream = static_cast<cudaStream_t>(side.handle);
  const Stream consumer = Stream::current(device_.index);
  Copy c;
  for (const Tensor& h : host) {
    EMBER_CHECK(h.device().is_cpu() && h.is_contiguous(), "AsyncCopier: expected contiguous CPU tensors");
    c.device.push_back(Tensor::empty(h.sizes(), {h.dtype(), device_}));
  }
  // Destroying an event whose work is pending is allowed: CUDA frees it
  // once the work completes.
  Event allocated(device_.index);
  allocated.record(consumer);
  allocated.block(side);
  for (size_t i = 0; i < host.size(); ++i)
    if (host[i].nbytes() > 0)
      EMBER_CUDA_CHECK(cudaMemcpyAsync(c.device[i].raw_data(), host[i].raw_data(), host[i].nbytes(),
                                       cudaMemcpyHostToDevice, copy_stream));
  c.done = std::make_shared<Event>(device_.index);
  c.done->record(side);
  in_flight_.emplace_back(c.done, host);
  return c;
}

std::vector<Tensor> AsyncCopier::finish(Copy copy) {
  DeviceGuard g(device_.index);
  copy.done->block(Stream::current(device_.index));
  reap(false);
  return std::move(copy.device);
}

void AsyncCopier::synchronize() { reap(true); }

// Releases the host buffers of copies that have landed (all, if `block`).
void AsyncCopier::reap(bool block) {
  while (!in_flight_.empty()) {
    const Event& e = *in_flight_.front().first;
    if (block)
      e.synchronize();
    else if (!e.query())
      return;
    in_flight_.pop_front();
  }
}

#endif  // EMBER_WITH_CUDA

}  // namespace ember::data
