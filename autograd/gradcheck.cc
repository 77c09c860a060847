// Finite-difference gradient checker (see gradcheck.h).
#include "autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "autograd/autograd.h"
#include "core/ops.h"

namespace ember::autograd {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, double eps, double atol, double rtol) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    EMBER_CHECK(x.dtype() == DType::Float64 && x.device().is_cpu() && x.is_contiguous(), "gradcheck: input ", i,
                " must be a contiguous float64 CPU tensor, got ", x.dtype(), " ", shape_str(x.sizes()));
  }
  Generator gen(1234);
  Tensor out = f(inputs);
  EMBER_CHECK(out.requires_grad(), "gradcheck: the output does not require grad");
  Tensor v = randn(out.sizes(), {DType::Float64}, &gen);
  for (const Tensor& x : inputs) zero_grad(x);
  sum(out * v).backward();

  auto projected = [&]() {
    NoGradGuard g;
    return sum(f(inputs) * v).item();
  };
  GradcheckResult r;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.requires_grad()) continue;
    Tensor analytic = x.grad().defined() ? x.grad() : zeros_like(x);
    std::vector<double> an = analytic.to_vector();
    double* p = static_cast<double*>(x.raw_data());
    for (int64_t j = 0; j < x.numel(); ++j) {
      const double orig = p[j];
      p[j] = orig + eps;
      const double fp = projected();
      p[j] = orig - eps;
      const double fm = projected();
      p[j] = orig;
      const double numeric = (fp - fm) / (2 * eps);
      const double err = std::fabs(numeric - an[j]);
      r.max_abs_error = std::max(r.max_abs_error, err);
      if (r.ok && err > atol + rtol * std::fabs(numeric)) {
        r.ok = false;
        std::ostringstream os;
        os << "input " << i << " " << shape_str(x.sizes()) << " element " << j << ": analytical " << an[j]
           << " vs numerical " << numeric;
        r.message = os.str();
      }
    }
  }
  return r;
}

}  // namespace ember::autograd
