// The harness's own checks: EMBER_EXPECT_RANKS passes when every rank
// exits 0 (or with its expected code) and fails otherwise, naming the rank;
// the workers' OpenMP threads; check_close's tolerance and message.
#include "distributed/testing/multiprocess.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>

namespace ember::distributed::testing {
namespace {

// arg: the rank that throws, or "exit=<rank>:<code>".
EMBER_WORKER(maybe_fails) {
  auto o = parse_arg(env.arg);
  WCHECK(env.world_size >= 1 && env.rank < env.world_size, "rank ", env.rank, " of ", env.world_size);
  if (o.count("throw") && std::stoi(o["throw"]) == env.rank) WCHECK(env.rank < 0, "rank ", env.rank, " fails");
  if (o.count("exit") && std::stoi(o["exit"]) == env.rank) std::_Exit(42);
}

TEST(MultiProcess, EveryRankSucceeding) {
  EMBER_EXPECT_RANKS("maybe_fails", 3);
  EMBER_ASSERT_RANKS("maybe_fails", 2, {.arg = ""});
}

TEST(MultiProcess, AFailingRankFailsTheTestNamingIt) {
  EXPECT_NONFATAL_FAILURE(
      EMBER_EXPECT_RANKS("maybe_fails", 3, {.arg = "throw=1"}),
      "scenario 'maybe_fails' on 3 ranks, arg 'throw=1':\n  rank 1: exit code 1, expected exit code 0");
  EXPECT_FATAL_FAILURE(EMBER_ASSERT_RANKS("maybe_fails", 2, {.arg = "throw=0"}),
                       "check failed: env.rank < 0: rank 0 fails");
  EXPECT_NONFATAL_FAILURE(EMBER_EXPECT_RANKS("maybe_fails", 2, {.arg = "throw=1"}) << "more context", "more context");
}

TEST(MultiProcess, ExpectedExitCodes) {
  EMBER_EXPECT_RANKS("maybe_fails", 3, {.arg = "exit=2", .expect_exit = {{2, 42}}});
  // The victim exiting 0, or another code, fails.
  EXPECT_NONFATAL_FAILURE(EMBER_EXPECT_RANKS("maybe_fails", 2, {.expect_exit = {{1, 42}}}),
                          "rank 1: exit code 0, expected exit code 42");
  EXPECT_NONFATAL_FAILURE(EMBER_EXPECT_RANKS("maybe_fails", 2, {.arg = "exit=0", .expect_exit = {{1, 42}}}),
                          "rank 0: exit code 42, expected exit code 0");
}

// arg: the OMP_NUM_THREADS the worker must see ("unset": none).
EMBER_WORKER(omp_threads) {
  const char* got = std::getenv("OMP_NUM_THREADS");
  WCHECK(env.arg == (got ? got : "unset"), "rank ", env.rank, " of ", env.world_size, ": OMP_NUM_THREADS ",
         got ? got : "unset", ", expected ", env.arg);
}

// Several workers get one OpenMP thread each unless the test's environment
// or the caller sets one (as //tools:launch and torchrun); a lone worker
// keeps the machine's.
TEST(MultiProcess, WorkersGetOneOpenMPThreadUnlessTold) {
  const char* outer = std::getenv("OMP_NUM_THREADS");
  const std::string inherited = outer ? outer : "unset";
  EMBER_EXPECT_RANKS("omp_threads", 2, {.arg = outer ? inherited : "1"});
  EMBER_EXPECT_RANKS("omp_threads", 1, {.arg = inherited});
  EMBER_EXPECT_RANKS("omp_threads", 2, {.arg = "3", .env = {"OMP_NUM_THREADS=3"}});
}

// A binary whose workers never reach MultiProcessWorker.Entry (here: a
// filter that selects nothing) exits 0 having run nothing: that fails.
TEST(MultiProcess, AWorkerThatNeverReachesTheEntryFails) {
  EXPECT_NONFATAL_FAILURE(EMBER_EXPECT_RANKS("maybe_fails", 2, {.argv = {"--gtest_filter=NoSuchTest.*"}}),
                          "rank 1: exit code 4, expected exit code 0");
}

std::string error_of(const Tensor& got, const Tensor& want, double tol) {
  try {
    check_close(got, want, "t", tol);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(CheckClose, ToleranceIsRelativeToOnePlusTheWantedMagnitude) {
  const Tensor want = Tensor::from_vector({1, 100, -3}, {3});
  EXPECT_EQ(error_of(want, want, 0), "");
  EXPECT_EQ(error_of(Tensor::from_vector({1.001, 100.1, -3}, {3}), want, 1e-3), "");
  const std::string e = error_of(Tensor::from_vector({1.001, 100.5, -3}, {3}), want, 1e-3);
  EXPECT_NE(e.find("t: element 1: 100.5 vs 100 wanted"), std::string::npos) << e;
  EXPECT_NE(e.find("max |diff| 0.5 at element 1 of 3"), std::string::npos) << e;
  EXPECT_NE(error_of(Tensor::from_vector({1, 100.001, -3}, {3}), want, 0), "");
  EXPECT_NE(error_of(Tensor::from_vector({1, 100}, {2}), want, 1).find("shape"), std::string::npos);
  EXPECT_NE(error_of(Tensor(), want, 1).find("undefined"), std::string::npos);
  EXPECT_NE(error_of(Tensor::from_vector({1, std::nan(""), -3}, {3}), want, 1), "");
}

}  // namespace
}  // namespace ember::distributed::testing
