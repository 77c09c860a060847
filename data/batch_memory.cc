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

std::shared_ptr<void> new_event() {
  cudaEvent_t e = nullptr;
  EMBER_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  // Destroying an event whose work is pending is allowed: CUDA frees it
  // once the work completes.
  return std::shared_ptr<void>(e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
}

cudaEvent_t as_event(const std::shared_ptr<void>& e) { return static_cast<cudaEvent_t>(e.get()); }

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
  DeviceGuard g(device.index);
  cudaStream_t s = nullptr;
  // Non-blocking: the legacy default stream must not serialize with it.
  EMBER_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
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
  DeviceGuard g(device_.index);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

AsyncCopier::Copy AsyncCopier::start(const std::vector<Tensor>& host) {
  DeviceGuard g(device_.index);
  reap(false);
  auto copy_stream = static_cast<cudaStream_t>(stream_);
  auto consumer = static_cast<cudaStream_t>(current_cuda_stream(device_.index));
  Copy c;
  for (const Tensor& h : host) {
    EMBER_CHECK(h.device().is_cpu() && h.is_contiguous(), "AsyncCopier: expected contiguous CPU tensors");
    c.device.push_back(Tensor::empty(h.sizes(), {h.dtype(), device_}));
  }
  std::shared_ptr<void> allocated = new_event();
  EMBER_CUDA_CHECK(cudaEventRecord(as_event(allocated), consumer));
  EMBER_CUDA_CHECK(cudaStreamWaitEvent(copy_stream, as_event(allocated), 0));
  for (size_t i = 0; i < host.size(); ++i)
    if (host[i].nbytes() > 0)
      EMBER_CUDA_CHECK(cudaMemcpyAsync(c.device[i].raw_data(), host[i].raw_data(), host[i].nbytes(),
                                       cudaMemcpyHostToDevice, copy_stream));
  c.done = new_event();
  EMBER_CUDA_CHECK(cudaEventRecord(as_event(c.done), copy_stream));
  in_flight_.emplace_back(c.done, host);
  return c;
}

std::vector<Tensor> AsyncCopier::finish(Copy copy) {
  DeviceGuard g(device_.index);
  auto consumer = static_cast<cudaStream_t>(current_cuda_stream(device_.index));
  EMBER_CUDA_CHECK(cudaStreamWaitEvent(consumer, as_event(copy.done), 0));
  reap(false);
  return std::move(copy.device);
}

void AsyncCopier::synchronize() { reap(true); }

// Releases the host buffers of copies that have landed (all, if `block`).
void AsyncCopier::reap(bool block) {
  while (!in_flight_.empty()) {
    cudaEvent_t e = as_event(in_flight_.front().first);
    if (block) {
      EMBER_CUDA_CHECK(cudaEventSynchronize(e));
    } else {
      cudaError_t st = cudaEventQuery(e);
      if (st == cudaErrorNotReady) return;
      EMBER_CUDA_CHECK(st);
    }
    in_flight_.pop_front();
  }
}

#endif  // EMBER_WITH_CUDA

}  // namespace ember::data
