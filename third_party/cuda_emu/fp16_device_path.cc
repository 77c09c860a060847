// core/dtype.h compiled as the device sees it (__CUDA_ARCH__ defined, CUDA's
// conversion intrinsics from cuda_fp16_emu.h), wrapped in namespace `device`
// so it does not collide with the host branch every other TU uses. Exposes the
// conversions for fp16_device_path_test.cc.
#include <cstdint>
#include <cstring>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/exception.h"
#include "third_party/cuda_emu/cuda_fp16_emu.h"

#define __CUDA_ARCH__ 900
namespace device {
#include "core/dtype.h"
}  // namespace device

namespace device::ember {
uint16_t half_from_float(float f) { return Half::from_float(f); }
float half_to_float(uint16_t h) { return Half::to_float(h); }
uint16_t bfloat16_from_float(float f) { return BFloat16::from_float(f); }
float bfloat16_to_float(uint16_t b) { return BFloat16::to_float(b); }
}  // namespace device::ember
