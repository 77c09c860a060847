// The smallest runnable example: tensors, views, broadcasting, matmul and a
// reduction on the CPU, and the same on the GPU when one is present.
#include <iostream>

#include "core/ops.h"

int main() {
  using namespace ember;
  manual_seed(0);
  Tensor x = arange(6).view({2, 3});
  std::cout << "x = " << x << "\n";
  std::cout << "x^T (a view, strides " << shape_str(x.t().strides()) << ") = " << x.t() << "\n";
  Tensor y = matmul(x, x.t()) + 1.0;
  std::cout << "x @ x^T + 1 = " << y << "\n";
  std::cout << "softmax(x, 1) = " << softmax(x, 1) << "\n";
  std::cout << "sum over dim 0 = " << sum(x, {0}) << "\n";
  if (cuda_is_available()) {
    Tensor g = x.cuda();
    std::cout << "on cuda: " << matmul(g, g.t()) << "\n";
  } else {
    std::cout << "CUDA not available (" << cuda_unavailable_reason() << "); ran on CPU only.\n";
  }
  return 0;
}
