// The CUDA caching allocator.
//
// cudaMalloc/cudaFree synchronize the device and cost tens of microseconds, so
// freed blocks go to a free list instead of back to the driver. Requests are
// rounded to size classes (512 B steps below 1 MiB, 2 MiB steps above) and a
// free block is reused only for its own class and on the stream it was last
// used on: work queued on that stream is ordered before any reuse, which
// makes reuse safe without events. empty_cache() returns cached blocks to the
// driver; an out-of-memory cudaMalloc empties the cache once and retries.
//
// EMBER_NO_CUDA_MEMORY_CACHING=1 (PyTorch's PYTORCH_NO_CUDA_MEMORY_CACHING)
// turns caching off: every tensor gets a cudaMalloc of exactly its size,
// freed at once. Slow, but an out-of-bounds access then leaves its
// allocation, which is what the emulated tests under AddressSanitizer (and
// compute-sanitizer on a GPU) need to see it.
#include "core/allocator.h"
#include "core/cuda_graph.h"
#include "core/device.h"
#include "core/exception.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#endif

namespace ember {
#if EMBER_WITH_CUDA
namespace {

// EMBER_NO_CUDA_MEMORY_CACHING set to anything but "0".
bool caching_disabled() {
  const char* v = std::getenv("EMBER_NO_CUDA_MEMORY_CACHING");
  return v != nullptr && std::string(v) != "0";
}

size_t size_class(size_t n) {
  constexpr size_t kSmall = 512, kLarge = 2 << 20, kSmallLimit = 1 << 20;
  if (n == 0) n = 1;
  return n < kSmallLimit ? (n + kSmall - 1) / kSmall * kSmall : (n + kLarge - 1) / kLarge * kLarge;
}

class CudaCachingAllocator final : public LedgerAllocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device), caching_(!caching_disabled()) {}

  DataPtr allocate(size_t nbytes) override {
    EMBER_CHECK(cuda_is_available(), "cuda allocator: no CUDA device: ", cuda_unavailable_reason());
    if (!caching_) return allocate_uncached(nbytes);
    const size_t cls = size_class(nbytes);
    void* const pool = cuda_graph_capture_pool(device_);
    void* const current = Stream::current(device_).handle;
    void* stream = current;  // the key the block is filed under
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      // While this thread captures a CUDA graph on this device, every block
      // is the graph's, whatever stream the region made current: filed
      // under another stream's key it could be handed to eager work, or
      // freed, while the graph's replays still write into it. Each stream
      // of the region keeps a key of its own inside the pool, so a block
      // is reused only in its stream's order, as outside graphs.
      if (pool) stream = pool_key(pool, current);
      if (live_keys_.count(stream)) outstanding_[stream]++;
      stats_.num_allocs++;
      auto it = free_.find({stream, cls});
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
      }
    }
    if (p == nullptr) p = device_malloc(cls);
    {
      std::lock_guard<std::mutex> g(mu_);
      stats_.allocated += cls;
      stats_.requested += nbytes;
      stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
      ledger_.on_alloc(p, nbytes, stats_);
    }
    return DataPtr{{p, [this, stream, cls, nbytes](void* q) { release(q, stream, cls, nbytes); }},
                   cuda_device(device_)};
  }

  void empty_cache() override {
    std::lock_guard<std::mutex> g(mu_);
    empty_cache_locked();
  }

  bool caching() const { return caching_; }

  // Never throws: a CudaGraph's destructor calls it. The caller has
  // waited for the graph's replays.
  void set_graph_pool(void* stream, bool live) {
    std::lock_guard<std::mutex> g(mu_);
    if (live) {
      graph_keys_[stream] = {stream};
      live_keys_.insert(stream);
      retired_.erase(stream);  // a new stream with a handle a graph had
      return;
    }
    auto keys = graph_keys_.find(stream);
    if (keys == graph_keys_.end()) return;
    for (void* key : keys->second) {
      live_keys_.erase(key);
      for (auto it = free_.begin(); it != free_.end();) {
        if (it->first.first != key) {
          ++it;
          continue;
        }
        for (void* p : it->second) free_block(p, it->first.second);
        it = free_.erase(it);
      }
      // Blocks still held by tensors (the graph's static outputs) come back
      // under a key nothing orders work on any more (the stream is
      // destroyed with the graph): release() frees them, and the key is
      // forgotten with its last block (a new stream may get the handle).
      if (outstanding_[key] > 0)
        retired_.insert(key);
      else
        outstanding_.erase(key);
    }
    graph_keys_.erase(keys);
  }

 private:
  DataPtr allocate_uncached(size_t nbytes) {
    const size_t n = std::max<size_t>(nbytes, 1);
    void* p = device_malloc(n);
    {
      std::lock_guard<std::mutex> g(mu_);
      stats_.num_allocs++;
      stats_.allocated += n;
      stats_.requested += n;
      stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
      ledger_.on_alloc(p, n, stats_);
    }
    return DataPtr{{p, [this, n](void* q) {
                      cudaFree(q);  // synchronizes, as the caching path's reuse need not
                      std::lock_guard<std::mutex> g(mu_);
                      stats_.allocated -= n;
                      stats_.requested -= n;
                      ledger_.on_free(q, n, stats_);
                      stats_.reserved -= n;
                    }},
                   cuda_device(device_)};
  }

  void* device_malloc(size_t cls) {
    int prev = 0;
    EMBER_CUDA_CHECK(cudaGetDevice(&prev));
    EMBER_CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    // cudaMalloc is not stream-ordered, so a capture in progress (a CUDA
    // graph's region allocating its pool) would refuse it in the default
    // global mode; this thread's call is safe, so it relaxes the mode, as
    // PyTorch's allocator does.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    EMBER_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    cudaError_t err = cudaMalloc(&p, cls);
    if (err == cudaErrorMemoryAllocation && !cuda_graph_capture_active()) {
      cudaGetLastError();
      std::lock_guard<std::mutex> g(mu_);
      empty_cache_locked();
      err = cudaMalloc(&p, cls);
    }
    cudaThreadExchangeStreamCaptureMode(&mode);
    cudaSetDevice(prev);
    if (err != cudaSuccess) {
      cudaGetLastError();
      AllocatorStats s = stats();
      EMBER_CHECK(false, "CUDA out of memory on cuda:", device_, " allocating ", cls, " bytes (",
                  s.allocated, " allocated, ", s.reserved, " reserved): ", cudaGetErrorString(err));
    }
    std::lock_guard<std::mutex> g(mu_);
    stats_.reserved += cls;
    stats_.num_device_allocs++;
    return p;
  }

  void release(void* p, void* stream, size_t cls, size_t nbytes) {
    std::lock_guard<std::mutex> g(mu_);
    stats_.allocated -= cls;
    stats_.requested -= nbytes;
    ledger_.on_free(p, nbytes, stats_);
    if (retired_.count(stream)) {
      free_block(p, cls);
      if (--outstanding_[stream] <= 0) {
        retired_.erase(stream);
        outstanding_.erase(stream);
      }
      return;
    }
    if (live_keys_.count(stream)) outstanding_[stream]--;
    free_[{stream, cls}].push_back(p);
  }

  // cudaFree (which waits for the device); while any thread captures a
  // graph (cudaFree would invalidate the capture) or where the runtime
  // refuses it, kept for a later empty_cache(): never dropped while still
  // reserved.
  void free_block(void* p, size_t cls) {
    if (!cuda_graph_capture_active() && cudaFree(p) == cudaSuccess) {
      stats_.reserved -= cls;
      return;
    }
    cudaGetLastError();
    orphans_.emplace_back(p, cls);
  }

  // The key a block allocated on `current` during the capture of the
  // graph whose stream is `pool` is filed under: the pool's stream itself,
  // or a tag of this (graph, stream) pair that the graph's keys list.
  void* pool_key(void* pool, void* current) {
    if (current == pool) return pool;
    std::unique_ptr<char>& tag = tags_[{pool, current}];
    if (!tag) {
      tag = std::make_unique<char>();
      graph_keys_[pool].push_back(tag.get());
      live_keys_.insert(tag.get());
    }
    return tag.get();
  }

  // Leaves the pools of live CUDA graphs, whose replays write into them,
  // and everything while this thread captures (cudaFree cannot be captured).
  void empty_cache_locked() {
    if (cuda_graph_capture_active()) return;
    std::vector<std::pair<void*, size_t>> orphans;
    orphans.swap(orphans_);
    for (auto& [p, cls] : orphans) free_block(p, cls);
    for (auto& [key, blocks] : free_) {
      if (live_keys_.count(key.first)) continue;
      std::vector<void*> kept;
      for (void* p : blocks) {
        if (cudaFree(p) == cudaSuccess) {
          stats_.reserved -= key.second;
        } else {  // refused (another thread is capturing): still reserved, kept
          cudaGetLastError();
          kept.push_back(p);
        }
      }
      blocks.swap(kept);
    }
  }

  int device_;
  bool caching_;
  std::map<std::pair<void*, size_t>, std::vector<void*>> free_;
  // CUDA graphs' pools. A live graph's keys (its stream, and a tag per
  // other stream its region allocated on): their blocks are the graph's.
  std::map<void*, std::vector<void*>> graph_keys_;
  std::set<void*> live_keys_;
  std::map<std::pair<void*, void*>, std::unique_ptr<char>> tags_;  // (graph stream, stream) -> tag
  std::map<void*, int64_t> outstanding_;                           // blocks of a graph key held by tensors
  std::set<void*> retired_;                        // keys of destroyed graphs with blocks still held: freed on release
  std::vector<std::pair<void*, size_t>> orphans_;  // blocks cudaFree refused, for the next empty_cache
};

}  // namespace
#endif  // EMBER_WITH_CUDA

#if EMBER_WITH_CUDA
namespace {
CudaCachingAllocator& caching_allocator(int device) {
  return *static_cast<CudaCachingAllocator*>(cuda_allocator(device));
}
}  // namespace
void cuda_graph_pool(int device, void* stream, bool live) { caching_allocator(device).set_graph_pool(stream, live); }
bool cuda_allocator_caching(int device) { return caching_allocator(device).caching(); }
#else
void cuda_graph_pool(int, void*, bool) {}
bool cuda_allocator_caching(int) { return false; }
#endif

Allocator* cuda_allocator(int device) {
  EMBER_CHECK(cuda_is_available(), "cuda allocator: no CUDA device: ", cuda_unavailable_reason());
  EMBER_CHECK(device >= 0 && device < cuda_device_count(), "cuda allocator: device cuda:", device,
              " does not exist (", cuda_device_count(), " devices)");
#if !EMBER_WITH_CUDA
  return nullptr;  // unreachable: cuda_is_available() is false without CUDA
#else
  // Leaked on purpose: tensors in static storage may be freed after main returns.
  static auto* allocators = [] {
    auto* v = new std::vector<std::unique_ptr<CudaCachingAllocator>>;
    for (int i = 0; i < cuda_device_count(); ++i) v->push_back(std::make_unique<CudaCachingAllocator>(i));
    return v;
  }();
  return (*allocators)[device].get();
#endif
}

}  // namespace ember
