// The parallelize steps (parallelize.h): tensor parallelism, activation
// checkpointing and FSDP/DDP on a ParallelDims mesh, whole or per stage.
#include "distributed/parallel/recipes/parallelize.h"

#include <utility>

#include "core/exception.h"
#include "distributed/parallel/ep/expert_parallel.h"
#include "nn/checkpoint.h"
#include "nn/moe.h"
#include "optim/clip_grad.h"

namespace ember::distributed {

namespace {

// HSDP replicates FULL_SHARD units: no other strategy combines with replicas.
void check_hsdp_strategy(const ParallelDims& dims, ShardingStrategy strategy) {
  EMBER_CHECK(
      dims.dp_replicate == 1 || strategy == ShardingStrategy::FULL_SHARD || strategy == ShardingStrategy::HYBRID_SHARD,
      "parallelize: dp_replicate=", dims.dp_replicate, " replicates FULL_SHARD units (HSDP); strategy ",
      strategy_name(strategy), " does not combine with it");
}

// Whether each expert lives on one rank only (ep all of dp_shard x cp, no
// replicas): FSDP leaves the experts alone; else they are an FSDP unit of
// their own (apply_expert_fsdp).
bool experts_on_one_rank(const ParallelDims& dims) { return dims.ep == dims.dp_shard_cp() && dims.dp_replicate == 1; }

// The options' errors, before any step changes the model.
void check_options(const ParallelDims& dims, const ParallelizeOptions& o) {
  EMBER_CHECK(dims.tp == 1 || !o.tp_plan.empty(), "parallelize: tp=", dims.tp,
              " but the model has no tensor-parallel plan (ParallelizeOptions::tp_plan)");
  EMBER_CHECK(nn::ActivationCheckpointing::parse(o.ac).mode == nn::ActivationCheckpointing::Mode::None ||
                  !o.block_types.empty(),
              "parallelize: activation checkpointing '", o.ac,
              "' needs the block types to wrap (ParallelizeOptions::block_types)");
  EMBER_CHECK(o.fsdp.mesh == nullptr, "parallelize: FSDPOptions::mesh is set; the mesh comes from the ParallelDims (",
              dims.str(), ")");
  // The experts are split over ep; over the data-parallel ranks outside ep
  // (dp_shard x cp / ep) FSDP shards them, or replicates them over
  // dp_replicate when ep is all of dp_shard x cp; not both at once.
  EMBER_CHECK(dims.ep == 1 || dims.dp_replicate == 1 || dims.ep == dims.dp_shard_cp(), "parallelize: ep=", dims.ep,
              " below dp_shard x cp = ", dims.dp_shard_cp(), " with dp_replicate=", dims.dp_replicate,
              ": the experts would be HSDP over (dp_replicate, dp_shard_mod_ep), which is not built yet; give ep = "
              "dp_shard x cp or dp_replicate 1");
  EMBER_CHECK(dims.ep == 1 || dims.tp == 1 || dims.ep == dims.dp_shard_cp(), "parallelize: ep=", dims.ep,
              " below dp_shard x cp = ", dims.dp_shard_cp(), " with tp=", dims.tp,
              " is not built (the ep view and tp meet on no one mesh); give ep = dp_shard x cp");
  // The experts' own FSDP unit (ep below dp_shard x cp, or replicas) would
  // run inside a checkpointed block, which FSDP's units cannot.
  EMBER_CHECK(dims.ep == 1 || experts_on_one_rank(dims) ||
                  nn::ActivationCheckpointing::parse(o.ac).mode == nn::ActivationCheckpointing::Mode::None,
              "parallelize: activation checkpointing '", o.ac, "' with ep=", dims.ep,
              " (dp_replicate=", dims.dp_replicate, " x dp_shard x cp = ", dims.dp_shard_cp(),
              ") is not built: the experts are an FSDP unit of their own there, which cannot run inside a "
              "checkpointed block; give ac none, or ep = dp_shard x cp with dp_replicate 1");
  EMBER_CHECK(dims.cp == 1 || o.cp.seq > 0, "parallelize: cp=", dims.cp,
              " needs the sequence length its ranks split (ParallelizeOptions::cp.seq)");
  if (!(o.ddp && dims.dp_shard == 1 && dims.cp == 1)) check_hsdp_strategy(dims, o.fsdp.strategy);
}

}  // namespace

double Parallelized::clip_grad_norm_(double max_norm) {
  if (fsdp) return fsdp->clip_grad_norm_(max_norm);
  EMBER_CHECK(model != nullptr, "Parallelized::clip_grad_norm_: nothing was parallelized");
  return optim::clip_grad_norm_(model->parameters(), max_norm);  // DDP: every rank holds the averaged gradients
}

Tensor Parallelized::clip_grad_norm_async_(double max_norm) {
  if (fsdp) return fsdp->clip_grad_norm_async_(max_norm);
  EMBER_CHECK(model != nullptr, "Parallelized::clip_grad_norm_async_: nothing was parallelized");
  return optim::clip_grad_norm_async_(model->parameters(), max_norm);
}

void Parallelized::set_requires_gradient_sync(bool sync) {
  if (fsdp)
    fsdp->set_requires_gradient_sync(sync);
  else if (ddp && !sync && !no_sync_)
    no_sync_ = std::make_shared<Replicated::NoSync>(*ddp);
  else if (sync)
    no_sync_.reset();
}

void apply_tp(nn::Module& module, const ParallelDims& dims, const DeviceMesh& mesh, const ParallelizePlan& plan) {
  if (dims.tp == 1) return;
  EMBER_CHECK(!plan.empty(), "parallelize: tp=", dims.tp, " but the model has no tensor-parallel plan");
  parallelize_module(module, mesh.submesh({"tp"}), plan);
}

int apply_ac(nn::Module& module, const std::vector<std::string>& block_types, const std::string& ac) {
  const auto policy = nn::ActivationCheckpointing::parse(ac);
  if (policy.mode == nn::ActivationCheckpointing::Mode::None) return 0;
  EMBER_CHECK(!block_types.empty(), "parallelize: activation checkpointing '", ac,
              "' needs the block types to wrap (ParallelizeOptions::block_types)");
  return nn::apply_activation_checkpointing(module, block_types, policy);
}

FSDPOptions fsdp_options(const ParallelDims& dims, const DeviceMesh& mesh, FSDPOptions o) {
  EMBER_CHECK(o.mesh == nullptr, "parallelize: FSDPOptions::mesh is set; the mesh comes from the ParallelDims (",
              dims.str(), ")");
  if (dims.dp_replicate > 1 || o.strategy == ShardingStrategy::HYBRID_SHARD) {
    check_hsdp_strategy(dims, o.strategy);
    o.strategy = ShardingStrategy::HYBRID_SHARD;
    o.mesh = mesh.submesh({"dp_replicate", "dp_shard"});
  } else {
    o.mesh = dims.fsdp_mesh(mesh);
  }
  return o;
}

std::shared_ptr<FSDPModule> apply_fsdp(const std::shared_ptr<nn::Module>& module, const ParallelDims& dims,
                                       const DeviceMesh& mesh, const std::vector<std::string>& block_types,
                                       FSDPOptions options) {
  return fully_shard_auto(module, {.types = block_types}, fsdp_options(dims, mesh, std::move(options)));
}

namespace {
// The whole model's MoE layers against the layout, before any step changes
// it (every rank sees every stage, so all fail alike, none hangs).
void check_ep(const ParallelDims& dims, const std::vector<nn::Module*>& parts) {
  int64_t layers = 0;
  for (nn::Module* part : parts)
    for (nn::MoE* m : nn::moe_layers(*part)) dims.check_experts(m->options.num_experts), ++layers;
  EMBER_CHECK(dims.ep == 1 || layers > 0, "parallelize: ep=", dims.ep, " but the model has no MoE layer (nn::MoE)");
}
}  // namespace

std::vector<Tensor> apply_ep(nn::Module& module, const ParallelDims& dims, const DeviceMesh& mesh) {
  const std::vector<nn::MoE*> layers = nn::moe_layers(module);
  if (layers.empty()) return {};  // a pipeline stage of dense blocks only
  for (nn::MoE* m : layers) dims.check_experts(m->options.num_experts);
  // The balance loss counts the whole batch's tokens: every data rank's.
  if (dims.dp_cp() > 1) set_moe_balance_group(module, mesh.submesh({dims.cp > 1 ? "dp_cp" : "dp"})->group());
  if (dims.ep == 1) return {};
  expert_parallel(module, mesh.submesh({"ep"}));
  // Over all of dp_shard x cp, each expert lives on one rank: FSDP leaves
  // them alone. Over part of it, apply_expert_fsdp shards them.
  std::vector<Tensor> experts;
  if (experts_on_one_rank(dims))
    for (nn::MoE* m : layers) experts.insert(experts.end(), {m->experts->w1, m->experts->w2, m->experts->w3});
  return experts;
}

void apply_expert_fsdp(nn::Module& module, const ParallelDims& dims, const DeviceMesh& mesh, FSDPOptions o) {
  if (dims.ep == 1 || experts_on_one_rank(dims)) return;
  if (dims.ep == dims.dp_shard_cp()) {
    // Whole on each ep rank, replicated over dp_replicate (HSDP's replicas):
    // their gradients averaged there.
    o.mesh = mesh.submesh({"dp_replicate"});
    o.strategy = ShardingStrategy::NO_SHARD;
  } else {
    o.mesh = mesh.submesh({"dp_shard_mod_ep"});
    if (o.strategy == ShardingStrategy::HYBRID_SHARD) o.strategy = ShardingStrategy::FULL_SHARD;
  }
  for (nn::MoE* m : nn::moe_layers(module)) fully_shard(m->experts, o);
}

void apply_cp(nn::Module& module, const ParallelDims& dims, const DeviceMesh& mesh,
              const cp::ContextParallelOptions& o) {
  if (dims.cp > 1) cp::apply_context_parallel(module, mesh.submesh({"cp"})->group(), o);
}

Parallelized parallelize(const std::shared_ptr<nn::Module>& model, const ParallelDims& dims,
                         const std::shared_ptr<DeviceMesh>& mesh, const ParallelizeOptions& o) {
  EMBER_CHECK(model != nullptr && mesh != nullptr, "parallelize: null model or mesh");
  EMBER_CHECK(dims.pp == 1, "parallelize: pp=", dims.pp, " (a pipeline's stages go through pipeline_parallelize)");
  check_options(dims, o);
  check_ep(dims, {model.get()});
  Parallelized out;
  out.model = model;
  apply_cp(*model, dims, *mesh, o.cp);
  apply_tp(*model, dims, *mesh, o.tp_plan);
  FSDPOptions fsdp = o.fsdp;
  for (const Tensor& p : apply_ep(*model, dims, *mesh)) fsdp.ignored_params.push_back(p);
  out.ac_blocks = apply_ac(*model, o.block_types, o.ac);
  if (o.ddp && dims.dp_shard == 1 && dims.cp == 1) {
    EMBER_CHECK(dims.ep == 1, "parallelize: DDP with ep=", dims.ep, " (expert parallelism goes with FSDP)");
    out.ddp = replicate(model, o.ddp_options, mesh->submesh({"dp_replicate"}));
  } else {
    apply_expert_fsdp(*model, dims, *mesh, fsdp);
    out.fsdp = apply_fsdp(model, dims, *mesh, o.block_types, fsdp);
  }
  return out;
}

PipelineParallel pipeline_parallelize(const std::vector<std::shared_ptr<pp::PipelineStage>>& all_stages,
                                      const pp::Schedule& schedule, const ParallelDims& dims,
                                      const std::shared_ptr<DeviceMesh>& mesh, const ParallelizeOptions& o,
                                      pp::PipelineOptions po) {
  EMBER_CHECK(mesh != nullptr && mesh->has_dim("pp"), "pipeline_parallelize: the mesh has no 'pp' dimension (",
              dims.str(), "; pp > 1 puts it there)");
  EMBER_CHECK(static_cast<int>(all_stages.size()) == schedule.num_stages(), "pipeline_parallelize: ", all_stages.size(),
              " stages for a schedule of ", schedule.num_stages());
  check_options(dims, o);
  std::vector<nn::Module*> parts;
  for (const auto& st : all_stages) parts.push_back(st.get());
  check_ep(dims, parts);
  PipelineParallel out;
  for (const auto& st : all_stages) out.layout.emplace_back(st->description(), schedule.rank_of(st->index()));
  for (int st : schedule.stages_of(mesh->coordinate("pp"))) {
    out.stages.push_back(all_stages[st]);
    // A stage's share of the plan: the embedding's entries only where it holds the embedding.
    apply_cp(*all_stages[st], dims, *mesh, o.cp);
    apply_tp(*all_stages[st], dims, *mesh, plan_for(o.tp_plan, *all_stages[st]));
  }
  std::vector<FSDPOptions> fsdp(out.stages.size(), o.fsdp);
  for (size_t i = 0; i < out.stages.size(); ++i)
    for (const Tensor& p : apply_ep(*out.stages[i], dims, *mesh)) fsdp[i].ignored_params.push_back(p);
  for (auto& st : out.stages) out.ac_blocks += apply_ac(*st, o.block_types, o.ac);
  // FSDP over dp_shard x cp: cp ranks hold different tokens' gradients, so
  // they are sharded (and reduced) even when dp_shard is 1.
  if (dims.dp_shard_cp() > 1)
    for (size_t i = 0; i < out.stages.size(); ++i) {
      apply_expert_fsdp(*out.stages[i], dims, *mesh, fsdp[i]);
      out.fsdp.push_back(apply_fsdp(out.stages[i], dims, *mesh, o.block_types, fsdp[i]));
    }
  out.part = pp::rank_part(out.stages);
  if (po.dp_group == nullptr && dims.dp_replicate > 1 && out.fsdp.empty()) po.dp_group = mesh->group("dp_replicate");
  out.pipe = std::make_unique<pp::Pipeline>(schedule, out.stages, mesh->group("pp"), std::move(po));
  return out;
}

}  // namespace ember::distributed
