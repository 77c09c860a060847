// Helpers shared by the store implementations (tcp_store.cc, file_store.cc,
// store.cc): deadlines that cannot overflow and key quoting for error
// messages. Not part of the public interface.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "distributed/store/store.h"

namespace ember::distributed::detail {

using Clock = std::chrono::steady_clock;

// Callers pass Millis::max() to mean "forever"; adding that to now() would
// overflow, so cap the wait at a year, which no job outlives.
inline Clock::time_point deadline_after(Millis timeout) {
  constexpr Millis kCap{365LL * 24 * 3600 * 1000};
  if (timeout < Millis{0}) timeout = Millis{0};
  return Clock::now() + (timeout > kCap ? kCap : timeout);
}

inline Millis remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
  return left < Millis{0} ? Millis{0} : left;
}

// Keys are arbitrary bytes; messages show them quoted with non-printable
// bytes escaped so a binary key cannot garble a log line.
inline std::string quote_key(const std::string& key) {
  std::string out = "\"";
  for (unsigned char c : key) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out + "\"";
}

inline std::string quote_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", " : "") + quote_key(keys[i]);
  return out;
}

}  // namespace ember::distributed::detail
