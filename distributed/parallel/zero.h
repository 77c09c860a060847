// ZeroRedundancyOptimizer: optimizer-state sharding (ZeRO stage 1, torch's
// torch.distributed.optim.ZeroRedundancyOptimizer). Every rank keeps the
// optimizer state (Adam's moments, SGD's momentum) of 1/N of the parameter
// elements only, steps that shard, and an all-gather brings every rank the
// whole updated model. Gradients still come from DDP (averaged on every
// rank), so it composes with DistributedDataParallel, GradientAccumulator,
// GradScaler, clipping and LR schedulers like any optimizer.
//
//   auto ddp = std::make_shared<distributed::DistributedDataParallel>(model);
//   distributed::ZeroRedundancyOptimizer opt(ddp->parameters(), [](std::vector<optim::ParamGroup> g) {
//     return std::make_unique<optim::Adam>(std::move(g), optim::AdamOptions{.lr = 1e-3});
//   });
//   ... opt.zero_grad(); loss.backward(); opt.step();
//   opt.consolidate_state_dict(0);                   // every rank calls it
//   if (rank == 0) save(opt.state_dict());            // the plain Adam format
//
// How it shards: the parameters of each group (per dtype and device) are
// adopted into one distributed::FlatBuffer padded to the world size, so they
// become views of it, and rank r owns the elements of its shard r, whatever
// the tensor sizes (torch shards whole tensors, which leaves ranks uneven:
// 2:1 on four ranks for a 4-layer MLP). Each part of a parameter inside the
// shard is one parameter of the local optimizer (a view of the flat buffer,
// its gradient a view of the parameter's gradient): no copies, and a
// parameter without a gradient is skipped exactly as torch skips it. After
// the local step, one in-place all-gather per buffer updates every rank.
// Per-rank state bytes are full/N, plus a few step counters.
//
// Like set_data, construction moves the parameters' storage: build it after
// the model is on its device and before the first forward.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distributed/comm/process_group.h"
#include "distributed/parallel/flat_buffer.h"
#include "optim/optimizer.h"

namespace ember::distributed {

// Builds the local optimizer over the shard's parameters (torch's
// optimizer_class plus its defaults).
using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

struct ZeroOptions {
  // Null: the default group from init_process_group.
  std::shared_ptr<ProcessGroup> process_group = nullptr;
};

class ZeroRedundancyOptimizer : public optim::Optimizer {
 public:
  ZeroRedundancyOptimizer(std::vector<Tensor> params, const OptimizerFactory& make, ZeroOptions options = {});
  ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, const OptimizerFactory& make,
                          ZeroOptions options = {});
  ~ZeroRedundancyOptimizer() override;

  // Steps this rank's shard with the local optimizer (hyperparameters taken
  // from param_groups(), so schedulers work), then all-gathers the updated
  // parameters. Every rank must call it.
  void step() override;
  // The same, skipped when found_inf > 0: decided on the device when the
  // local optimizer can (the all-gather then moves unchanged parameters).
  void step_unless_inf(const Tensor& found_inf) override;
  bool skips_on_device() const override { return local_->skips_on_device(); }

  // The state of the whole model, gathered onto rank `to` (torch's
  // consolidate_state_dict). Every rank must call it; afterwards
  // state_dict() on `to` returns it in the format of the local optimizer
  // type, equal to what that optimizer unsharded would hold.
  void consolidate_state_dict(int to = 0);
  // On the consolidating rank after consolidate_state_dict: the full state.
  // Elsewhere (or before): an error naming the rank, as torch's.
  optim::OptimizerStateDict state_dict() const override;
  // This rank's state, each piece described as the run of its parameter it
  // covers (a ShardSpec): a sharded checkpoint writes it from every rank,
  // no consolidation. Not collective.
  std::vector<LocalState> local_state() const override;
  // Takes a full state dict (every rank passes the same, e.g. loaded from
  // one file) and keeps this rank's shard of it.
  void load_state_dict(const optim::OptimizerStateDict& sd) override;

  std::vector<std::string> state_names() const override;
  optim::Optimizer& local_optimizer() { return *local_; }
  // Bytes of optimizer state this rank holds.
  int64_t local_state_bytes() const;
  ProcessGroup& process_group() { return *pg_; }

  struct Impl;

 protected:
  void validate(const optim::Options& o) const override;

 private:
  struct Built;
  void step_impl(const Tensor* found_inf);
  ZeroRedundancyOptimizer(Built built);
  std::shared_ptr<ProcessGroup> pg_;
  std::unique_ptr<optim::Optimizer> local_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ember::distributed
