// Bit-for-bit tensor comparison for GoogleTest tests: defined, the same
// shape, every element equal (as doubles), the first difference named.
// What "the same gradients bit for bit" checks (checkpointing, split
// backward) share.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/tensor.h"

namespace ember::testing {

inline void expect_bitwise(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_TRUE(a.defined()) << what;
  ASSERT_TRUE(b.defined()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const std::vector<double> va = a.to_vector(), vb = b.to_vector();
  for (size_t i = 0; i < va.size(); ++i) ASSERT_EQ(va[i], vb[i]) << what << " element " << i;
}

}  // namespace ember::testing
