// Autocast (torch.autocast): inside an AutocastGuard for a device type, the
// ops that gain from low precision run in bfloat16 or float16 and the ops
// that lose accuracy in it run in float32, so the same model code trains in
// mixed precision:
//
//   {
//     AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
//     loss = cross_entropy(model(x), y);   // linear/conv in bf16, the loss in fp32
//   }
//   loss.backward();                               // gradients in each parameter's dtype
//
// PyTorch's policy:
//   low precision: matmul, mm, bmm, linear, conv2d;
//   float32: softmax, log_softmax, exp, log, pow, sum, mean, layer_norm and
//     the losses (cross_entropy, nll_loss, mse_loss);
//   several inputs: promoted to the widest (the binary ops' type promotion);
//   batch_norm keeps its input's dtype and computes statistics and running
//     statistics in float32.
// Only floating tensors on the guard's device type are cast. The casts are
// autograd ops, so gradients arrive in each parameter's dtype (float32
// master weights). Casts of the same leaf tensor that requires grad (a
// parameter) are cached until the outermost guard of the thread ends, so a
// weight used twice is cast once. Backward runs with autocast off, whatever
// the scope it is called from (as torch's engine does). Guards nest and are
// thread-local; enabled=false turns autocast off inside an enabled scope.
#pragma once

#include <cstdint>
#include <memory>

#include "core/device.h"
#include "core/dtype.h"

namespace ember {

class Tensor;

class AutocastGuard {
 public:
  // dtype must be BFloat16 or Float16.
  AutocastGuard(DeviceType device_type, DType dtype = DType::BFloat16, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  DeviceType type_;
  bool prev_enabled_;
  DType prev_dtype_;
};

bool autocast_enabled(DeviceType device_type);
DType autocast_dtype(DeviceType device_type);

namespace autocast {
// The op layer's side of the policy: the input for a low-precision op (cast
// to the autocast dtype of its device), and for a float32 op (a 16-bit
// floating input cast to float32). Anything else passes through unchanged.
Tensor low(const Tensor& t);
Tensor fp32(const Tensor& t);
// Casts held by the cache of this thread (tests).
int64_t cached_casts();

// The autocast state of this thread (both device types), to run a region
// again later under the state it first ran under (activation checkpointing).
struct State {
  bool enabled[2];
  DType dtype[2];
};
State current_state();

// Runs a scope under `state` with a cast cache of its own, then restores
// the thread's state and cache: a checkpointed region casts its parameters
// itself in its forward and again in its recompute, so both record the
// same ops and lead to the same leaves.
class RegionScope {
 public:
  explicit RegionScope(const State& state);
  ~RegionScope();
  RegionScope(const RegionScope&) = delete;
  RegionScope& operator=(const RegionScope&) = delete;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

// Turns autocast off for every device type within a scope (backward).
class DisabledScope {
 public:
  DisabledScope();
  ~DisabledScope();
  DisabledScope(const DisabledScope&) = delete;
  DisabledScope& operator=(const DisabledScope&) = delete;

 private:
  bool prev_[2];
};
}  // namespace autocast

}  // namespace ember
