// The convolution geometries both conv2d tests run (ops_nn_test: the CPU
// against naive loops and finite differences; ops_nn_cuda_test: CUDA
// against the CPU), as pool_cases.h does for pooling: the shared cases
// here, each test's own after them.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace ember::testing {

struct ConvCase {
  std::vector<int64_t> x, w;
  std::array<int64_t, 2> stride, pad, dil;
  int64_t groups;
  bool bias;
};

// The shared cases, then `more`.
inline std::vector<ConvCase> conv_cases(const std::vector<ConvCase>& more) {
  std::vector<ConvCase> cases = {
      {{2, 3, 7, 6}, {4, 3, 3, 3}, {1, 1}, {0, 0}, {1, 1}, 1, true},   // plain 3x3
      {{1, 2, 9, 9}, {3, 2, 3, 3}, {1, 1}, {2, 2}, {2, 2}, 1, false},  // dilation 2
      {{2, 4, 6, 7}, {6, 2, 3, 2}, {1, 1}, {1, 0}, {1, 1}, 2, false},  // groups 2, non-square kernel
      {{1, 2, 10, 9}, {3, 2, 4, 3}, {3, 2}, {0, 1}, {1, 2}, 1, true},  // asymmetric, stride not dividing
  };
  cases.insert(cases.end(), more.begin(), more.end());
  return cases;
}

}  // namespace ember::testing
