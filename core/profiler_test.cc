// The profiler: nothing recorded while off, nesting and self time, threads,
// ops with their input shapes, backward nodes, the Chrome trace (parsed back
// as JSON) and the key_averages table; results equal with it on and off.
#include "core/profiler.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "autograd/autograd.h"
#include "core/ops.h"

namespace ember {
namespace {

using profiler::Event;
using profiler::Kind;

struct Session {
  Session() { profiler::start(); }
  ~Session() {
    if (profiler::running()) profiler::stop();
  }
};

const Event* find(const std::vector<Event>& es, const std::string& name) {
  for (const Event& e : es)
    if (e.name == name) return &e;
  return nullptr;
}

int64_t count(const std::vector<Event>& es, const std::string& name) {
  int64_t n = 0;
  for (const Event& e : es) n += e.name == name;
  return n;
}

void spin_for_ns(int64_t ns) {
  const int64_t end = profiler::now_ns() + ns;
  while (profiler::now_ns() < end) {
  }
}

TEST(Profiler, OffRecordsNothing) {
  { Session s; }  // clears whatever an earlier test left
  ASSERT_FALSE(profiler::enabled());
  {
    EMBER_PROFILE_RANGE("never");
    Tensor y = add(ones({4}), ones({4}));
  }
  EXPECT_TRUE(profiler::events().empty());
  profiler::Scope s(Kind::User, "inactive");
  EXPECT_FALSE(s.active());
}

TEST(Profiler, NestingGivesSelfAndTotalTime) {
  Session s;
  {
    EMBER_PROFILE_RANGE("outer");
    spin_for_ns(2'000'000);
    {
      EMBER_PROFILE_RANGE("inner");
      spin_for_ns(3'000'000);
    }
  }
  profiler::stop();
  const auto es = profiler::events();
  const Event* outer = find(es, "outer");
  const Event* inner = find(es, "inner");
  ASSERT_TRUE(outer && inner);
  EXPECT_EQ(outer->depth, 0u);
  EXPECT_EQ(inner->depth, 1u);
  EXPECT_EQ(outer->tid, inner->tid);
  EXPECT_GE(inner->start_ns, outer->start_ns);
  EXPECT_LE(inner->start_ns + inner->dur_ns, outer->start_ns + outer->dur_ns);
  EXPECT_GE(inner->dur_ns, 3'000'000);
  EXPECT_GE(outer->dur_ns, 5'000'000);
  EXPECT_EQ(outer->self_ns, outer->dur_ns - inner->dur_ns);
  EXPECT_GE(outer->self_ns, 2'000'000);
  EXPECT_LT(outer->self_ns, outer->dur_ns - 3'000'000 + 1);
}

TEST(Profiler, ThreadsGetTheirOwnTracks) {
  Session s;
  { EMBER_PROFILE_RANGE("on main"); }
  std::thread t([] {
    profiler::set_thread_name("helper thread");
    EMBER_PROFILE_RANGE("on helper");
  });
  t.join();
  profiler::stop();
  const auto es = profiler::events();
  const Event* a = find(es, "on main");
  const Event* b = find(es, "on helper");
  ASSERT_TRUE(a && b);
  EXPECT_NE(a->tid, b->tid);
  EXPECT_EQ(b->depth, 0u);
  const auto trace = nlohmann::json::parse(profiler::chrome_trace(es, 3));
  bool named = false;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["tid"] == b->tid)
      named = e["args"]["name"] == "helper thread";
  EXPECT_TRUE(named);
}

TEST(Profiler, OpsCarryShapesDtypesAndDevices) {
  Session s;
  Tensor a = ones({2, 3}), b = ones({3}, DType::Float64);
  Tensor c = add(a, b);
  Tensor m = linear(ones({4, 5}), ones({6, 5}), ones({6}));
  profiler::stop();
  const auto es = profiler::events();
  const Event* e = find(es, "add");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->kind, Kind::Op);
  const auto args = nlohmann::json::parse("{" + e->args + "}");
  EXPECT_EQ(args["input_shapes"], nlohmann::json::parse("[[2,3],[3]]"));
  EXPECT_EQ(args["input_dtypes"], nlohmann::json::parse(R"(["float32","float64"])"));
  EXPECT_EQ(args["input_devices"][0], "cpu");
  ASSERT_NE(find(es, "linear"), nullptr);
  EXPECT_EQ(nlohmann::json::parse("{" + find(es, "linear")->args + "}")["input_shapes"],
            nlohmann::json::parse("[[4,5],[6,5],[6]]"));
}

TEST(Profiler, RecordShapesOffLeavesOpsWithoutShapes) {
  profiler::Options o;
  o.record_shapes = false;
  profiler::start(o);
  Tensor c = add(ones({2, 3}), ones({3}));
  profiler::stop();
  const auto es = profiler::events();
  const Event* e = find(es, "add");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->args.find("input_shapes"), std::string::npos) << e->args;
}

TEST(Profiler, BackwardNodesAreRecordedWithTheirOps) {
  Tensor x = Tensor::from_vector({1, 2, 3}, {3}).requires_grad_(true);
  Session s;
  Tensor y = sum(mul(x, x));
  y.backward();
  profiler::stop();
  const auto es = profiler::events();
  const Event* mb = find(es, "MulBackward");
  const Event* sb = find(es, "SumBackward");
  ASSERT_TRUE(mb && sb) << profiler::summary_table(es);
  EXPECT_EQ(mb->kind, Kind::Backward);
  EXPECT_EQ(count(es, "AccumulateGrad"), 1);
  EXPECT_LT(sb->start_ns, mb->start_ns);  // backward runs in reverse
  // The ops a backward node runs nest inside it: mul's backward multiplies.
  bool nested = false;
  for (const Event& e : es)
    nested |= e.kind == Kind::Op && e.name == "mul" && e.tid == mb->tid && e.start_ns >= mb->start_ns &&
              e.start_ns + e.dur_ns <= mb->start_ns + mb->dur_ns && e.depth > mb->depth;
  EXPECT_TRUE(nested);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2, 4, 6}));
}

TEST(Profiler, ChromeTraceIsValidJsonWithEveryEvent) {
  Session s;
  {
    EMBER_PROFILE_RANGE("step \"0\"\n");  // escaped in the JSON
    Tensor y = relu(ones({8}) * 2.0);
  }
  profiler::stop();
  const auto es = profiler::events();
  const std::string body0 = profiler::chrome_trace_events(es, 0, "rank 0");
  const std::string body1 = profiler::chrome_trace_events(es, 1, "rank 1", 1000);
  const auto trace = nlohmann::json::parse(profiler::chrome_trace({body0, body1}));
  std::set<int> pids;
  int complete = 0;
  for (const auto& e : trace["traceEvents"]) {
    pids.insert(e["pid"].get<int>());
    if (e["ph"] != "X") continue;
    ++complete;
    EXPECT_TRUE(e.contains("ts") && e.contains("dur") && e.contains("cat"));
    EXPECT_GE(e["args"]["self_us"].get<double>(), 0.0);
  }
  EXPECT_EQ(complete, 2 * static_cast<int>(es.size()));
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  bool found = false;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X" && e["pid"] == 1 && e["name"] == "step \"0\"\n") {
      found = true;
      EXPECT_NEAR(e["ts"].get<double>(), (find(es, "step \"0\"\n")->start_ns + 1000) / 1e3, 1e-3);
    }
  EXPECT_TRUE(found);
}

TEST(Profiler, KeyAveragesCountCallsAndRecursionOnce) {
  Session s;
  for (int i = 0; i < 3; ++i) {
    EMBER_PROFILE_RANGE("rec");
    spin_for_ns(100'000);
    EMBER_PROFILE_RANGE("rec");  // nested in itself
    spin_for_ns(100'000);
  }
  profiler::stop();
  const auto es = profiler::events();
  const auto avgs = profiler::key_averages(es);
  ASSERT_EQ(avgs.size(), 1u);
  EXPECT_EQ(avgs[0].calls, 6);
  int64_t outer_total = 0, self = 0;
  for (const Event& e : es) {
    if (e.depth == 0) outer_total += e.dur_ns;
    self += e.self_ns;
  }
  EXPECT_EQ(avgs[0].total_ns, outer_total);
  EXPECT_EQ(avgs[0].self_ns, self);
  const std::string table = profiler::summary_table(es);
  EXPECT_NE(table.find("rec"), std::string::npos);
  EXPECT_NE(table.find("Self time total"), std::string::npos);
}

TEST(Profiler, OnOrOffGivesTheSameResults) {
  auto run = [] {
    Tensor w = Tensor::from_vector({0.5, -1.0, 2.0, 0.25}, {2, 2}).requires_grad_(true);
    Tensor x = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {3, 2});
    Tensor loss = sum(gelu(matmul(x, w)));
    loss.backward();
    std::vector<double> out = loss.to_vector();
    for (double g : w.grad().to_vector()) out.push_back(g);
    return out;
  };
  const auto off = run();
  profiler::start();
  const auto on = run();
  profiler::stop();
  EXPECT_EQ(off, on);
  EXPECT_GT(profiler::events().size(), 5u);
}

TEST(Profiler, StartTwiceIsAnError) {
  Session s;
  EXPECT_THROW(profiler::start(), Error);
}

}  // namespace
}  // namespace ember
