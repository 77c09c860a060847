// The test the worker processes of run_workers start at
// (RunOptions::argv's default filter), once per test binary that links it.
#include <gtest/gtest.h>

#include "distributed/testing/multiprocess.h"

namespace ember::distributed::testing {
namespace {

TEST(MultiProcessWorker, Entry) {
  if (!is_worker()) GTEST_SKIP() << "entry point of the worker processes the other tests spawn";
  run_if_worker();
}

}  // namespace
}  // namespace ember::distributed::testing
