// Rank-aware logging (see logging.h): rank and EMBER_LOG_RANKS resolution,
// and the one-write-per-message sink.
#include "distributed/logging/logging.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>

namespace ember::distributed {
namespace {

std::atomic<int> g_rank{-1};
std::atomic<std::FILE*> g_sink{nullptr};
std::mutex g_write_mutex;

// A non-negative decimal integer, or -1.
long parse_rank(const std::string& s) {
  if (s.empty() || s.size() > 9) return -1;
  long v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

int env_rank(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return -1;
  long r = parse_rank(v);
  EMBER_CHECK(r >= 0, "logging: ", name, "='", v, "' is not a non-negative integer");
  return static_cast<int>(r);
}

// Whether `rank` is in a validated comma-separated list.
bool in_list(int rank, const std::string& list) {
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    if (parse_rank(list.substr(start, end - start)) == rank) return true;
    start = end + 1;
  }
  return false;
}

// EMBER_LOG_RANKS, validated: empty for the default (unset or "0"), "all"
// (with *all set), or a list of ranks.
std::string rank_list(bool* all) {
  *all = false;
  const char* v = std::getenv("EMBER_LOG_RANKS");
  if (v == nullptr) return {};
  std::string s = v;
  if (s == "all") {
    *all = true;
    return s;
  }
  if (s == "0" || s.empty()) return {};
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    EMBER_CHECK(parse_rank(s.substr(start, end - start)) >= 0, "logging: EMBER_LOG_RANKS='", s,
                "' is not 'all', '0' or a comma-separated list of ranks such as '0,3'");
    start = end + 1;
  }
  return s;
}

void write_fully(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // a closed log destination must not take the program down
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

void set_log_rank(int rank) { g_rank.store(rank < 0 ? -1 : rank); }

int log_rank() {
  int r = g_rank.load();
  if (r >= 0) return r;
  r = env_rank("RANK");
  if (r >= 0) return r;
  r = env_rank("SLURM_PROCID");
  return r >= 0 ? r : 0;
}

void set_log_sink(std::FILE* sink) { g_sink.store(sink); }

namespace detail {

bool log_rank0_enabled() {
  bool all = false;
  std::string list = rank_list(&all);
  int rank = log_rank();
  if (list.empty()) return rank == 0;
  return all || in_list(rank, list);
}

bool log_rank0_tagged() {
  bool all = false;
  return !rank_list(&all).empty();
}

void log_write(const std::string& msg, bool tagged) {
  std::string out;
  if (tagged) {
    const std::string tag = "[rank " + std::to_string(log_rank()) + "] ";
    size_t start = 0;
    while (start < msg.size()) {
      size_t end = msg.find('\n', start);
      size_t stop = end == std::string::npos ? msg.size() : end + 1;
      out += tag;
      out.append(msg, start, stop - start);
      start = stop;
    }
    if (msg.empty()) out = tag;
  } else {
    out = msg;
  }
  if (out.empty() || out.back() != '\n') out += '\n';

  std::FILE* sink = g_sink.load();
  if (sink == nullptr) sink = stdout;
  std::lock_guard<std::mutex> lock(g_write_mutex);
  // Whatever the program printf'd before goes first; then the message as one
  // write(2), which is what keeps lines whole in a pipe shared by ranks.
  std::fflush(sink);
  int fd = ::fileno(sink);
  if (fd >= 0) {
    write_fully(fd, out.data(), out.size());
  } else {  // a stream without a descriptor (fmemopen, open_memstream)
    std::fwrite(out.data(), 1, out.size(), sink);
    std::fflush(sink);
  }
}

}  // namespace detail
}  // namespace ember::distributed
