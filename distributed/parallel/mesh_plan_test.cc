// The mesh planner against what is known: the models' parameter counts,
// Korthikanti's activation bytes, and the seeds' decision matrix (ResNet-50
// on 8 GPUs: DDP; GPT-2 1.5B on 4 small GPUs: FSDP; LLaMA-7B on 8: full
// sharding; LLaMA-70B on 64: tensor and pipeline parallelism), with the
// reasons meshes are rejected.
#include "distributed/parallel/mesh_plan.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/exception.h"
#include "distributed/parallel/pp/schedule/schedule.h"
#include "nn/moe.h"
#include "nn/transformer.h"

namespace ember::distributed {
namespace {

Hardware h100(int gpus, int64_t gib = 80) {
  Hardware hw;
  hw.gpus = gpus;
  hw.gpus_per_host = 8;
  hw.mem_per_gpu = gib << 30;
  return hw;
}

TEST(MeshPlan, ParameterCountsOfThePresets) {
  // Published sizes: GPT-2 XL 1.56 B (with its position table), LLaMA 7B
  // 6.74 B, 13B 13.0 B, 70B 69.0 B (grouped key/value heads).
  EXPECT_NEAR(model_preset("gpt2").num_params() / 1e6, 124.4, 0.5);
  EXPECT_NEAR(model_preset("gpt2-xl").num_params() / 1e9, 1.56, 0.01);
  EXPECT_NEAR(model_preset("llama-7b").num_params() / 1e9, 6.74, 0.01);
  EXPECT_NEAR(model_preset("llama-13b").num_params() / 1e9, 13.0, 0.05);
  EXPECT_NEAR(model_preset("llama-70b").num_params() / 1e9, 69.0, 0.3);
  EXPECT_THROW(model_preset("llama-8t"), Error);
}

// The llama-* presets are nn::GPT's LLaMA family: a preset's GPTOptions
// come back as the same spec (LLaMA-7B's ffn is what LLaMA's rule gives),
// and a scaled-down model built from those options holds the spec's
// parameters plus its norms' (which the planner leaves out).
TEST(MeshPlan, LlamaPresetsDescribeTheNnModel) {
  for (const char* name : {"llama-7b", "llama-13b", "llama-70b"}) {
    const ModelSpec spec = model_preset(name);
    const nn::GPTOptions o = gpt_options(spec);
    EXPECT_EQ(o.arch, nn::Arch::Llama) << name;
    const ModelSpec back = model_spec(o, spec.seq);
    EXPECT_EQ(back.num_params(), spec.num_params()) << name;
    EXPECT_EQ(back.kv_heads, spec.kv_heads) << name;
  }
  EXPECT_EQ(nn::GPTOptions::llama({.n_embd = 4096}).ffn_width(), model_preset("llama-7b").ffn);
  ModelSpec small = model_preset("llama-70b");  // grouped: 64 heads, 8 kv heads
  small.layers = 2, small.dim = 128, small.heads = 16, small.kv_heads = 2, small.ffn = 96, small.vocab = 50;
  nn::GPT model(gpt_options(small));
  EXPECT_EQ(model.num_parameters(), small.num_params() + (2 * small.layers + 1) * small.dim);
}

TEST(MeshPlan, ActivationsFollowKorthikanti) {
  // One GPU, no pipeline: L layers x 34 s b h bytes (16 bits) and the
  // embedding's output, 2 s b h with full recompute plus one layer
  // rebuilt. GPT-2 small, batch 1.
  ModelSpec m = model_preset("gpt2");
  PlanOptions o;
  o.global_batch = 1;
  const MeshPlan plan = plan_mesh(m, h100(1), o);
  const double sbh = 1024.0 * 1 * 768;
  bool none = false, full = false;
  for (const MeshCandidate& c : plan.feasible) {
    const double logits = 1024.0 * 50257 * 4 * 2;
    if (c.ac == "none" && !c.offload) {
      EXPECT_NEAR(c.activations, 12 * 34 * sbh + 2 * 2 * sbh + logits, 1e3);  // + the embedding's output
      none = true;
    }
    if (c.ac == "full" && !c.offload) {
      EXPECT_NEAR(c.activations, 12 * 2 * sbh + 34 * sbh + logits, 1e3);
      full = true;
    }
  }
  EXPECT_TRUE(none && full);
}

TEST(MeshPlan, ResNet50On8GpusIsDdp) {
  PlanOptions o;
  o.global_batch = 256;
  const MeshPlan plan = plan_mesh(model_preset("resnet50"), h100(8), o);
  EXPECT_EQ(plan.best().mesh(), "dp_replicate=8 dp_shard=1 tp=1 pp=1") << plan.table();
  EXPECT_EQ(plan.best().describe(), "DDP");
}

TEST(MeshPlan, Gpt2XlOn4SmallGpusIsFsdp) {
  // 16 bytes per parameter (ZeRO's accounting) is 25 GB: DDP does not fit
  // a 24 GiB GPU; 25 heads rule tensor parallelism out on 4.
  PlanOptions o;
  o.global_batch = 32;
  const MeshPlan plan = plan_mesh(model_preset("gpt2-xl"), h100(4, 24), o);
  const MeshCandidate& b = plan.best();
  EXPECT_EQ(b.dims.dp_shard, 4) << plan.table();
  EXPECT_EQ(b.dims.tp * b.dims.pp, 1) << plan.table();
  EXPECT_FALSE(b.offload);
  EXPECT_NE(plan.table().find("does not divide the 25 heads"), std::string::npos) << plan.table();
  EXPECT_NE(plan.table().find("does not fit in memory"), std::string::npos) << plan.table();
}

TEST(MeshPlan, Llama7bOn8IsFullShardingAndOffloadWhenMemoryDemands) {
  PlanOptions o;
  o.global_batch = 32;
  const MeshPlan plan = plan_mesh(model_preset("llama-7b"), h100(8), o);
  EXPECT_EQ(plan.best().mesh(), "dp_replicate=1 dp_shard=8 tp=1 pp=1") << plan.table();
  EXPECT_FALSE(plan.best().offload);
  // On 8 GPUs of 8 GiB nothing fits on the GPUs alone: the sharded state
  // goes to the host.
  const MeshPlan small = plan_mesh(model_preset("llama-7b"), h100(8, 8), o);
  EXPECT_TRUE(small.best().offload) << small.table();
  EXPECT_EQ(small.best().dims.dp_shard * small.best().dims.tp * small.best().dims.pp, 8);
}

// Without context parallelism (the seeds' decision matrix); with it, the
// planner splits the sequence over cp where tp would be (below: cp's ring
// hides behind the attention, tp's all-reduces do not).
TEST(MeshPlan, Llama70bOn64UsesTensorAndPipelineParallelism) {
  PlanOptions o;
  o.global_batch = 64;
  MeshPlan plan = plan_mesh(model_preset("llama-70b"), h100(64), o);
  const MeshCandidate with_cp = plan.best();
  EXPECT_GT(with_cp.dims.pp, 1) << plan.table();
  std::erase_if(plan.feasible, [](const MeshCandidate& c) { return c.dims.cp > 1; });
  const MeshCandidate& b = plan.best();
  EXPECT_LE(with_cp.step, b.step);
  // Every pipeline is simulated once and its result reused for the search's
  // other candidates: the memo's bubbles are the simulator's.
  for (const MeshCandidate* c : {&with_cp, &b}) {
    const pp::Schedule sched =
        pp::make_schedule(c->schedule, c->dims.pp, c->virtual_stages, static_cast<int>(c->microbatches));
    const pp::Costs costs{.f = 1, .b = c->schedule == "zb-h1" ? 1.0 : 2.0, .w = c->schedule == "zb-h1" ? 1.0 : 0.0};
    EXPECT_DOUBLE_EQ(c->bubble, pp::simulate(sched, costs).bubble_fraction) << c->mesh();
  }
  EXPECT_GT(b.dims.tp, 1) << plan.table();
  EXPECT_GT(b.dims.pp, 1) << plan.table();
  EXPECT_LE(b.dims.tp, 8) << "tensor parallelism stays within a host";
  EXPECT_LE(b.total(), int64_t{80} << 30);
  // Plain FSDP over the 64 ranks fits but its gathers cross hosts: slower.
  bool fsdp64 = false;
  for (const MeshCandidate& c : plan.feasible)
    if (c.dims.dp_shard == 64 && !c.offload) {
      fsdp64 = true;
      EXPECT_GT(c.step, b.step);
    }
  EXPECT_TRUE(fsdp64) << plan.table();
  EXPECT_NE(plan.table().find("spans hosts"), std::string::npos);
}

// Context parallelism: a rank holds 1/cp of each sequence, so its
// activations are those of a cp-times-shorter sequence (the same model on
// cp-times fewer ranks); FSDP shards over dp_shard x cp; each exchange's
// traffic is its formula's, the ring's hidden behind the attention.
TEST(MeshPlan, ContextParallelismDividesActivationsAndCountsItsExchanges) {
  ModelSpec m = model_preset("llama-7b");
  m.seq = 32768;
  PlanOptions o;
  o.global_batch = 2;
  MeshCandidate c;
  c.dims = {.dp_shard = 2, .cp = 4};
  c.ac = "full";
  const MeshCandidate ring = evaluate_mesh(m, h100(8), o, c);
  ASSERT_TRUE(ring.rejected.empty()) << ring.rejected;
  EXPECT_EQ(ring.describe(), "FSDP + CP ring, AC full");
  ModelSpec quarter = m;
  quarter.seq = m.seq / 4;
  MeshCandidate two;
  two.dims = {.dp_shard = 2};
  two.ac = "full";
  const MeshCandidate short_seq = evaluate_mesh(quarter, h100(2), o, two);
  EXPECT_EQ(ring.activations, short_seq.activations);
  // The parameters shard 8 ways (dp_shard x cp), not 2.
  MeshCandidate eight;
  eight.dims = {.dp_shard = 8};
  eight.ac = "full";
  const MeshCandidate fsdp8 = evaluate_mesh(quarter, h100(8), PlanOptions{.global_batch = 8}, eight);
  EXPECT_EQ(ring.params + ring.grads + ring.optimizer, fsdp8.params + fsdp8.grads + fsdp8.optimizer);
  // Exchanges at the backward's peak: the ring's 16-bit k, v and float32
  // dk, dv, each in hand and arriving, and the float32 dq.
  const double kv = 2.0 * m.seq / 4 * 1 * m.dim;  // a rank's k and v, elements (micro-batch 1)
  EXPECT_EQ(ring.buffers, static_cast<int64_t>(2 * kv * (2 + 4) + kv / 2 * 4));
  EXPECT_NE(ring.explain.find("| cp | send_recv"), std::string::npos) << ring.explain;
  EXPECT_NE(ring.explain.find("hidden behind the blocks' attention"), std::string::npos) << ring.explain;
  EXPECT_GE(ring.cp_comm, 0);
  // The all-gather's: 32 blocks x (2 forwards + backward) gathers of cp x kv
  // bytes and one reduce-scatter of float32 dk, dv, on the analytic ring.
  c.cp_exchange = "allgather";
  const MeshCandidate ag = evaluate_mesh(m, h100(8), o, c);
  const Hardware hw = h100(8);
  const double bw = hw.intra_host_bw, lat = hw.intra_latency;
  const double gather = 0.75 * (4 * kv * 2) / bw + 3 * lat, scatter = 0.75 * (4 * kv * 4) / bw + 3 * lat;
  EXPECT_NEAR(ag.cp_comm, 32 * (3 * gather + scatter), 1e-9 * ag.cp_comm) << ag.explain;
  EXPECT_EQ(ag.buffers, static_cast<int64_t>(4 * kv * (2 + 8) + kv / 2 * 4));
  // Ulysses: 4 all-to-alls of a rank's q, k, v, out per forward (twice
  // under recompute) and 4 in the backward.
  c.cp_exchange = "alltoall";
  const MeshCandidate a2a = evaluate_mesh(m, h100(8), o, c);
  const double one = 0.75 * (kv / 2 * 2) / bw + 3 * lat;
  EXPECT_NEAR(a2a.cp_comm, 32 * 12 * one, 1e-9 * a2a.cp_comm) << a2a.explain;
  // What cp cannot split, named.
  m.seq = 32770;
  EXPECT_EQ(evaluate_mesh(m, h100(8), o, c).rejected, "seq 32770 does not cut into 2 x cp = 8 head-tail chunks");
  m.seq = 32768;
  m.heads = 2, m.kv_heads = 2;
  EXPECT_EQ(evaluate_mesh(m, h100(8), o, c).rejected, "alltoall: cp 4 does not divide the 2 heads of a tp rank");
  MeshCandidate resnet;
  resnet.dims = {.dp_shard = 4, .cp = 2};
  EXPECT_NE(evaluate_mesh(model_preset("resnet50"), h100(8), o, resnet).rejected.find("cp splits a transformer's"),
            std::string::npos);
}

// A mixture of experts (a Mixtral-like LLaMA-7B: 8 experts of 14336, top
// 2, every block): the parameters count every expert, the FLOPs two; an
// nn::GPT with the same options holds the spec's parameters plus its norms;
// under ep the experts are ep's (each rank 1/ep of them, whole state), its
// all-to-alls counted per MoE block and micro-batch; what ep cannot split
// is named; the search offers ep.
TEST(MeshPlan, ExpertsCountInMemoryAndEpInTime) {
  ModelSpec m = model_preset("llama-7b");
  m.experts = 8, m.top_k = 2, m.moe_every = 1, m.moe_hidden = 14336;
  m.ffn = 14336;
  const double expert = 3.0 * m.dim * m.moe_hidden;
  EXPECT_EQ(m.moe_layers(), m.layers);
  EXPECT_NEAR(static_cast<double>(m.num_params() - m.active_params()), m.layers * 6 * expert, 1.0);
  ModelSpec small = m;
  small.layers = 3, small.dim = 64, small.heads = 4, small.kv_heads = 2, small.moe_hidden = 40, small.ffn = 48;
  small.vocab = 50, small.moe_every = 2, small.moe_shared = 1;
  nn::GPT model(gpt_options(small));
  EXPECT_EQ(nn::moe_layers(model).size(), 2u);
  EXPECT_EQ(model.num_parameters(), small.num_params() + (2 * small.layers + 1) * small.dim);
  EXPECT_EQ(model_spec(gpt_options(small), small.seq).num_params(), small.num_params());

  PlanOptions o;
  o.global_batch = 8;
  const Hardware hw = h100(8, 160);  // 47 B parameters' state: 94 GB a rank
  MeshCandidate c;
  c.dims = {.dp_shard = 8, .ep = 8};
  const MeshCandidate ep = evaluate_mesh(m, hw, o, c);
  ASSERT_TRUE(ep.rejected.empty()) << ep.rejected;
  EXPECT_EQ(ep.describe(), "FSDP + EP");
  c.dims.ep = 1;
  const MeshCandidate fsdp = evaluate_mesh(m, hw, o, c);
  ASSERT_TRUE(fsdp.rejected.empty()) << fsdp.rejected;
  // A rank's experts: 1/8 of every block's with their whole state under
  // ep, FSDP's 1/8 shard of every expert's state otherwise: the same bytes.
  const auto state = [](const MeshCandidate& k) { return static_cast<double>(k.params + k.grads + k.optimizer); };
  EXPECT_NEAR(state(ep), state(fsdp), 1e-3 * state(fsdp));
  EXPECT_GT(state(ep), m.layers * expert * (2 + 2 + 12));  // at least the local experts' (8 x 1/8)
  // FSDP gathers a whole block (all 8 experts) under ep 1, not under ep 8.
  EXPECT_GT(fsdp.gathered, ep.gathered);
  // The all-to-alls: a rank's 1 sequence x 4096 tokens x 2 choices of 4096
  // 16-bit values, 2 each way per block, forward and backward.
  const double bytes = 4096.0 * 2 * m.dim * 2, one = 7.0 / 8 * bytes / hw.intra_host_bw + 7 * hw.intra_latency;
  EXPECT_NEAR(ep.ep_comm, m.layers * 4 * one, 1e-9 * ep.ep_comm) << ep.explain;
  EXPECT_NE(ep.explain.find("| ep | all_to_all"), std::string::npos) << ep.explain;
  EXPECT_EQ(fsdp.ep_comm, 0);
  // Named rejections.
  c.dims = {.dp_shard = 4, .tp = 2, .ep = 3};
  EXPECT_EQ(evaluate_mesh(m, hw, o, c).rejected, "ep 3 does not divide the 8 experts");
  c.dims = {.dp_replicate = 2, .dp_shard = 4, .ep = 2};
  EXPECT_NE(evaluate_mesh(m, hw, o, c).rejected.find("ep 2 below dp_shard x cp with dp_replicate 2"),
            std::string::npos);
  c.dims = {.dp_replicate = 2, .dp_shard = 4, .ep = 4};  // replicas of whole experts: built
  const MeshCandidate hsdp = evaluate_mesh(m, h100(8, 320), o, c);
  EXPECT_TRUE(hsdp.rejected.empty()) << hsdp.rejected;
  // ep below dp_shard: FSDP shards each rank's experts over the other 2
  // ranks holding them: the same state per rank as ep 8.
  c.dims = {.dp_shard = 8, .ep = 4};
  const MeshCandidate ep4 = evaluate_mesh(m, hw, o, c);
  ASSERT_TRUE(ep4.rejected.empty()) << ep4.rejected;
  EXPECT_NEAR(state(ep4), state(ep), 1e-3 * state(ep));
  EXPECT_GT(ep4.ep_comm, 0);
  c.dims = {.dp_shard = 8, .ep = 8};
  EXPECT_EQ(evaluate_mesh(model_preset("llama-7b"), hw, o, c).rejected, "ep 8 splits experts; llama-7b has none");
  // The search weighs ep against keeping the experts FSDP's.
  const MeshPlan plan = plan_mesh(m, hw, o);
  bool offered = false;
  for (const MeshCandidate& k : plan.feasible) offered = offered || k.dims.ep > 1;
  EXPECT_TRUE(offered) << plan.table();
}

// A long sequence: 128k tokens of LLaMA-7B on 8 GPUs, one sequence a step
// (nothing for data parallelism to split). Tensor parallelism over 8 fits
// with recompute but all-reduces every block's activations; cp's ring
// hides behind the attention, so the planner takes cp.
TEST(MeshPlan, ALongSequencePrefersContextParallelism) {
  ModelSpec m = model_preset("llama-7b");
  m.seq = 131072;
  PlanOptions o;
  o.global_batch = 1;
  const MeshPlan plan = plan_mesh(m, h100(8), o);
  EXPECT_GT(plan.best().dims.cp, 1) << plan.table();
  const MeshCandidate* no_cp = nullptr;
  for (const MeshCandidate& c : plan.feasible)
    if (c.dims.cp == 1 && (no_cp == nullptr || c.step < no_cp->step)) no_cp = &c;
  ASSERT_NE(no_cp, nullptr) << plan.table();
  EXPECT_GT(no_cp->dims.tp, 1) << no_cp->mesh();
  EXPECT_GT(no_cp->step, plan.best().step);
}

TEST(MeshPlan, BadInputIsNamed) {
  PlanOptions o;
  o.global_batch = 0;
  EXPECT_THROW(plan_mesh(model_preset("gpt2"), h100(8), o), Error);
  ModelSpec m = model_preset("gpt2");
  m.heads = 7;
  o.global_batch = 8;
  EXPECT_THROW(plan_mesh(m, h100(8), o), Error);
}

}  // namespace
}  // namespace ember::distributed
