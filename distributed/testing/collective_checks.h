// Checks of every collective's values, shared by the process groups'
// multi-process tests (Gloo on CPU tensors, NCCL on each rank's device):
// rank r contributes val(r, i), so any rank knows what every other rank
// sent, and a check that fails throws (WCHECK) naming the op, dtype and
// element.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/tensor.h"
#include "distributed/comm/process_group.h"

namespace ember::distributed::testing {

using Fn = std::function<double(int64_t)>;

// Small integers: exact in every dtype (uint8, float16 and bfloat16
// included), even summed over 4 ranks.
inline double val(int r, int64_t i) { return static_cast<double>(i % 7 + r + 1); }
inline double pval(int r, int64_t i) { return static_cast<double>((i + r) % 3 + 1); }  // products stay <= 81
inline double a2a(int from, int to, int64_t i) { return static_cast<double>(from * 5 + to + i % 3); }

// A tensor of f(0), f(1), ... in row-major order.
Tensor make(const Shape& shape, DType dt, const Fn& f, Device device = Device());
// The tolerance of a value of `dt` (0 for integers).
double tol(DType dt);
// Row-major values of `t` against f(i), within tol(t's dtype).
void expect_values(const Tensor& t, const Fn& f, const std::string& what);

// Every collective (allreduce with each op, broadcast and reduce from each
// root, allgather, allgather_into_tensor, reduce_scatter_tensor and its
// consuming variant, all_to_all_single, barrier) on n elements of `dt`, on
// the group's device.
void check_collectives(ProcessGroup& pg, DType dt, int64_t n);

}  // namespace ember::distributed::testing
