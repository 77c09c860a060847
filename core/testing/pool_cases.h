// The pooling geometries both pooling tests run (ops_nn_test: the CPU
// against naive loops and finite differences; ops_nn_cuda_test: CUDA
// against the CPU): square and non-square windows, strides other than the
// kernel, padding, and ceil mode, with a last window that would start in
// the padding.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace ember::testing {

struct PoolCase {
  std::vector<int64_t> x;
  std::array<int64_t, 2> k, s, p;
  bool ceil;
};

// The shared cases, then `more`.
inline std::vector<PoolCase> pool_cases(const std::vector<PoolCase>& more) {
  std::vector<PoolCase> cases = {
      {{2, 3, 8, 8}, {2, 2}, {2, 2}, {0, 0}, false},
      {{2, 2, 9, 7}, {3, 3}, {2, 2}, {1, 1}, false},
      {{1, 2, 6, 6}, {3, 3}, {2, 2}, {1, 1}, true},
      {{1, 2, 5, 5}, {3, 3}, {3, 3}, {1, 1}, true},
      {{2, 1, 7, 7}, {2, 2}, {2, 2}, {0, 0}, true},
      {{1, 3, 6, 5}, {3, 2}, {2, 1}, {1, 0}, false},
      // Wider than tall: a backward covering the columns by the window's height
      // misses some (a taller window only adds outputs that cannot be argmaxes).
      {{1, 2, 5, 8}, {2, 3}, {1, 2}, {0, 1}, false},
      // A window of more than 256 places: max pooling's indices in 4 bytes,
      // not one (pool_index_dtype).
      {{1, 2, 19, 18}, {17, 16}, {1, 2}, {0, 0}, false},
  };
  cases.insert(cases.end(), more.begin(), more.end());
  return cases;
}

}  // namespace ember::testing
