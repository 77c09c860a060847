// The GPT recipes (gpt.h): the library's parallelize steps with the GPT's
// tensor-parallel plan and block type.
#include "distributed/parallel/recipes/gpt.h"

#include <utility>

#include "core/allocator.h"
#include "core/cuda_graph.h"
#include "distributed/parallel/tp/gpt_plan.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "nn/float8.h"

namespace ember::distributed {

ParallelizeOptions gpt_parallelize_options(const nn::GPT& gpt, const GPTParallelOptions& o) {
  ParallelizeOptions p{.tp_plan = gpt_tp_plan(gpt, o.sequence_parallel),
                       .block_types = {"TransformerBlock"},
                       .ac = o.ac,
                       .fsdp = o.fsdp};
  p.cp = o.cp;
  return p;
}

namespace {

// GPTParallelOptions::float8, before any parallelism touches the layers.
void convert_float8(nn::GPT& gpt, const ParallelDims& dims, const GPTParallelOptions& o) {
  EMBER_CHECK(o.float8 || !o.float8_all_gather, "float8_all_gather without float8: nothing is in float8 to gather so");
  if (!o.float8) return;
  EMBER_CHECK(gpt.options.moe.num_experts == 0 || gpt.options.moe.capacity_factor > 0,
              "float8 with dropless mixture-of-experts blocks (", gpt.options.moe.num_experts,
              " experts): float8 experts run on padded groups; give the MoE a capacity_factor");
  nn::Float8Options f8;
  f8.enable_fsdp_float8_all_gather = o.float8_all_gather;
  // Under tp a layer's part must still be float8-sized: one whose features
  // are not multiples of 16 x tp stays in high precision (the plan splits
  // one of the two; both are held to it).
  if (dims.tp > 1)
    f8.filter = [m = 16 * dims.tp](const std::string&, const nn::Module& mod) {
      Tensor w;
      if (auto* lin = dynamic_cast<const nn::Linear*>(&mod)) w = lin->weight;
      if (auto* attn = dynamic_cast<const nn::MultiheadAttention*>(&mod)) w = attn->in_proj_weight;
      return !w.defined() || (w.size(0) % m == 0 && w.size(1) % m == 0);
    };
  nn::convert_to_float8_training(gpt, f8);
}

}  // namespace

Parallelized parallelize_gpt(const std::shared_ptr<nn::GPT>& gpt, const ParallelDims& dims,
                             const std::shared_ptr<DeviceMesh>& mesh, const GPTParallelOptions& o) {
  convert_float8(*gpt, dims, o);
  return parallelize(gpt, dims, mesh, gpt_parallelize_options(*gpt, o));
}

PipelineParallel pipeline_gpt(const std::shared_ptr<nn::GPT>& gpt, const ParallelDims& dims,
                              const std::shared_ptr<DeviceMesh>& mesh, const pp::Schedule& schedule,
                              const GPTParallelOptions& o, pp::PipelineOptions po) {
  convert_float8(*gpt, dims, o);
  const auto stages = pp::split_gpt(*gpt, schedule.num_stages(), o.blocks_per_stage);
  return pipeline_parallelize(stages, schedule, dims, mesh, gpt_parallelize_options(*gpt, o), std::move(po));
}

std::vector<Tensor> gpt_step_on_device(nn::GPT& gpt, Parallelized& par, optim::Optimizer& opt,
                                       optim::GradScaler& scaler, const std::vector<Tensor>& in, double max_norm) {
  EMBER_CHECK(!in.empty() && in.size() % 2 == 0, "gpt_step_on_device: expected (tokens, targets) pairs, got ",
              in.size(), " tensors");
  const int64_t micro = static_cast<int64_t>(in.size() / 2);
  // MoE layers: the router losses' gradient scaled as each micro-batch's
  // loss is (a float16 loss scaler's live scale on the device), and the
  // step's own statistics (reset here, so a captured step replays into the
  // same sums: stats() after a replay reads that step's).
  if (!nn::moe_layers(gpt).empty()) {
    nn::set_moe_aux_grad_scale(gpt, 1.0 / static_cast<double>(micro), scaler.scale_tensor(in[0].device()));
    nn::reset_moe_stats(gpt);
  }
  opt.zero_grad();
  Tensor loss_sum;
  for (int64_t m = 0; m < micro; ++m) {
    par.set_requires_gradient_sync(m == micro - 1);
    Tensor loss;
    {
      // What the forward allocates and the backward still holds.
      MemoryKindScope activations(MemoryKind::Activations);
      loss = parallel_cross_entropy(gpt(in[2 * m]), in[2 * m + 1]);
    }
    loss_sum = loss_sum.defined() ? loss_sum + loss.detach() : loss.detach();
    scaler.scale(loss * (1.0 / static_cast<double>(micro))).backward();
  }
  scaler.unscale_(opt);
  Tensor norm = par.clip_grad_norm_async_(max_norm);
  scaler.step_async(opt);
  scaler.update();
  return {loss_sum, norm};
}

}  // namespace ember::distributed
