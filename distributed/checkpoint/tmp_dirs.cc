// The temporary directories of checkpoint saves (<dir>.tmp-<pid>): who owns
// one, and removing those whose owner is provably dead. A save killed
// mid-write (SIGKILL, a lost host, a live recovery) leaves its directory
// behind; nothing else would ever remove it. The owner is recorded in the
// directory (.owner: host, boot id, pid namespace, pid, the process's start
// time) and the file is dropped before the commit, so a checkpoint never
// carries it. A leftover is removed only when its owner ran on this host
// since its last boot, in this pid namespace, and that process is gone (no
// such pid, or a pid reused by a process started at another time): one of
// another host or container, or without the file, stays.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "distributed/checkpoint/checkpoint_internal.h"

namespace ember::distributed::checkpoint_internal {
namespace fs = std::filesystem;

namespace {

constexpr const char* kOwnerFile = ".owner";

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

// Field 22 of /proc/<pid>/stat: the process's start time (clock ticks since
// boot), which tells a reused pid from the original. Empty if there is none.
std::string start_time(const std::string& pid) {
  const std::string stat = read_first_line("/proc/" + pid + "/stat");
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return "";
  std::istringstream in(stat.substr(paren + 2));
  std::string field;
  for (int i = 3; i <= 22 && in >> field; ++i) {
  }
  return field;
}

// This process's pid namespace ("pid:[4026531836]"): a pid means nothing
// outside it (containers on one host share its name and boot id).
std::string pid_namespace() {
  std::error_code ec;
  const fs::path ns = fs::read_symlink("/proc/self/ns/pid", ec);
  return ec ? std::string("unknown") : ns.string();
}

std::string identity(const std::string& pid) {
  return host_name() + " " + read_first_line("/proc/sys/kernel/random/boot_id") + " " + pid_namespace() + " " + pid +
         " " + start_time(pid);
}

}  // namespace

void claim_tmp_dir(const std::string& tmp) {
  std::ofstream(tmp + "/" + kOwnerFile) << identity(std::to_string(::getpid())) << "\n";
}

void unclaim_tmp_dir(const std::string& tmp) {
  std::error_code ec;
  fs::remove(tmp + "/" + kOwnerFile, ec);
}

std::vector<std::string> remove_dead_tmp_dirs(const std::string& dir) {
  std::vector<std::string> removed;
  const fs::path parent = fs::path(dir).parent_path().empty() ? fs::path(".") : fs::path(dir).parent_path();
  const std::string me = std::to_string(::getpid());
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    const size_t at = name.rfind(".tmp-");
    if (at == std::string::npos || !e.is_directory(ec)) continue;
    const std::string pid = name.substr(at + 5);
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos || pid == me) continue;
    std::istringstream owner(read_first_line(e.path().string() + "/" + kOwnerFile));
    std::string host, boot, ns, owner_pid, started;
    if (!(owner >> host >> boot >> ns >> owner_pid >> started) || owner_pid != pid) continue;  // cannot prove it
    if (host != host_name() || boot != read_first_line("/proc/sys/kernel/random/boot_id") || ns != pid_namespace() ||
        ns == "unknown")
      continue;
    if (start_time(pid) == started) continue;  // its process still runs (a save in progress)
    fs::remove_all(e.path(), ec);
    if (!ec) removed.push_back(e.path().string());
  }
  return removed;
}

}  // namespace ember::distributed::checkpoint_internal
