// What the launcher says about a failed job beyond "rank R exited": which
// worker is frozen (stopped by SIGSTOP or a debugger: the survivors then
// time out and are the first to fail, so the first failure names the wrong
// rank), where its workers' flight recorders dump, whether the dumps asked
// for at teardown have come, and fr_trace's verdict on them.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>

#include "distributed/comm/fr_trace.h"
#include "distributed/launch/launch_internal.h"

namespace ember::distributed::launch_detail {

bool is_stopped(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(f, stat)) return false;
  // "pid (comm) S ...": the state follows the last ')' (comm may hold any).
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  const char state = stat[close + 2];
  return state == 'T' || state == 't';
}

bool catches_signal(int pid, int sig) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("SigCgt:", 0) == 0) {
      const unsigned long long mask = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (mask >> (sig - 1)) & 1ULL;
    }
  return false;
}

int64_t system_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string default_fr_dir() {
  char stamp[32];
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
  std::error_code ec;
  const std::filesystem::path cwd = std::filesystem::current_path(ec);
  return ((ec ? std::filesystem::path(".") : cwd) / "ember_fr" / (std::string(stamp) + "-" + std::to_string(getpid())))
      .string();
}

bool dumped_since(const std::string& dir, int rank, int64_t since_ns) {
  struct stat st {};
  const std::string path = (std::filesystem::path(dir) / ("ember_fr_rank" + std::to_string(rank) + ".json")).string();
  if (::stat(path.c_str(), &st) != 0) return false;
  const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  // File times come from the kernel's coarse clock (up to a tick behind
  // the fine one since_ns was read from).
  return mtime >= since_ns - 100'000'000;
}

void report_dumps(const std::string& dir, int64_t since_ns, const std::vector<int>& here) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return;  // nothing recorded (a failure outside any collective)
  const fr::TraceReport r = fr::analyze_dumps(dir, since_ns, here);
  if (r.status == 2) return;
  say("flight recorder dumps in " + dir + " (//tools:fr_trace " + dir + " prints this again):");
  for (const std::string& line : r.lines) say(line.rfind("fr_trace: ", 0) == 0 ? line : "fr_trace: " + line);
}

}  // namespace ember::distributed::launch_detail
