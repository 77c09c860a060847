// The CPU and pinned-memory allocators and the allocator of each device
// (allocator.h); the CUDA caching allocator is in cuda_allocator.cc.
#include "core/allocator.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>
#endif
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#if EMBER_WITH_CUDA
#include "core/cuda_check.h"
#endif
#include "core/exception.h"

namespace ember {

namespace {
thread_local MemoryKind t_memory_kind = MemoryKind::Other;
}  // namespace

const char* memory_kind_name(MemoryKind k) {
  static const char* const names[kMemoryKinds] = {"other", "params", "grads", "optimizer", "gathered", "activations"};
  return names[static_cast<int>(k)];
}

MemoryKindScope::MemoryKindScope(MemoryKind kind) : prev_(t_memory_kind) { t_memory_kind = kind; }
MemoryKindScope::~MemoryKindScope() { t_memory_kind = prev_; }

void MemoryLedger::on_alloc(void* p, size_t bytes, AllocatorStats& stats) {
  const MemoryKind k = t_memory_kind;
  blocks_[p] = {k, bytes};
  stats.requested_by_kind[static_cast<int>(k)] += bytes;
  if (stats.requested > stats.peak_requested) {
    stats.peak_requested = stats.requested;
    stats.peak_by_kind = stats.requested_by_kind;
  }
}

void MemoryLedger::on_free(void* p, size_t bytes, AllocatorStats& stats) {
  auto it = blocks_.find(p);
  EMBER_INTERNAL_ASSERT(it != blocks_.end() && it->second.second == bytes, "memory ledger: unknown block");
  stats.requested_by_kind[static_cast<int>(it->second.first)] -= bytes;
  blocks_.erase(it);
}

void MemoryLedger::set_kind(void* p, MemoryKind kind, AllocatorStats& stats) {
  auto it = blocks_.find(p);
  if (it == blocks_.end() || it->second.first == kind) return;
  stats.requested_by_kind[static_cast<int>(it->second.first)] -= it->second.second;
  stats.requested_by_kind[static_cast<int>(kind)] += it->second.second;
  it->second.first = kind;
}

namespace {

// Blocks of 64 KiB and more are cached on free: glibc serves them with mmap
// and returns them with munmap, and touching a fresh 64 MiB mapping costs
// ~16k page faults, more than the op that asked for it (caching from 64 KiB
// rather than 1 MiB made a narrow ResNet-18 step 13% faster). The cache is
// bounded (kCacheLimit) and keyed by size class (64 KiB steps up to 2 MiB,
// then 2 MiB steps); small blocks go straight to malloc.
// EMBER_CPU_CACHE_MB sets the bound (default 1024; 0 turns the cache off, so
// freed memory goes back to malloc at once, e.g. to measure live memory by
// RSS with MALLOC_MMAP_THRESHOLD_ set, as PyTorch's CPU peers are measured).
class CpuAllocator final : public LedgerAllocator {
 public:
  CpuAllocator()
      : cache_limit_(mib_from_env("EMBER_CPU_CACHE_MB", size_t{1} << 30, "0 turns the CPU allocator's cache off")),
        limit_(mib_from_env("EMBER_CPU_MEMORY_LIMIT_MB", 0, "0 or unset: no limit")) {}

  DataPtr allocate(size_t nbytes) override {
    size_t cls = size_class(nbytes);
    void* p = nullptr;
    std::lock_guard<std::mutex> g(mu_);
    // Best fit: the smallest cached block of this class or up to twice its
    // size. Exact classes alone let blocks of one size pile up while
    // requests of a neighbouring size went to malloc: oneDNN's Winograd
    // scratchpads, one size per layer, raised a width-64 ResNet step's peak
    // RSS from 780 to 1020 MiB that way.
    // Small blocks are never cached: no search for them.
    auto it = cls >= kLarge ? cache_.lower_bound(cls) : cache_.end();
    while (it != cache_.end() && it->second.empty() && it->first <= 2 * cls) ++it;
    if (it != cache_.end() && !it->second.empty() && it->first <= 2 * cls) {
      p = it->second.back();
      it->second.pop_back();
      cached_ -= it->first;
      cls = it->first;  // the block keeps its class: freed, it returns there
    } else {
      if (limit_ > 0 && stats_.reserved + cls > limit_) {
        empty_cache_locked();  // as a GPU's allocator would, before it gives up
        EMBER_CHECK(stats_.reserved + cls <= limit_, "CPU out of memory: allocating ", mib(nbytes), " MiB (",
                    memory_kind_name(t_memory_kind), ") with ", mib(stats_.allocated), " MiB allocated by ",
                    stats_.num_allocs, " allocations would pass EMBER_CPU_MEMORY_LIMIT_MB=", limit_ >> 20,
                    " (the largest part now: ", memory_kind_name(largest_kind()), " ",
                    mib(stats_.requested_by_kind[static_cast<int>(largest_kind())]), " MiB)");
      }
      // 64-byte alignment suits AVX-512 loads and keeps cache lines unshared.
      p = std::aligned_alloc(64, cls);
      EMBER_CHECK(p != nullptr, "cpu allocator: out of memory allocating ", nbytes, " bytes");
      stats_.num_device_allocs++;
      stats_.reserved += cls;
    }
    stats_.num_allocs++;
    stats_.allocated += cls;
    stats_.requested += nbytes;
    stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
    ledger_.on_alloc(p, nbytes, stats_);
    return DataPtr{{p, [this, cls, nbytes](void* q) { release(q, cls, nbytes); }}, kCPU};
  }

  void empty_cache() override {
    std::lock_guard<std::mutex> g(mu_);
    empty_cache_locked();
  }

 private:
  static constexpr size_t kLarge = 64 << 10, kMidClass = 64 << 10, kHuge = 2 << 20, kClass = 2 << 20;

  void empty_cache_locked() {
    for (auto& [cls, blocks] : cache_) {
      for (void* q : blocks) std::free(q);
      stats_.reserved -= cls * blocks.size();
      blocks.clear();
    }
    cached_ = 0;
  }

  // A size in MiB from the environment, `unset` where it is absent.
  static size_t mib_from_env(const char* name, size_t unset, const char* meaning) {
    const char* v = std::getenv(name);
    if (!v || !*v) return unset;
    char* end = nullptr;
    const long long mb = std::strtoll(v, &end, 10);
    EMBER_CHECK(*end == '\0' && mb >= 0, name, "=", v, " is not a size in MiB (a non-negative integer; ", meaning, ")");
    return static_cast<size_t>(mb) << 20;
  }
  static double mib(size_t bytes) { return std::round(bytes / 1048576.0 * 100) / 100; }
  MemoryKind largest_kind() const {
    int k = 0;
    for (int i = 1; i < kMemoryKinds; ++i)
      if (stats_.requested_by_kind[i] > stats_.requested_by_kind[k]) k = i;
    return static_cast<MemoryKind>(k);
  }

  static size_t size_class(size_t n) {
    n = std::max<size_t>(n, 1);
    if (n < kLarge) return (n + 63) / 64 * 64;
    if (n < kHuge) return (n + kMidClass - 1) / kMidClass * kMidClass;
    return (n + kClass - 1) / kClass * kClass;
  }

  void release(void* q, size_t cls, size_t nbytes) {
    std::lock_guard<std::mutex> g(mu_);
    stats_.allocated -= cls;
    stats_.requested -= nbytes;
    ledger_.on_free(q, nbytes, stats_);
    if (cls >= kLarge && cached_ + cls <= cache_limit_) {
      cache_[cls].push_back(q);
      cached_ += cls;
      return;
    }
    std::free(q);
    stats_.reserved -= cls;
  }

  std::map<size_t, std::vector<void*>> cache_;
  size_t cached_ = 0;
  const size_t cache_limit_;
  // EMBER_CPU_MEMORY_LIMIT_MB: the bytes this process may hold from malloc
  // for tensors (reserved: allocated + cached), a GPU's capacity on the CPU,
  // so a run that would not fit one device fails here with a named error
  // (the tests of context parallelism's memory use it). 0: no limit.
  const size_t limit_;
};

class PinnedAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t nbytes) override {
    EMBER_CHECK(cuda_is_available(), "pin_memory: no CUDA device: ", cuda_unavailable_reason());
#if EMBER_WITH_CUDA
    void* p = nullptr;
    EMBER_CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(nbytes, 1), cudaHostAllocDefault));
    allocated_ += nbytes;
    return DataPtr{{p,
                    [this, nbytes](void* q) {
                      cudaFreeHost(q);
                      allocated_ -= nbytes;
                    }},
                   kCPU};
#else
    return DataPtr{};  // unreachable: the check above fails without CUDA
#endif
  }
  AllocatorStats stats() const override {
    AllocatorStats s;
    s.allocated = s.reserved = allocated_.load();
    return s;
  }

 private:
  std::atomic<size_t> allocated_{0};
};

}  // namespace

namespace {
// glibc trims the heap top back to the OS whenever 128 KiB or more is free
// there, so the small blocks of every training step (oneDNN's and ours, below
// the caching threshold) are page-faulted in again each step: ~14k faults per
// narrow ResNet-18 step, 13% of its time. Keeping freed memory in the process
// removes them. Left alone when the user tuned malloc through the environment.
bool tune_malloc() {
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr && std::getenv("GLIBC_TUNABLES") == nullptr) {
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    mallopt(M_TOP_PAD, 64 << 20);
  }
  return true;
}
}  // namespace

Allocator* cpu_allocator() {
  static const bool tuned = tune_malloc();
  (void)tuned;
  static auto* a = new CpuAllocator;  // leaked: tensors may outlive static destruction
  return a;
}

Allocator* pinned_allocator() {
  static auto* a = new PinnedAllocator;
  return a;
}

Allocator* get_allocator(Device d) { return d.is_cpu() ? cpu_allocator() : cuda_allocator(d.index); }

}  // namespace ember
