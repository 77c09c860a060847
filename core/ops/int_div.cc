// The limit below which kernels take IntDiv<int32_t> (int_div.h): one
// switch for every kernel with a 32- and a 64-bit index path, so a test
// runs the 64-bit paths on tensors small enough to check.
#include "core/ops/int_div.h"

#include <atomic>

namespace ember {

namespace {
std::atomic<int64_t> limit{INT64_MAX};
}  // namespace

bool use_int_div32(int64_t extent) { return fits_int_div32(extent) && extent < limit.load(std::memory_order_relaxed); }
void set_int_div32_limit(int64_t extent) { limit.store(extent, std::memory_order_relaxed); }

}  // namespace ember
