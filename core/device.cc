// Device parsing/printing, the CPU allocator and CUDA runtime queries.
#include "core/device.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>
#include <string>
#include <cstring>

#if EMBER_WITH_CUDA
#include "core/cuda_check.h"
#endif
#include "core/cuda_graph.h"
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

struct CudaInfo {
  int count = 0;
  std::string reason;
};

const CudaInfo& cuda_info() {
  static const CudaInfo info = [] {
    CudaInfo i;
#if !EMBER_WITH_CUDA
    i.reason = "ember was built without CUDA (the CPU-only configuration)";
    return i;
#else
    cudaError_t err = cudaGetDeviceCount(&i.count);
    if (err != cudaSuccess) {
      i.count = 0;
      i.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
      cudaGetLastError();  // clear the sticky error
    } else if (i.count == 0) {
      i.reason = "no CUDA devices found";
    }
    return i;
#endif
  }();
  return info;
}

}  // namespace

int cuda_device_count() { return cuda_info().count; }
bool cuda_is_available() { return cuda_info().count > 0; }
std::string cuda_unavailable_reason() { return cuda_info().reason; }

std::string cuda_device_name(int device) {
  EMBER_CHECK(device >= 0 && device < cuda_device_count(), "cuda_device_name: no CUDA device ", device, " (",
              cuda_device_count(), " present)");
#if EMBER_WITH_CUDA
  cudaDeviceProp prop{};
  EMBER_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
#else
  return "";
#endif
}

void cuda_synchronize() {
#if EMBER_WITH_CUDA
  if (!cuda_is_available()) return;
  check_not_capturing("cuda_synchronize()");
  int device = 0;
  EMBER_CUDA_CHECK(cudaGetDevice(&device));
  const Stream stream = Stream::current(device);
  cuda_error_snapshot(stream);
  EMBER_CUDA_CHECK(cudaDeviceSynchronize());
  cuda_error_raise_if_set(stream);
#endif
}

namespace {
// A library switch (TF32, cuDNN benchmark mode): the environment's value on
// first use, then the setter's. -1 means not read yet.
struct EnvSwitch {
  const char* env;
  bool fallback;
  std::atomic<int> value{-1};
  bool get() {
    int v = value.load(std::memory_order_relaxed);
    if (v < 0) {
      v = fallback;
      if (const char* e = std::getenv(env); e && *e) {
        const std::string s(e);
        EMBER_CHECK(s == "0" || s == "1", env, "=", s, ": expected 0 or 1");
        v = s == "1";
      }
      value.store(v, std::memory_order_relaxed);
    }
    return v != 0;
  }
  void set(bool on) { value.store(on, std::memory_order_relaxed); }
};
// Constant-initialized, so usable from any other static's initializer.
constinit EnvSwitch cudnn_tf32{"EMBER_CUDNN_ALLOW_TF32", true};
constinit EnvSwitch matmul_tf32{"EMBER_MATMUL_ALLOW_TF32", false};
constinit EnvSwitch cudnn_bench{"EMBER_CUDNN_BENCHMARK", false};
constinit EnvSwitch cudnn_fp32_cl_nchw{"EMBER_CUDNN_FP32_CL_VIA_NCHW", false};
constinit EnvSwitch cudnn_graph{"EMBER_CUDNN_GRAPH", true};
constinit EnvSwitch sync_checks{"EMBER_SYNC_CHECKS", false};
constinit EnvSwitch deterministic{"EMBER_DETERMINISTIC", false};
constinit EnvSwitch lt_epilogues{"EMBER_CUBLASLT_EPILOGUE", true};

// Per device: the slot in device memory and its host mirror in pinned
// memory (so that the snapshot copy is asynchronous and rides on the
// synchronisation the caller makes anyway).
struct ErrorSlots {
  std::mutex mu;
  DeviceErrorSlot* dev[16] = {};
  DeviceErrorSlot* host[16] = {};
  std::vector<std::string> names;  // code - 1 -> op name
};
ErrorSlots& error_slots() {
  static auto* s = new ErrorSlots;  // leaked: used until exit
  return *s;
}
}  // namespace

bool cuda_sync_checks() { return sync_checks.get(); }
void set_cuda_sync_checks(bool on) { sync_checks.set(on); }

int32_t cuda_error_op_code(const char* op) {
  ErrorSlots& s = error_slots();
  std::lock_guard<std::mutex> lock(s.mu);
  for (size_t i = 0; i < s.names.size(); ++i)
    if (s.names[i] == op) return static_cast<int32_t>(i + 1);
  s.names.emplace_back(op);
  return static_cast<int32_t>(s.names.size());
}

DeviceErrorSlot* cuda_error_slot(int device) {
  EMBER_CHECK(device >= 0 && device < 16, "cuda_error_slot: device index ", device, " out of range");
  ErrorSlots& s = error_slots();
  std::lock_guard<std::mutex> lock(s.mu);
#if EMBER_WITH_CUDA
  if (s.dev[device] == nullptr) {
    int prev = 0;
    EMBER_CUDA_CHECK(cudaGetDevice(&prev));
    EMBER_CUDA_CHECK(cudaSetDevice(device));
    void *d = nullptr, *h = nullptr;
    cudaError_t err = cudaMalloc(&d, sizeof(DeviceErrorSlot));
    if (err == cudaSuccess) err = cudaMemset(d, 0, sizeof(DeviceErrorSlot));  // once per process
    if (err == cudaSuccess) err = cudaHostAlloc(&h, sizeof(DeviceErrorSlot), cudaHostAllocDefault);
    cudaSetDevice(prev);
    EMBER_CUDA_CHECK(err);
    std::memset(h, 0, sizeof(DeviceErrorSlot));
    s.dev[device] = static_cast<DeviceErrorSlot*>(d);
    s.host[device] = static_cast<DeviceErrorSlot*>(h);
  }
#endif
  return s.dev[device];
}

void cuda_error_snapshot(Stream stream) {
#if EMBER_WITH_CUDA
  const int device = stream.device;
  ErrorSlots& s = error_slots();
  DeviceErrorSlot *d = nullptr, *h = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (device < 0 || device >= 16 || s.dev[device] == nullptr) return;  // no checked op ran on it
    d = s.dev[device];
    h = s.host[device];
  }
  EMBER_CUDA_CHECK(
      cudaMemcpyAsync(h, d, sizeof(DeviceErrorSlot), cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream.handle)));
#endif
}

void cuda_error_raise_if_set(Stream stream) {
#if EMBER_WITH_CUDA
  const int device = stream.device;
  ErrorSlots& s = error_slots();
  DeviceErrorSlot e{};
  std::string op;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (device < 0 || device >= 16 || s.host[device] == nullptr || s.host[device]->op == 0) return;
    e = *s.host[device];
    *s.host[device] = DeviceErrorSlot{};
    op = e.op >= 1 && static_cast<size_t>(e.op) <= s.names.size() ? s.names[e.op - 1] : "a CUDA kernel";
    // Clear the slot for the ops that come after the error is handled.
    EMBER_CUDA_CHECK(
        cudaMemsetAsync(s.dev[device], 0, sizeof(DeviceErrorSlot), static_cast<cudaStream_t>(stream.handle)));
  }
  const char* when = cuda_sync_checks() ? "" : " (found on the GPU, reported at the next synchronisation; "
                                               "EMBER_SYNC_CHECKS=1 reports it at the op)";
  if (e.kind == 0)
    EMBER_CHECK(false, op, ": index ", e.value, " is out of bounds for dimension ", e.a, " with size ", e.b, when);
  EMBER_CHECK(false, op, ": value ", e.value, " is out of the range [", e.a, ", ", e.b, ")", when);
#endif
}

void cuda_error_check_now(Stream stream) {
#if EMBER_WITH_CUDA
  check_not_capturing("EMBER_SYNC_CHECKS=1's check at the op");
  cuda_error_snapshot(stream);
  EMBER_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
  cuda_error_raise_if_set(stream);
#endif
}

bool cudnn_benchmark() { return cudnn_bench.get(); }
void set_cudnn_benchmark(bool on) { cudnn_bench.set(on); }

bool cudnn_allow_tf32() { return cudnn_tf32.get(); }
void set_cudnn_allow_tf32(bool allow) { cudnn_tf32.set(allow); }
bool cudnn_fp32_channels_last_via_nchw() { return cudnn_fp32_cl_nchw.get(); }
void set_cudnn_fp32_channels_last_via_nchw(bool on) { cudnn_fp32_cl_nchw.set(on); }
bool cudnn_graph_api() { return cudnn_graph.get(); }
void set_cudnn_graph_api(bool on) { cudnn_graph.set(on); }
bool deterministic_algorithms() { return deterministic.get(); }
void set_deterministic_algorithms(bool on) { deterministic.set(on); }
bool matmul_allow_tf32() { return matmul_tf32.get(); }
void set_matmul_allow_tf32(bool allow) { matmul_tf32.set(allow); }
bool cublaslt_epilogues() { return lt_epilogues.get(); }
void set_cublaslt_epilogues(bool on) { lt_epilogues.set(on); }

}  // namespace ember
