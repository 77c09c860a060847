// The worker program launch_test runs under launch(): one mode per behaviour
// the launcher must handle (see the usage below). Files it writes go to a
// directory the test names, written under a temporary name and renamed, so
// the test never reads half a file.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "distributed/launch/launch.h"
#include "distributed/logging/logging.h"

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "<unset>";
}

void write_file(const std::string& path, const std::string& text) {
  {
    std::ofstream f(path + ".tmp");
    f << text;
  }
  std::rename((path + ".tmp").c_str(), path.c_str());
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// Long enough that only being killed ends it within a test's lifetime.
[[noreturn]] void sleep_forever() {
  for (;;) ::sleep(60);
}

int usage() {
  std::fprintf(stderr,
               "usage: launch_test_worker env DIR | print | log | sleep DIR | spawn N\n"
               "       | fail FAILING_RANK CODE|sigN DIR [stubborn] | restart FAILING_RANK UNTIL DIR\n"
               "       | elastic DIR STEPS | listen DIR\n");
  return 64;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string mode = argv[1];

  if (mode == "spawn" && argc >= 3) {
    // A program that launches itself: the pattern of launch.h's example.
    if (int rc = ember::distributed::spawn_local_workers(std::atoi(argv[2]), argc, argv); rc >= 0) return rc;
    std::printf("worker %d of %d\n", env_int("RANK"), env_int("WORLD_SIZE"));
    return 0;
  }

  const int rank = env_int("RANK");
  if (mode == "env" && argc >= 3) {
    std::string text;
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                             "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "EMBER_STORE_TOKEN"})
      text += std::string(name) + "=" + env_str(name) + "\n";
    write_file(std::string(argv[2]) + "/env." + std::to_string(rank), text);
    return 0;
  }
  if (mode == "listen" && argc >= 3) {
    // Rank 0 binds MASTER_PORT on 127.0.0.1 as a plain socket, then as the
    // store's listener does (SO_REUSEADDR), and writes DIR/listen with each
    // outcome: "plain=<errno text or ok> store=<errno text or ok>".
    auto try_bind = [](bool reuse) -> std::string {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return std::strerror(errno);
      int one = 1;
      if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(env_int("MASTER_PORT")));
      const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd, 4) == 0;
      const std::string out = ok ? "ok" : std::strerror(errno);
      ::close(fd);
      return out;
    };
    if (rank == 0) {
      const std::string plain = try_bind(false), store = try_bind(true);
      write_file(std::string(argv[2]) + "/listen", "plain=" + plain + " store=" + store);
    }
    return 0;
  }
  if (mode == "print") {
    std::cout << "out line 1 of rank " << rank << "\n" << std::flush;
    std::cerr << "err of rank " << rank << "\n" << std::flush;
    std::cout << "out line 2 of rank " << rank << "\n";
    std::cout << "partial " << rank << std::flush;  // no newline: the launcher ends the line
    return 0;
  }
  if (mode == "log") {
    LOG0("only rank 0 says this");
    LOG_ALL("every rank says this");
    return 0;
  }
  if (mode == "sleep" && argc >= 3) {
    write_file(std::string(argv[2]) + "/pid." + std::to_string(rank), std::to_string(::getpid()));
    sleep_forever();
  }
  if (mode == "restart" && argc >= 5) {
    // FAILING_RANK exits 3 in every start before UNTIL (EMBER_RESTART_COUNT);
    // the others wait to be stopped. From start UNTIL on every rank writes
    // DIR/restart.<rank> (its restart count) and succeeds.
    const int failing = std::atoi(argv[2]), until = std::atoi(argv[3]);
    const std::string dir = argv[4];
    const int restart = env_int("EMBER_RESTART_COUNT");
    if (restart < until) {
      if (rank != failing) sleep_forever();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others are up
      std::fprintf(stderr, "rank %d failing in start %d\n", rank, restart);
      return 3;
    }
    write_file(dir + "/restart." + std::to_string(rank),
               std::to_string(restart) + " " + env_str("TORCHELASTIC_RESTART_COUNT"));
    return 0;
  }
  if (mode == "elastic" && argc >= 4) {
    // A job under the elastic agents, without a process group: STEPS steps
    // of 100 ms from the step DIR/ckpt names (rank 0 writes it after each
    // step, as a checkpoint), each step appended to DIR/steps as
    // "round world step". The last step writes DIR/done. It never notices a
    // lost peer by itself: only its agent stops it.
    const std::string dir = argv[2];
    const int steps = std::atoi(argv[3]), world = env_int("WORLD_SIZE");
    const int round = env_int("EMBER_RESTART_COUNT");
    write_file(dir + "/pid." + std::to_string(rank), std::to_string(::getpid()));
    int step = 0;
    if (std::ifstream f(dir + "/ckpt"); f) f >> step;
    for (; step < steps; ++step) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (rank == 0) {
        std::ofstream(dir + "/steps", std::ios::app) << round << " " << world << " " << step << "\n";
        write_file(dir + "/ckpt", std::to_string(step + 1));
      }
    }
    if (rank == 0) write_file(dir + "/done", "round " + std::to_string(round) + " world " + std::to_string(world));
    return 0;
  }
  if (mode == "fail" && argc >= 5) {
    const int failing = std::atoi(argv[2]);
    const std::string code = argv[3], dir = argv[4];
    const bool stubborn = argc >= 6 && std::string(argv[5]) == "stubborn";
    if (rank != failing) {
      if (stubborn) ::signal(SIGTERM, SIG_IGN);  // inherited by the child too
      // A grandchild of the launcher: it must go down with its worker.
      pid_t child = ::fork();
      if (child == 0) sleep_forever();
      write_file(dir + "/child." + std::to_string(rank), std::to_string(child));
      write_file(dir + "/pid." + std::to_string(rank), std::to_string(::getpid()));
      sleep_forever();
    }
    write_file(dir + "/pid." + std::to_string(rank), std::to_string(::getpid()));
    // Fail only once every other worker is up, so the test knows whom to check.
    const int world = env_int("WORLD_SIZE");
    auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (int r = 0; r < world; ++r)
      while (!exists(dir + "/pid." + std::to_string(r)) && std::chrono::steady_clock::now() < give_up)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::fprintf(stderr, "rank %d failing with %s\n", rank, code.c_str());
    if (code.rfind("sig", 0) == 0) {
      ::signal(std::atoi(code.c_str() + 3), SIG_DFL);
      ::raise(std::atoi(code.c_str() + 3));
    }
    return std::atoi(code.c_str());
  }
  return usage();
}
