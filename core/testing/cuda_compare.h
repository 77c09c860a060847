// Comparing an op on CUDA with the CPU kernels (the CPU backend is the
// reference): the inputs moved to each device, forward and backward of a
// fixed random projection of the output, every result within a tolerance
// of the dtype. The cross-backend tests' one copy of these helpers.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/ops.h"

namespace ember::testing::cuda_compare {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

inline const std::vector<DType> kTypes = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
// Tolerances: docs/design.md, Note [numerics] (float32 convolutions 1e-6 to
// 2e-6 of the scale; TF32 3e-4, which 1e-4 fails).
inline double tol(DType t) {
  return t == DType::Float16 ? 1e-2 : t == DType::BFloat16 ? 3e-2 : t == DType::Float32 ? 1e-4 : 1e-9;
}

template <typename... Args>
std::string cat(const Args&... args) {
  return detail::str_cat(args...);
}

inline Tensor rnd(const Shape& s, uint64_t seed, DType dt, double scale = 1.0) {
  Generator g(seed);
  return (randn(s, {DType::Float64}, &g) * scale).to(dt);
}

inline void expect_same(const Tensor& cpu, const Tensor& gpu, double t, const std::string& what) {
  ASSERT_EQ(cpu.defined(), gpu.defined()) << what;
  if (!cpu.defined()) return;
  ASSERT_TRUE(gpu.is_cuda()) << what;
  ASSERT_EQ(cpu.sizes(), gpu.sizes()) << what;
  ASSERT_EQ(cpu.dtype(), gpu.dtype()) << what;
  EXPECT_TRUE(allclose(gpu.cpu(), cpu, t, t)) << what << "\ncpu: " << cpu << "\ncuda: " << gpu.cpu();
}

// The same shape, dtype and bytes (run to run reproducibility).
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.cpu().contiguous(), y = b.cpu().contiguous();
  return std::memcmp(x.raw_data(), y.raw_data(), static_cast<size_t>(x.numel()) * x.element_size()) == 0;
}

struct Outcome {
  Tensor y;
  std::vector<Tensor> grads;
};

// f on copies of `inputs` moved to the device (defined floating ones are
// leaves requiring grad; `layout` may restride them), then backward of
// sum(y * r) for a fixed random r.
inline Outcome run(const Fn& f, const std::vector<Tensor>& inputs, bool cuda,
                   const std::function<Tensor(Tensor)>& layout = {}) {
  std::vector<Tensor> in;
  for (const Tensor& t : inputs) {
    if (!t.defined()) {
      in.push_back(t);
      continue;
    }
    Tensor d = cuda ? t.cuda() : t.clone();
    if (layout && d.dim() == 4) d = layout(d);
    in.push_back(d.detach().requires_grad_());
  }
  Outcome r;
  r.y = f(in);
  Tensor proj = rnd(r.y.sizes(), 77, r.y.dtype());
  sum(r.y * (cuda ? proj.cuda() : proj)).backward();
  for (const Tensor& t : in) r.grads.push_back(t.defined() ? t.grad() : Tensor());
  return r;
}

inline void compare(const Fn& f, const std::vector<Tensor>& inputs, double t, const std::string& what,
                    const std::function<Tensor(Tensor)>& cuda_layout = {}) {
  Outcome c = run(f, inputs, false), g = run(f, inputs, true, cuda_layout);
  expect_same(c.y, g.y, t, cat(what, " forward"));
  for (size_t i = 0; i < c.grads.size(); ++i) expect_same(c.grads[i], g.grads[i], t, cat(what, " grad ", i));
}

}  // namespace ember::testing::cuda_compare
