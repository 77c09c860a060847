// Devices and the facts of the CUDA runtime (how many GPUs, their names, the
// math switches, the device error slot). Allocators are in core/allocator.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "core/stream.h"

namespace ember {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  Device() = default;
  Device(DeviceType t, int i = 0) : type(t), index(i) {}
  // "cpu", "cuda", "cuda:1".
  explicit Device(const std::string& spec);

  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device& o) const { return type == o.type && (is_cpu() || index == o.index); }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
};

inline const Device kCPU{DeviceType::CPU, 0};
inline Device cuda_device(int index = 0) { return Device(DeviceType::CUDA, index); }
std::ostream& operator<<(std::ostream& os, const Device& d);

// CUDA runtime facts. Without a GPU (or driver) these report zero devices and
// the library runs on CPU; the reason is kept for messages.
int cuda_device_count();
bool cuda_is_available();
std::string cuda_unavailable_reason();
void cuda_synchronize();
// The device's name as the driver reports it ("NVIDIA H100 80GB HBM3"; the
// host emulation says "CUDA emulation").
std::string cuda_device_name(int device = 0);
// Layout copies issued on CUDA devices since the process started: copies
// that transpose (read or write their innermost dimension with a stride),
// as NCHW <-> NHWC conversions do; slices, concatenation and broadcasts are
// not counted. A channels-last step should issue none (//bench:step_counts).
uint64_t cuda_layout_copies();

// TF32 for float32 math on Ampere and later GPUs, with PyTorch's defaults:
// cuDNN convolutions may use it (torch.backends.cudnn.allow_tf32 = True),
// matrix products may not (torch.backends.cuda.matmul.allow_tf32 = False).
// The environment sets the starting values: EMBER_CUDNN_ALLOW_TF32 and
// EMBER_MATMUL_ALLOW_TF32, each 0 or 1. Algorithm choices are cached per
// math mode, so switching takes effect at the next call.
// cuDNN benchmark mode (PyTorch's torch.backends.cudnn.benchmark): each new
// convolution geometry times cuDNN's algorithms once (cudnnFind*Ex, the
// workspace capped) and keeps the fastest, instead of taking its heuristics'
// first choice. Off by default; EMBER_CUDNN_BENCHMARK=1 turns it on.
bool cudnn_benchmark();
void set_cudnn_benchmark(bool on);
bool cudnn_allow_tf32();
void set_cudnn_allow_tf32(bool allow);
bool matmul_allow_tf32();
void set_matmul_allow_tf32(bool allow);
// A linear layer's bias, its gradient, and GPT-2's tanh GELU after c_fc
// computed inside the GEMM on CUDA, by cuBLASLt's epilogues (as torch's
// addmm adds its bias): a pass over the output fewer each way per layer,
// and the bias added to the float32 sum before the one rounding. On by
// default; EMBER_CUBLASLT_EPILOGUE=0 runs the separate ops (the bias add,
// bias_gelu, the column sum), for comparison.
bool cublaslt_epilogues();
void set_cublaslt_epilogues(bool on);
// Channels-last float32 convolutions without TF32 (FMA math) computed in
// NCHW: the operands are transposed to NCHW, cuDNN runs its NCHW kernels and
// the results are transposed back, so the layers around stay channels-last.
// cuDNN's legacy API offers only slow NHWC FMA kernels; PyTorch's cuDNN
// engines make the same transposes. EMBER_CUDNN_FP32_CL_VIA_NCHW=0/1.
bool cudnn_fp32_channels_last_via_nchw();
void set_cudnn_fp32_channels_last_via_nchw(bool on);
// cuDNN's graph (backend) API for convolutions, as PyTorch calls cuDNN:
// each convolution is a one-node operation graph, cuDNN's engine heuristics
// (instant mode, then the fallback list) rank its engines, and the first
// that our numerics allow and that builds is kept per geometry (none that
// down-converts inputs; for float32 without TF32, none on tensor cores).
// The legacy API's algorithms map to a few engines only: on an H100 the
// float32 channels-last ResNet-50 step took 362 ms through them and 297 ms
// through the graph API (PyTorch: 290), every other configuration the same
// (bench/results/gpu_resnet50.json). On by default; where the graph API has
// no engine (or under benchmark mode, which times the legacy algorithms)
// the legacy API is used. EMBER_CUDNN_GRAPH=0/1.
bool cudnn_graph_api();
void set_cudnn_graph_api(bool on);
// Deterministic algorithms (PyTorch's torch.use_deterministic_algorithms
// with torch.backends.cudnn.deterministic): every CUDA kernel of a step
// gives the same bits on every run with the same inputs on the same GPU.
// Most of ours do anyway (reductions merge partials in a fixed order, the
// index adjoints sort); this switch changes the two places where the fast
// choice is not: the fused attention's backward computes dQ in a pass of
// its own instead of adding the key blocks' parts with atomics, and cuDNN
// convolutions take only algorithms and engines that cuDNN marks
// deterministic (its fastest weight-gradient kernels often add with
// atomics). Off by default (PyTorch's default); EMBER_DETERMINISTIC=1 turns
// it on. Choices are cached per mode, so switching takes effect at the next
// call.
bool deterministic_algorithms();
void set_deterministic_algorithms(bool on);

// ---- Errors found on the device, raised without a host synchronisation ----
// A kernel that finds bad input (an index out of range) cannot throw: it
// records the first such error in its device's slot and the op returns at
// once, as torch's device-side asserts do. The host raises it, naming the op
// and the bad value, at the next natural synchronisation: a device-to-host
// copy (item(), cpu(), to_vector()) or cuda_synchronize(). What the step
// computed after the bad op is garbage but never read: the error comes first.
// EMBER_SYNC_CHECKS=1 (or set_cuda_sync_checks(true)) raises it at the op
// itself, at the cost of a synchronisation per checked op (for debugging).
struct DeviceErrorSlot {
  int32_t op;    // 0: no error; else the code cuda_error_op_code gave the op
  int32_t kind;  // 0: index `value` out of bounds for dimension a with size b;
                 // 1: value out of the range [a, b)
  int64_t value, a, b;
};
// A stable code for an op's name (registered on first use), for kernels.
int32_t cuda_error_op_code(const char* op);
// The device's slot, in device memory, zeroed at creation.
DeviceErrorSlot* cuda_error_slot(int device);
bool cuda_sync_checks();
void set_cuda_sync_checks(bool on);
// Around a synchronisation of `stream` (its device's slot):
// snapshot() queues a copy of the slot into host memory before it, and
// raise_if_set() throws the recorded error (clearing the slot) after it.
void cuda_error_snapshot(Stream stream);
void cuda_error_raise_if_set(Stream stream);
// snapshot, synchronise `stream`, raise: the EMBER_SYNC_CHECKS path.
void cuda_error_check_now(Stream stream);

}  // namespace ember
