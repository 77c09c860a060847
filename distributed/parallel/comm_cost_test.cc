// CommCostModel against the points it was fitted to: for every collective
// and group size of bench/results/collectives_fit.json, the relative errors
// of its predictions over bench/results/collectives_fit_raw.jsonl have the
// median and maximum the fitter (bench/collectives_fit.py) computed; bad
// files and questions it cannot answer are named.
#include "distributed/parallel/comm_cost.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/testing/error_of.h"

namespace ember::distributed {
namespace {

const char* kFit = "bench/results/collectives_fit.json";
const char* kRaw = "bench/results/collectives_fit_raw.jsonl";

TEST(CommCostModel, PredictsTheMeasuredPointsAsFitted) {
  auto model = CommCostModel::load(kFit);
  ASSERT_TRUE(model.ok()) << model.status();
  std::map<std::pair<std::string, int>, std::vector<double>> errors;
  std::ifstream raw(kRaw);
  ASSERT_TRUE(raw) << kRaw;
  for (std::string line; std::getline(raw, line);) {
    const auto r = nlohmann::json::parse(line);
    const std::string op = r["op"];
    const int p = r["world"];
    const double t = r["seconds"], predicted = model->seconds(op, r["bytes"].get<int64_t>(), p);
    errors[{op, p}].push_back(std::abs(predicted - t) / t);
  }
  ASSERT_EQ(errors.size(), 18u);  // 6 collectives x 3 group sizes
  for (auto& [key, e] : errors) {
    std::sort(e.begin(), e.end());
    const auto& fit = model->fit(key.first, key.second);
    EXPECT_NEAR(e[e.size() / 2], fit.median_rel_error, 1e-9) << key.first << " p=" << key.second;
    EXPECT_NEAR(e.back(), fit.max_rel_error, 1e-9) << key.first << " p=" << key.second;
  }
  // More bytes cost more: every fitted link has a positive bandwidth term.
  for (const std::string& op : model->ops())
    for (int p : model->group_sizes(op))
      EXPECT_GT(model->seconds(op, 16 << 20, p), model->seconds(op, 4 << 10, p)) << op << " p=" << p;
}

TEST(CommCostModel, UnansweredQuestionsAndBadFilesAreNamed) {
  using ::ember::testing::error_of;
  auto model = CommCostModel::load(kFit);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_NE(error_of([&] {
              model->seconds("allreduce", 1024, 3);
            }).find("allreduce was not measured in a group of 3 (fitted: 2, 4, 8"),
            std::string::npos);
  EXPECT_NE(error_of([&] { model->seconds("gossip", 1024, 2); }).find("no fit for 'gossip'"), std::string::npos);
  EXPECT_NE(std::string(CommCostModel::load("/nonexistent/fit.json").status().message()).find("cannot read"),
            std::string::npos);
  const std::string bad = ::testing::TempDir() + "/comm_cost_bad.json";
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {"[1, 2]", "not a JSON object"},
           {"{}", "no \"ops\" object"},
           {R"({"ops": {"allreduce": {"two": {}}}})", "\"ops\".\"allreduce\".\"two\": not a group size"},
           {R"({"ops": {"allreduce": {"2": {"latency_s": 1e-4}}}})",
            "\"ops\".\"allreduce\".\"2\": \"seconds_per_byte\" is missing or not a number"}}) {
    std::ofstream(bad) << text;
    const auto s = CommCostModel::load(bad);
    ASSERT_FALSE(s.ok()) << text;
    EXPECT_NE(std::string(s.status().message()).find(want), std::string::npos) << s.status();
  }
  std::remove(bad.c_str());
}

}  // namespace
}  // namespace ember::distributed
