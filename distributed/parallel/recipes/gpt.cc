// The GPT recipes (gpt.h): the library's parallelize steps with the GPT's
// tensor-parallel plan and block type.
#include "distributed/parallel/recipes/gpt.h"

#include <utility>

#include "distributed/parallel/tp/gpt_plan.h"

namespace ember::distributed {

ParallelizeOptions gpt_parallelize_options(const nn::GPT& gpt, const GPTParallelOptions& o) {
  ParallelizeOptions p{.tp_plan = gpt_tp_plan(gpt, o.sequence_parallel),
                       .block_types = {"TransformerBlock"},
                       .ac = o.ac,
                       .fsdp = o.fsdp};
  p.cp = o.cp;
  return p;
}

Parallelized parallelize_gpt(const std::shared_ptr<nn::GPT>& gpt, const ParallelDims& dims,
                             const std::shared_ptr<DeviceMesh>& mesh, const GPTParallelOptions& o) {
  return parallelize(gpt, dims, mesh, gpt_parallelize_options(*gpt, o));
}

PipelineParallel pipeline_gpt(const std::shared_ptr<nn::GPT>& gpt, const ParallelDims& dims,
                              const std::shared_ptr<DeviceMesh>& mesh, const pp::Schedule& schedule,
                              const GPTParallelOptions& o, pp::PipelineOptions po) {
  const auto stages = pp::split_gpt(*gpt, schedule.num_stages(), o.blocks_per_stage);
  return pipeline_parallelize(stages, schedule, dims, mesh, gpt_parallelize_options(*gpt, o), std::move(po));
}

}  // namespace ember::distributed
