// Checks an op's analytical gradient against central finite differences in
// float64: for a random projection v of the output, compares
// d(sum(f(x) * v))/dx from backward with (F(x + eps) - F(x - eps)) / 2eps
// element by element.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ember::autograd {

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;
  std::string message;  // names the first input and element that disagree
};

// `inputs` must be contiguous float64 CPU tensors; those that require grad
// are checked. `f` may apply views, broadcasting, reductions, ...
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, double eps = 1e-6, double atol = 1e-6,
                          double rtol = 1e-4);

}  // namespace ember::autograd
