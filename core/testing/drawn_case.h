// One drawn case of a kernel test, run three ways and compared: the CPU in
// float64 with contiguous inputs (the reference), the CPU in the case's dtype
// and the CUDA backend in it (on a GPU, or under the emulation; skipped
// without either), each with its own drawn layout per input. Forward, and
// the gradients of sum(y * r) for a drawn r. The CPU must be within
// `tol_ref` of float64 and CUDA within `tol_cuda` of the CPU (relative to
// each tensor's scale: expect_close in draw.h); an input that is an error
// on one is the same kind of error on all three.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/testing/draw.h"

namespace ember::testing {

using CaseFn = std::function<Tensor(const std::vector<Tensor>&)>;

// The float dtypes a case draws from.
inline const std::vector<DType> kFloatDtypes = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};

// A case's tolerance relative to a tensor's scale (docs/design.md, Note
// [numerics]): a 16-bit result is one rounding of a float32 computation, so
// within a few units in the last place at the scale (2^-11 for float16,
// 2^-8 for bfloat16); float32 gets its family's measured figure with
// headroom, `f32`; float64 against itself, rounding only.
inline double tol_for(DType dt, double f32) {
  return dt == DType::Float64 ? 1e-11 : dt == DType::Float32 ? f32 : dt == DType::Float16 ? 4e-3 : 3e-2;
}

struct CaseInput {
  Tensor value;        // on the CPU, contiguous, in the case's dtype (or an integer dtype)
  bool grad = false;   // a leaf whose gradient is compared
  bool layout = true;  // may be drawn into another layout
};

struct CaseRun {
  Tensor y;
  std::vector<Tensor> grads;
  std::string error;  // the ember::Error the case threw, if any
  std::string layouts;
};

// f on `inputs` in `dt` (Float64 for the reference; `case_dt` otherwise)
// on the CPU or the CUDA device; `d` draws each input's layout
// (null: contiguous); `proj_seed` draws r.
inline CaseRun run_case(const CaseFn& f, const std::vector<CaseInput>& inputs, DType case_dt, DType dt, bool cuda,
                        Draw* d, uint64_t proj_seed, bool backward) {
  CaseRun r;
  std::vector<Tensor> in;
  for (const CaseInput& c : inputs) {
    if (!c.value.defined()) {
      in.push_back(c.value);
      continue;
    }
    // Inputs in the case's dtype take `dt`; other floating ones (float32
    // statistics beside 16-bit activations) keep theirs, except in the
    // float64 reference.
    const DType own = c.value.dtype();
    Tensor t = is_floating(own) && (own == case_dt || dt == DType::Float64) ? c.value.to(dt) : c.value;
    if (cuda) t = t.cuda();
    if (d && c.layout) {
      std::string how;
      t = d->layout(t, &how);
      r.layouts += (r.layouts.empty() ? "" : ", ") + how;
    }
    if (c.grad) t = t.detach().requires_grad_();
    in.push_back(t);
  }
  try {
    r.y = f(in);
    if (backward && r.y.requires_grad() && r.y.numel() > 0) {
      Draw pd(proj_seed);
      Tensor proj = pd.values(r.y.sizes(), case_dt).to(r.y.dtype());
      sum(r.y * (cuda ? proj.cuda() : proj)).backward();
    }
  } catch (const Error& e) {
    r.error = e.what();
    return r;
  }
  for (size_t i = 0; i < in.size(); ++i) r.grads.push_back(inputs[i].grad ? in[i].grad() : Tensor());
  return r;
}

// t on the CPU in float64; rounded through `through` first when given (the
// float64 reference rounded to the dtype of the result it is compared with:
// a gradient beyond float16's range is inf in float16, as it should be).
inline Tensor as64(const Tensor& t, const Tensor& through = Tensor()) {
  if (!t.defined() || !is_floating(t.dtype())) return t.defined() ? t.cpu() : t;
  Tensor c = t.detach().cpu();
  if (through.defined() && is_floating(through.dtype())) c = c.to(through.dtype());
  return c.to(DType::Float64);
}

// The case's dtype is its first floating input's.
inline void check_case(const std::string& what, const CaseFn& f, const std::vector<CaseInput>& inputs, Draw& d,
                       double tol_ref, double tol_cuda, bool backward = true) {
  DType dt = DType::Float64;
  for (const CaseInput& c : inputs)
    if (c.value.defined() && is_floating(c.value.dtype())) {
      dt = c.value.dtype();
      break;
    }
  const uint64_t proj_seed = mix64(d.seed() ^ 0x70726f6aull);
  const CaseRun ref = run_case(f, inputs, dt, DType::Float64, false, nullptr, proj_seed, backward);
  const CaseRun cpu = run_case(f, inputs, dt, dt, false, &d, proj_seed, backward);
  std::vector<std::pair<std::string, const CaseRun*>> runs = {{"cpu", &cpu}};
  CaseRun gpu;
  if (cuda_is_available()) {
    gpu = run_case(f, inputs, dt, dt, true, &d, proj_seed, backward);
    runs.push_back({"cuda", &gpu});
  }
  for (const auto& [name, run] : runs) {
    const std::string w = detail::str_cat(what, " ", dtype_name(dt), ", ", name, " inputs ", run->layouts);
    if (!ref.error.empty() || !run->error.empty()) {
      EXPECT_EQ(ref.error.empty(), run->error.empty())
          << w << ": float64 reference says \"" << ref.error << "\", " << name << " says \"" << run->error << "\"";
      continue;
    }
    const bool vs_cpu = name == "cuda";
    const CaseRun& want = vs_cpu ? cpu : ref;
    const double tol = vs_cpu ? tol_cuda : tol_ref;
    const std::string against = vs_cpu ? " against the CPU" : " against float64";
    expect_close(as64(run->y), as64(want.y, run->y), tol, w + " forward" + against, !vs_cpu);
    for (size_t i = 0; i < run->grads.size(); ++i)
      expect_close(as64(run->grads[i]), as64(want.grads[i], run->grads[i]), tol,
                   detail::str_cat(w, " grad ", i, against), !vs_cpu);
  }
}

}  // namespace ember::testing
