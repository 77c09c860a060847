// Rank-aware logging: rank-0 filtering, "[rank N] " tagging, the
// EMBER_LOG_RANKS switch, error messages, and whole lines under threads.
#include "distributed/logging/logging.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/testing/error_of.h"

namespace ember::distributed {
namespace {

// Captures everything logged during its lifetime into a temporary file, with
// the rank and the environment the tests set reset afterwards.
class LoggingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::unsetenv("RANK");
    ::unsetenv("SLURM_PROCID");
    ::unsetenv("EMBER_LOG_RANKS");
    set_log_rank(-1);
    sink_ = std::tmpfile();
    ASSERT_NE(sink_, nullptr);
    set_log_sink(sink_);
  }
  void TearDown() override {
    set_log_sink(nullptr);
    set_log_rank(-1);
    ::unsetenv("RANK");
    ::unsetenv("SLURM_PROCID");
    ::unsetenv("EMBER_LOG_RANKS");
    std::fclose(sink_);
  }
  // What was logged since the last call.
  std::string logged() {
    std::fflush(sink_);
    std::string s;
    std::rewind(sink_);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, sink_)) > 0) s.append(buf, n);
    // Start over: truncate so the next call sees only new lines.
    std::fflush(sink_);
    EXPECT_EQ(::ftruncate(::fileno(sink_), 0), 0);
    std::rewind(sink_);
    return s;
  }
  std::FILE* sink_ = nullptr;
};

TEST_F(LoggingTest, RankZeroOnlyByDefault) {
  set_log_rank(0);
  log_rank0("epoch ", 3, " loss ", 0.5);
  EXPECT_EQ(logged(), "epoch 3 loss 0.5\n");
  set_log_rank(1);
  log_rank0("epoch ", 3);
  LOG0("epoch ", 3);
  EXPECT_EQ(logged(), "");
}

TEST_F(LoggingTest, LogAllTagsEveryLineWithTheRank) {
  set_log_rank(2);
  log_all("shard has ", 60000, " samples");
  LOG_ALL("two\nlines\n");
  EXPECT_EQ(logged(), "[rank 2] shard has 60000 samples\n[rank 2] two\n[rank 2] lines\n");
}

TEST_F(LoggingTest, RankComesFromTheEnvironmentUnlessSet) {
  EXPECT_EQ(log_rank(), 0);  // nothing set: a single process is rank 0
  ::setenv("SLURM_PROCID", "5", 1);
  EXPECT_EQ(log_rank(), 5);
  ::setenv("RANK", "3", 1);  // torchrun's wins over SLURM's
  EXPECT_EQ(log_rank(), 3);
  LOG0("silent on rank 3");
  EXPECT_EQ(logged(), "");
  set_log_rank(0);
  EXPECT_EQ(log_rank(), 0);
  LOG0("rank 0 now");
  EXPECT_EQ(logged(), "rank 0 now\n");
}

TEST_F(LoggingTest, Log0SkipsEvaluatingItsArgumentsOnOtherRanks) {
  int evaluated = 0;
  auto costly = [&] { return ++evaluated; };
  set_log_rank(1);
  LOG0("value ", costly());
  EXPECT_EQ(evaluated, 0);
  set_log_rank(0);
  LOG0("value ", costly());
  EXPECT_EQ(evaluated, 1);
  EXPECT_EQ(logged(), "value 1\n");
}

TEST_F(LoggingTest, EmberLogRanksWidensRankZeroLogging) {
  ::setenv("EMBER_LOG_RANKS", "all", 1);
  set_log_rank(1);
  log_rank0("hello");
  set_log_rank(0);
  log_rank0("hello");
  EXPECT_EQ(logged(), "[rank 1] hello\n[rank 0] hello\n");

  ::setenv("EMBER_LOG_RANKS", "0,3", 1);
  for (int r = 0; r < 4; ++r) {
    set_log_rank(r);
    LOG0("from ", r);
  }
  EXPECT_EQ(logged(), "[rank 0] from 0\n[rank 3] from 3\n");

  ::setenv("EMBER_LOG_RANKS", "0", 1);  // the default, spelled out
  for (int r = 0; r < 2; ++r) {
    set_log_rank(r);
    LOG0("from ", r);
  }
  EXPECT_EQ(logged(), "from 0\n");
}

TEST_F(LoggingTest, InvalidSettingsNameTheVariable) {
  ::setenv("EMBER_LOG_RANKS", "some", 1);
  std::string err = ::ember::testing::error_of([] { LOG0("x"); });
  EXPECT_NE(err.find("EMBER_LOG_RANKS='some'"), std::string::npos) << err;
  ::unsetenv("EMBER_LOG_RANKS");
  ::setenv("RANK", "abc", 1);
  err = ::ember::testing::error_of([] { log_all("x"); });
  EXPECT_NE(err.find("RANK='abc' is not a non-negative integer"), std::string::npos) << err;
}

TEST_F(LoggingTest, ThreadsNeverSplitALine) {
  set_log_rank(4);
  constexpr int kThreads = 8, kLines = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < kLines; ++i) log_all("thread ", t, " line ", i, " ", std::string(100, 'x'));
    });
  for (auto& th : threads) th.join();
  std::istringstream in(logged());
  std::string line;
  int n = 0;
  const std::string tail = " " + std::string(100, 'x');
  while (std::getline(in, line)) {
    ASSERT_EQ(line.rfind("[rank 4] thread ", 0), 0u) << line;
    ASSERT_EQ(line.substr(line.size() - tail.size()), tail) << line;
    ++n;
  }
  EXPECT_EQ(n, kThreads * kLines);
}

TEST_F(LoggingTest, DefaultSinkIsStdout) {
  set_log_sink(nullptr);
  set_log_rank(0);
  char path[] = "/tmp/logging_test.XXXXXX";
  int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  std::fflush(stdout);
  int saved = ::dup(1);
  ::dup2(fd, 1);
  std::printf("before ");  // buffered stdio output goes out first, in order
  LOG0("logged");
  std::fflush(stdout);
  ::dup2(saved, 1);
  ::close(saved);
  std::string s(256, '\0');
  ssize_t n = ::pread(fd, s.data(), s.size(), 0);
  ::close(fd);
  ::unlink(path);
  s.resize(n > 0 ? n : 0);
  EXPECT_EQ(s, "before logged\n");
}

}  // namespace
}  // namespace ember::distributed
