// The anomaly detector on 2 real processes: a NaN in rank 1's input is
// named at the first module it comes out of, on rank 1 only, with its
// counts, and every rank gathers the same findings; a loss whose gradient
// is NaN while every forward value is finite is named in the backward; a
// clean step names nothing; hooks go with the detector.
#include "distributed/anomaly.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/ops.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"
#include "nn/layers.h"

namespace ember::distributed {
namespace {

namespace mp = testing;

std::shared_ptr<nn::Sequential> model() {
  manual_seed(3);
  auto seq = std::make_shared<nn::Sequential>();
  seq->push_back(std::make_shared<nn::Linear>(4, 8));
  seq->push_back(std::make_shared<nn::ReLU>());
  seq->push_back(std::make_shared<nn::Linear>(8, 2));
  return seq;
}

EMBER_WORKER(anomaly_names_module_and_rank) {
  mp::init_world(env);
  auto pg = default_group();
  auto m = model();
  {
    AnomalyDetector d(*m, env.rank);
    // A clean step: nothing.
    d.begin_step(1);
    sum((*m)(ones({3, 4}))).backward();
    WCHECK(!d.first().has_value(), d.first()->describe());
    WCHECK(gather_findings(d.first(), *pg).empty(), "findings on a clean step");

    // Step 2: rank 1's batch holds a NaN in one row.
    d.begin_step(2);
    Tensor x = ones({3, 4});
    if (env.rank == 1) x = cat({ones({1, 4}), full({1, 4}, std::numeric_limits<double>::quiet_NaN()), ones({1, 4})});
    sum((*m)(x)).backward();
    const std::vector<NonFinite> found = gather_findings(d.first(), *pg);
    WCHECK(found.size() == 1, found.size(), " findings");
    const NonFinite& f = found[0];
    WCHECK(f.rank == 1 && f.step == 2 && f.module == "0" && !f.backward && f.nan == 8 && f.inf == 0 && f.numel == 24,
           f.describe());
    WCHECK(f.describe() == "rank 1, step 2: the forward output of module '0' holds 8 NaN and 0 Inf of 24 values",
           f.describe());

    // Step 3: finite forward, NaN gradient (d sqrt(0) is infinite, times 0),
    // named at the innermost module whose output it flows into.
    d.begin_step(3);
    Tensor y = (*m)(ones({3, 4}));
    sum(sqrt(y * 0.0)).backward();
    WCHECK(d.first().has_value() && d.first()->backward && d.first()->module == "2" && d.first()->nan == 6,
           d.first() ? d.first()->describe() : "no finding");
  }
  // Without the detector (its hooks removed), nothing is checked.
  AnomalyDetector other(*m, env.rank);
  other.begin_step(4);
  WCHECK(!other.first().has_value(), "a fresh detector has a finding");
}

TEST(Anomaly, NamesModuleRankAndStep) { EMBER_EXPECT_RANKS("anomaly_names_module_and_rank", 2); }

}  // namespace
}  // namespace ember::distributed
