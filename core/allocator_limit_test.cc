// EMBER_CPU_MEMORY_LIMIT_MB: the CPU allocator as a device of fixed
// capacity. The BUILD file runs this test with the limit set to 64 MiB (the
// allocator reads it once, at its first use), and once more with a bad value.
#include <gtest/gtest.h>

#include <string>

#include "core/allocator.h"
#include "core/ops.h"
#include "core/tensor.h"
#include "core/testing/error_of.h"

namespace ember {
namespace {

using ::ember::testing::error_of;

constexpr int64_t kMiB = 1 << 20;

Tensor floats_mib(int64_t mib, double value) { return full({mib * kMiB / 4}, value, {DType::Float32, kCPU}); }

bool all_equal(const Tensor& t, double value) {
  for (double v : t.to_vector())
    if (v != value) return false;
  return true;
}

TEST(AllocatorLimit, FailsWithANamedErrorAndKeepsWhatWasWritten) {
  Allocator* a = cpu_allocator();
  a->empty_cache();
  Tensor held = floats_mib(40, 3.0);
  const AllocatorStats before = a->stats();
  std::string err;
  {
    MemoryKindScope acts(MemoryKind::Activations);
    err = error_of([&] { Tensor more = floats_mib(30, 1.0); });
  }
  EXPECT_NE(err.find("CPU out of memory: allocating 30 MiB (activations)"), std::string::npos) << err;
  EXPECT_NE(err.find("would pass EMBER_CPU_MEMORY_LIMIT_MB=64"), std::string::npos) << err;
  EXPECT_NE(err.find("the largest part now: other 40 MiB"), std::string::npos) << err;
  // Nothing changed: the failed request left no trace, the held tensor its values.
  const AllocatorStats after = a->stats();
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_EQ(after.requested, before.requested);
  EXPECT_EQ(after.num_allocs, before.num_allocs);
  EXPECT_TRUE(all_equal(held, 3.0));
  // What fits still allocates.
  Tensor fits = floats_mib(20, 2.0);
  EXPECT_TRUE(all_equal(fits, 2.0));
}

TEST(AllocatorLimit, EmptiesItsCacheBeforeGivingUp) {
  Allocator* a = cpu_allocator();
  a->empty_cache();
  { Tensor freed = floats_mib(40, 1.0); }  // cached on free: 40 MiB still reserved
  EXPECT_GE(a->stats().reserved, size_t{40} * kMiB);
  // 90 MiB held if the cache stayed; it is returned first, so 50 MiB fits.
  Tensor t = floats_mib(50, 1.0);
  EXPECT_LE(a->stats().reserved, size_t{64} * kMiB);
  // The limit counts what is held, not only what is live: two 30 MiB tensors fit, a third does not.
  t = Tensor();
  a->empty_cache();
  Tensor x = floats_mib(30, 1.0), y = floats_mib(30, 1.0);
  EXPECT_NE(error_of([&] { floats_mib(30, 1.0); }).find("CPU out of memory"), std::string::npos);
}

TEST(AllocatorLimitBadValue, NamesTheVariable) {
  EXPECT_EQ(error_of([] { cpu_allocator(); }),
            "EMBER_CPU_MEMORY_LIMIT_MB=lots is not a size in MiB (a non-negative integer; 0 or unset: no limit)");
}

}  // namespace
}  // namespace ember
