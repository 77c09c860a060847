// predict_step against the same sums written out by hand: the ring
// formulas over Hardware's links, the compute from a profile, each
// strategy's collectives (counts and bytes), what the backward hides, the
// stretch of ranks sharing cores under measured fits; the planner using a
// given profile; bad profiles and strategies named.
#include "distributed/parallel/step_cost.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include "core/testing/error_of.h"
#include "distributed/parallel/mesh_plan.h"

namespace ember::distributed {
namespace {

using ::ember::testing::error_of;

// A small GPT: 2 blocks of dim 64, vocab 100, context 32, untied head.
ModelSpec small() {
  ModelSpec m;
  m.name = "small";
  m.layers = 2, m.dim = 64, m.heads = 4, m.vocab = 100, m.seq = 32;
  return m;
}

ComputeProfile profile() {
  ComputeProfile p;
  p.block_flops_per_s = 50e9, p.block_overhead_s = 1e-4;
  p.head_flops_per_s = 40e9, p.head_overhead_s = 5e-5;
  p.optimizer_s_per_param = 1e-9, p.optimizer_overhead_s = 1e-5;
  p.overlap = 0;
  return p;
}

MeshCandidate mesh(int R, int S, int T, int P, int64_t M, int64_t mb) {
  MeshCandidate c;
  c.dims = {.pp = P, .dp_replicate = R, .dp_shard = S, .tp = T};
  c.microbatches = M, c.micro_batch = mb;
  c.schedule = P > 1 ? "1f1b" : "";
  return c;
}

// What every predict_step test starts from: the small model and profile,
// the default Hardware and options, which a test changes before it
// predicts.
class PredictStep : public ::testing::Test {
 protected:
  ModelSpec m = small();
  ComputeProfile p = profile();
  Hardware hw;
  PlanOptions o;
};

TEST(Links, AnalyticRingsOverTheHostsLinks) {
  Hardware hw;  // 8 per host, NVLink 450 GB/s, 50 GB/s across, 10 and 20 us
  const Links l = Links::analytic(hw);
  const double B = 1 << 30;
  EXPECT_DOUBLE_EQ(l.seconds("allreduce", B, 8, 1), 2 * 7.0 / 8 * B / 450e9 + 14 * 10e-6);
  // 8 ranks 8 apart cross hosts.
  EXPECT_DOUBLE_EQ(l.seconds("allgather", B, 8, 8), 7.0 / 8 * B / 50e9 + 7 * 20e-6);
  EXPECT_DOUBLE_EQ(l.seconds("send_recv", B, 2, 64), B / 50e9 + 20e-6);
  EXPECT_EQ(l.seconds("allreduce", B, 1, 1), 0);
  EXPECT_NE(error_of([&] { l.seconds("gossip", B, 2, 1); }).find("unknown collective 'gossip'"), std::string::npos);
}

TEST_F(PredictStep, FsdpIsComputePlusEveryGatherAndScatter) {
  const Links l = Links::analytic(hw);
  o.mixed_precision = false;  // 4-byte elements
  const StepTime t = predict_step(m, mesh(1, 4, 1, 1, 2, 3), o, p, l, 0);
  // Compute: 2 micro-batches of 3 x 32 tokens.
  const double tokens = 3 * 32;
  const double block = 1e-4 + (6.0 * m.layer_params() + 12.0 * 64 * 32) * tokens / 50e9;
  const double head = 5e-5 + 6.0 * 100 * 64 * tokens / 40e9;
  EXPECT_NEAR(t.compute, 2 * (2 * block + head), 1e-12);
  // FULL_SHARD: each block gathered for both passes of both micro-batches,
  // the root for the forwards; one reduce-scatter each.
  const double blk = 4.0 * m.layer_params(), root = 4.0 * (m.embedding_params() + 100 * 64);
  const double dp = 2 * (4 * l.seconds("allgather", blk, 4, 1) + l.seconds("reduce_scatter", blk, 4, 1)) +
                    2 * l.seconds("allgather", root, 4, 1) + l.seconds("reduce_scatter", root, 4, 1);
  EXPECT_NEAR(t.dp_comm, dp, 1e-12);
  EXPECT_NEAR(t.dp_exposed, dp, 1e-12);  // overlap 0: nothing hidden
  const double params = (2.0 * m.layer_params() + m.embedding_params() + 100 * 64) / 4;
  EXPECT_NEAR(t.optimizer, 1e-5 + params * 1e-9, 1e-12);
  EXPECT_NEAR(t.step, t.compute + dp + t.optimizer, 1e-12);
  // The explanation lists the terms and the sum.
  EXPECT_NE(t.explain().find("allgather"), std::string::npos);
  EXPECT_NE(t.explain().find("| step |"), std::string::npos);
}

TEST_F(PredictStep, TheBackwardHidesWhatTheProfileLets) {
  hw.intra_host_bw = 1e6;  // slow enough that the gathers outlast the backward
  const Links l = Links::analytic(hw);
  const StepTime none = predict_step(m, mesh(2, 1, 1, 1, 1, 4), o, p, l, 0);
  p.overlap = 1;
  const StepTime all = predict_step(m, mesh(2, 1, 1, 1, 1, 4), o, p, l, 0);
  EXPECT_NEAR(none.dp_exposed, none.dp_comm, 1e-12);
  EXPECT_NEAR(all.dp_exposed, all.dp_comm - all.compute * 2 / 3, 1e-12);
  EXPECT_GT(all.dp_exposed, 0);
  // ZeRO-1's gather of the updated parameters comes after the step: never hidden.
  MeshCandidate z = mesh(1, 2, 1, 1, 1, 4);
  z.strategy = "zero1";
  const StepTime zt = predict_step(m, z, o, p, l, 0);
  const double blk = 2.0 * m.layer_params(), root = 2.0 * (m.embedding_params() + 100 * 64);
  const double after = 2 * l.seconds("allgather", blk, 2, 1) + l.seconds("allgather", root, 2, 1);
  EXPECT_NEAR(zt.dp_exposed, zt.dp_comm - std::min(zt.dp_comm - after, zt.compute * 2 / 3), 1e-12);
  EXPECT_GE(zt.dp_exposed, after - 1e-12);
}

TEST_F(PredictStep, TensorParallelCollectivesAsTheGptRunsThem) {
  const Links l = Links::analytic(hw);
  o.mixed_precision = false;
  const double sbh = 32 * 2 * 64 * 4.0;  // 2 sequences per micro-batch
  MeshCandidate c = mesh(1, 1, 2, 1, 3, 2);
  const StepTime sp = predict_step(m, c, o, p, l, 0);
  // Per micro-batch: 6 gathers and 4 scatters per block, 3 and 2 for the
  // embedding and head; the replicated gradients once; the loss's 3.
  const double want = 3 * (15 * l.seconds("allgather", sbh, 2, 1) + 10 * l.seconds("reduce_scatter", sbh, 2, 1)) +
                      14 * l.seconds("allreduce", 64 * 4, 2, 1) + 9 * l.seconds("allreduce", 32 * 2 * 4, 2, 1);
  EXPECT_NEAR(sp.tp_comm, want, 1e-12);
  c.sequence_parallel = false;
  const StepTime plain = predict_step(m, c, o, p, l, 0);
  EXPECT_NEAR(plain.tp_comm, 3 * 10 * l.seconds("allreduce", sbh, 2, 1) + 9 * l.seconds("allreduce", 32 * 2 * 4, 2, 1),
              1e-12);
  // Half the FLOPs per rank.
  const double tokens = 2 * 32;
  EXPECT_NEAR(sp.compute,
              3 * (2 * (1e-4 + (6.0 * m.layer_params() + 12.0 * 64 * 32) * tokens / 2 / 50e9) +
                   (5e-5 + 6.0 * 100 * 64 * tokens / 2 / 40e9)),
              1e-12);
}

TEST_F(PredictStep, PipelineStretchedByItsBubbleWithItsTransfers) {
  const Links l = Links::analytic(hw);
  const StepTime t = predict_step(m, mesh(1, 1, 1, 2, 4, 1), o, p, l, 0.2);
  // The last stage: one block and the head, 4 micro-batches.
  const double block = 1e-4 + (6.0 * m.layer_params() + 12.0 * 64 * 32) * 32 / 50e9;
  const double head = 5e-5 + 6.0 * 100 * 64 * 32 / 40e9;
  EXPECT_NEAR(t.compute, 4 * (block + head), 1e-12);
  EXPECT_NEAR(t.pp_comm, 8 * l.seconds("send_recv", 32 * 64 * 2.0, 2, 1), 1e-12);
  EXPECT_NEAR(t.step, t.compute / 0.8 + t.pp_comm + t.optimizer, 1e-12);
}

TEST_F(PredictStep, RanksSharingCoresStretchComputeAndFits) {
  auto fits = CommCostModel::load("bench/results/collectives_fit.json");
  ASSERT_TRUE(fits.ok()) << fits.status();
  // 8 ranks on 2 cores: a 2-rank group's fit (measured with 2 processes)
  // takes 4 times as long, an 8-rank group's fit as measured.
  const Links l = Links::measured(*fits, 8, 2);
  EXPECT_DOUBLE_EQ(l.seconds("allgather", 1 << 20, 2, 1), 4 * fits->seconds("allgather", 1 << 20, 2));
  EXPECT_DOUBLE_EQ(l.seconds("allgather", 1 << 20, 8, 1), fits->seconds("allgather", 1 << 20, 8));
  EXPECT_DOUBLE_EQ(l.seconds("allgather", 1 << 20, 4, 1), 2 * fits->seconds("allgather", 1 << 20, 4));
  p.cores = 2;
  const StepTime shared = predict_step(m, mesh(1, 8, 1, 1, 1, 1), o, p, l, 0);
  p.cores = 0;
  const StepTime own = predict_step(m, mesh(1, 8, 1, 1, 1, 1), o, p, l, 0);
  EXPECT_NEAR(shared.compute, 4 * own.compute, 1e-12);
  // A group size never measured is named.
  EXPECT_NE(error_of([&] { l.seconds("allgather", 1024, 3, 1); }).find("3"), std::string::npos);
}

TEST(Links, HostsJoinedByASlowLink) {
  auto fits = CommCostModel::load("bench/results/collectives_fit.json");
  ASSERT_TRUE(fits.ok()) << fits.status();
  // 4 ranks, 2 per host, 100 Mbit/s each way between the hosts.
  const double bw = 12.5e6, B = 1 << 20;
  const Links l = Links::measured(*fits, 4, 2, bw, 2);
  const Links local = Links::measured(*fits, 4, 2);
  // Within a host: the fit alone.
  EXPECT_DOUBLE_EQ(l.seconds("allgather", B, 2, 1), local.seconds("allgather", B, 2, 1));
  // FSDP over all 4: one ring crosses each host's link with 3/4 of the bytes.
  EXPECT_DOUBLE_EQ(l.seconds("allgather", B, 4, 1), fits->fit("allgather", 4).latency_s + 0.75 * B / bw);
  // HSDP's replicas (2 ranks 2 apart): both shards' pairs cross the same link.
  EXPECT_DOUBLE_EQ(l.seconds("allreduce", B, 2, 2), fits->fit("allreduce", 2).latency_s + 2 * 1.0 * B / bw);
  // A fast link leaves the fit.
  const Links fast = Links::measured(*fits, 4, 2, 1e15, 2);
  EXPECT_DOUBLE_EQ(fast.seconds("allgather", B, 4, 1), local.seconds("allgather", B, 4, 1));
}

TEST_F(PredictStep, ThePlannerUsesTheGivenProfile) {
  hw.gpus = 4;
  const Links l = Links::analytic(hw);
  o.global_batch = 8;
  o.compute = &p;
  o.links = &l;
  MeshCandidate c = mesh(1, 4, 1, 1, 1, 0);
  const MeshCandidate k = evaluate_mesh(m, hw, o, c);
  ASSERT_TRUE(k.rejected.empty()) << k.rejected;
  EXPECT_EQ(k.micro_batch, 2);
  EXPECT_NEAR(k.step, predict_step(m, k, o, p, l, 0).step, 1e-12);
  o.compute = nullptr, o.links = nullptr;  // the GPU's figures: far faster compute
  EXPECT_LT(evaluate_mesh(m, hw, o, c).compute, k.compute / 100);
}

TEST_F(PredictStep, AModelMeasuredWholeWithDdpBuckets) {
  m = model_preset("resnet18-narrow");
  EXPECT_GT(m.num_params(), 100000);
  p.models["resnet18-narrow"] = {.overhead_s = 2e-3, .s_per_sample = 1e-3, .optimizer_s = 5e-4};
  const Links l = Links::analytic(hw);
  o.mixed_precision = false;
  const StepTime t = predict_step(m, mesh(4, 1, 1, 1, 1, 64), o, p, l, 0);
  EXPECT_NEAR(t.compute, 2e-3 + 64 * 1e-3, 1e-12);
  EXPECT_NEAR(t.optimizer, 5e-4, 1e-12);
  // Its float32 gradients in one bucket (under 25 MiB), all-reduced over the 4 replicas.
  EXPECT_NEAR(t.dp_comm, l.seconds("allreduce", 4.0 * m.num_params(), 4, 1), 1e-12);
  // Without the measurement: FLOPs at the head's rate.
  p.models.clear();
  EXPECT_NEAR(predict_step(m, mesh(4, 1, 1, 1, 1, 64), o, p, l, 0).compute, 5e-5 + m.flops_per_sample * 64 / 40e9,
              1e-12);
}

TEST_F(PredictStep, UnknownStrategyNamed) {
  MeshCandidate c = mesh(1, 2, 1, 1, 1, 1);
  c.strategy = "zero3";
  EXPECT_NE(error_of([&] { predict_step(m, c, o, p, Links::analytic(hw), 0); }).find("unknown strategy 'zero3'"),
            std::string::npos);
}

TEST(ComputeProfile, LoadsTheBenchsFileAndNamesWhatIsWrong) {
  auto p = ComputeProfile::load("bench/results/compute_profile.json");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(p->block_flops_per_s, 1e9);  // a core does more than a GFLOP/s
  EXPECT_GE(p->cores, 1);
  EXPECT_EQ(p->overlap, 0);
  ASSERT_EQ(p->models.count("resnet18-narrow"), 1u);
  EXPECT_GT(p->models.at("resnet18-narrow").s_per_sample, 0);
  const std::string path = ::testing::TempDir() + "/profile.json";
  std::ofstream(path) << R"({"block": {"flops_per_s": 1e9, "overhead_s": 0}, "head": {"flops_per_s": -1,
    "overhead_s": 0}, "optimizer": {"s_per_param": 0, "overhead_s": 0}, "machine": {"cores": 2}})";
  auto bad = ComputeProfile::load(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("head.flops_per_s"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find(path), std::string::npos) << bad.status();
  std::ofstream(path) << R"({"block": {"flops_per_s": 1e9}})";
  bad = ComputeProfile::load(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("block.overhead_s"), std::string::npos) << bad.status();
  EXPECT_FALSE(ComputeProfile::load("/nonexistent/profile.json").ok());
}

}  // namespace
}  // namespace ember::distributed
