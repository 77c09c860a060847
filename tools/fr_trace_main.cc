// //tools:fr_trace: the verdict on a hung or failed job from its ranks'
// flight recorder dumps (distributed/comm/fr_trace.h; the dump format is in
// docs/reliability.md).
//
//   bazel run //tools:fr_trace -- ember_fr/            # the dumps' directory
//
// Prints, per process group, the first collective the ranks disagree on (or
// that some never joined), unmatched point-to-point transfers, each rank's
// last completed sequence id and the ranks without a dump. Exit status: 0
// the dumps agree, 1 a mismatch or missing rank was found, 2 no dump could
// be read (or bad arguments).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "distributed/comm/fr_trace.h"

int main(int argc, char** argv) {
  std::string dir;
  long long since = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("usage: fr_trace DIR [--since-ns NS]\n  DIR: the job's EMBER_FR_DUMP_DIR\n");
      return 0;
    }
    if (a == "--since-ns" && i + 1 < argc) {
      char* end = nullptr;
      since = std::strtoll(argv[++i], &end, 10);
      if (!end || *end) {
        std::fprintf(stderr, "fr_trace: --since-ns %s is not a number of nanoseconds\n", argv[i]);
        return 2;
      }
      continue;
    }
    if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "fr_trace: unknown flag %s (usage: fr_trace DIR [--since-ns NS])\n", a.c_str());
      return 2;
    }
    if (!dir.empty()) {
      std::fprintf(stderr, "fr_trace: one directory please (got %s and %s)\n", dir.c_str(), a.c_str());
      return 2;
    }
    dir = a;
  }
  if (dir.empty()) {
    std::fprintf(stderr, "usage: fr_trace DIR [--since-ns NS]\n");
    return 2;
  }
  const auto report = ember::distributed::fr::analyze_dumps(dir, since);
  for (const std::string& line : report.lines) std::printf("%s\n", line.c_str());
  return report.status;
}
