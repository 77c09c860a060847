// Device parsing/printing, the CPU allocator and CUDA runtime queries.
#include "core/device.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "core/cuda_check.h"
#include "core/exception.h"

namespace ember {

Device::Device(const std::string& spec) {
  if (spec == "cpu") {
    type = DeviceType::CPU;
    index = 0;
    return;
  }
  EMBER_CHECK(spec.rfind("cuda", 0) == 0, "Device: cannot parse '", spec,
              "' (expected cpu, cuda or cuda:N)");
  type = DeviceType::CUDA;
  index = 0;
  if (spec.size() > 4) {
    EMBER_CHECK(spec[4] == ':' && spec.size() > 5, "Device: cannot parse '", spec, "'");
    char* end = nullptr;
    long v = std::strtol(spec.c_str() + 5, &end, 10);
    EMBER_CHECK(*end == '\0' && v >= 0, "Device: bad index in '", spec, "'");
    index = static_cast<int>(v);
  }
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

namespace {

class CpuAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t nbytes) override {
    // 64-byte alignment suits AVX-512 loads and keeps cache lines unshared.
    size_t rounded = (std::max<size_t>(nbytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    EMBER_CHECK(p != nullptr, "cpu allocator: out of memory allocating ", nbytes, " bytes");
    size_t now = allocated_.fetch_add(rounded) + rounded;
    size_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {}
    allocs_.fetch_add(1);
    return DataPtr{{p, [this, rounded](void* q) {
                      std::free(q);
                      allocated_.fetch_sub(rounded);
                    }},
                   kCPU};
  }
  AllocatorStats stats() const override {
    AllocatorStats s;
    s.allocated = s.reserved = allocated_.load();
    s.peak_allocated = peak_.load();
    s.num_allocs = s.num_device_allocs = allocs_.load();
    return s;
  }

 private:
  std::atomic<size_t> allocated_{0}, peak_{0}, allocs_{0};
};

class PinnedAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t nbytes) override {
    EMBER_CHECK(cuda_is_available(), "pin_memory: no CUDA device: ", cuda_unavailable_reason());
    void* p = nullptr;
    EMBER_CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(nbytes, 1), cudaHostAllocDefault));
    allocated_ += nbytes;
    return DataPtr{{p, [this, nbytes](void* q) {
                      cudaFreeHost(q);
                      allocated_ -= nbytes;
                    }},
                   kCPU};
  }
  AllocatorStats stats() const override {
    AllocatorStats s;
    s.allocated = s.reserved = allocated_.load();
    return s;
  }

 private:
  std::atomic<size_t> allocated_{0};
};

struct CudaInfo {
  int count = 0;
  std::string reason;
};

const CudaInfo& cuda_info() {
  static const CudaInfo info = [] {
    CudaInfo i;
    cudaError_t err = cudaGetDeviceCount(&i.count);
    if (err != cudaSuccess) {
      i.count = 0;
      i.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
      cudaGetLastError();  // clear the sticky error
    } else if (i.count == 0) {
      i.reason = "no CUDA devices found";
    }
    return i;
  }();
  return info;
}

thread_local void* tls_streams[16] = {};

}  // namespace

Allocator* cpu_allocator() {
  static CpuAllocator a;
  return &a;
}

Allocator* pinned_allocator() {
  static PinnedAllocator a;
  return &a;
}

Allocator* get_allocator(Device d) { return d.is_cpu() ? cpu_allocator() : cuda_allocator(d.index); }

int cuda_device_count() { return cuda_info().count; }
bool cuda_is_available() { return cuda_info().count > 0; }
std::string cuda_unavailable_reason() { return cuda_info().reason; }

void cuda_synchronize() {
  if (cuda_is_available()) EMBER_CUDA_CHECK(cudaDeviceSynchronize());
}

void* current_cuda_stream(int device) {
  EMBER_CHECK(device >= 0 && device < 16, "current_cuda_stream: device index ", device, " out of range");
  return tls_streams[device];
}

void set_current_cuda_stream(int device, void* stream) {
  EMBER_CHECK(device >= 0 && device < 16, "set_current_cuda_stream: device index ", device, " out of range");
  tls_streams[device] = stream;
}

}  // namespace ember
