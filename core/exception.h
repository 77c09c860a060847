// Error handling, PyTorch-style: EMBER_CHECK for user errors (bad shapes,
// dtypes, devices), EMBER_INTERNAL_ASSERT for invariants of our own code.
// Both throw ember::Error; the message is built only when the check fails.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ember {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
inline void stream_arg(std::ostringstream& os, const std::vector<int64_t>& v) {
  os << '[';
  for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  os << ']';
}
template <typename T>
void stream_arg(std::ostringstream& os, const T& v) {
  os << v;
}
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (stream_arg(os, args), ...);
  return os.str();
}
}  // namespace detail

}  // namespace ember

#define EMBER_CHECK(cond, ...)                                              \
  do {                                                                      \
    if (!(cond)) [[unlikely]] {                                             \
      throw ::ember::Error(::ember::detail::str_cat(__VA_ARGS__));          \
    }                                                                       \
  } while (0)

#define EMBER_INTERNAL_ASSERT(cond, ...)                                    \
  do {                                                                      \
    if (!(cond)) [[unlikely]] {                                             \
      throw ::ember::Error(::ember::detail::str_cat(                        \
          "internal assert failed: ", #cond, " at ", __FILE__, ":", __LINE__, \
          ". This is a bug in ember. " __VA_OPT__(, ) __VA_ARGS__));        \
    }                                                                       \
  } while (0)
