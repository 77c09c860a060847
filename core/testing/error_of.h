// The message of the ember::Error a callable throws, or "" when it throws
// none: what tests match error messages against (one helper for every
// test instead of a copy in each).
#pragma once

#include <functional>
#include <string>

#include "core/exception.h"

namespace ember::testing {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace ember::testing
