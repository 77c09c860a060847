// DistributedDataParallel: data parallelism over a ProcessGroup, PyTorch's
// DDP semantics. Construction checks that every rank holds the same
// parameters and broadcasts rank 0's parameters and buffers. During
// backward, gradients land in flat per-bucket buffers (each parameter's
// .grad() is a view into its bucket, so no copy is made per step); a
// bucket's allreduce starts as soon as its last gradient is ready, so
// communication overlaps the rest of backward. Backward returns once every
// bucket is averaged, so optimizer.step() can follow at once.
//
//   auto ddp = std::make_shared<distributed::DistributedDataParallel>(model);  // or replicate(model)
//   optim::SGD opt(ddp->parameters(), {.lr = 0.1});
//   for (auto& [x, y] : loader) {
//     opt.zero_grad();
//     nn::functional::cross_entropy((*ddp)(x), y).backward();
//     opt.step();
//   }
//
// Gradient accumulation: inside ddp->no_sync() backward only accumulates
// locally; the first backward outside it synchronizes the accumulated sum
// (GradientAccumulator wraps the pattern).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distributed/comm/process_group.h"
#include "distributed/device_mesh.h"
#include "nn/module.h"

namespace ember::distributed {

// One gradient bucket, as a hook sees it (torch's dist.GradBucket): its
// index (buckets are reduced in index order, the same on every rank), the
// flat buffer in the parameters' dtype, and each parameter's gradient as a
// view of it in its parameter's shape, in buffer order (what PowerSGD
// compresses matrix by matrix).
struct GradBucket {
  int index = 0;
  Tensor buffer;
  std::vector<Tensor> gradients;
  bool is_last = false;  // the last bucket of a backward pass (a hook's once-per-step work)
};

// A communication hook, as torch's DDP.register_comm_hook: reduces one
// gradient bucket over the ranks of `pg`, in place, averaged when `average`
// (else summed). It returns at once; the returned Work's wait() leaves the
// result in `bucket.buffer`. Every rank must run the same hook (the
// collectives' signature check names a mismatch). A hook may keep state
// across steps (by bucket index: PowerSGD's).
using CommHook = std::function<std::shared_ptr<Work>(ProcessGroup& pg, const GradBucket& bucket, bool average)>;

// The default: allreduce of the bucket as it is.
CommHook allreduce_hook();
// Gradient compression, as torch's default_hooks.fp16_compress_hook /
// bf16_compress_hook: the bucket is cast to float16 (bfloat16), divided by
// the world size before the sum (so a float16 sum cannot overflow where the
// average would not), allreduced in the low dtype (half the bytes on the
// wire) and cast back. Gradients lose the low dtype's precision, once per
// step: float16 keeps 11 significant bits but flushes values below 6e-8
// (2^-24) to zero, bfloat16 keeps float32's range with 8 bits.
CommHook fp16_compress_hook();
CommHook bf16_compress_hook();

struct DDPOptions {
  // Null: the default group from init_process_group.
  std::shared_ptr<ProcessGroup> process_group = nullptr;
  // Bucket capacity; parameters are assigned in reverse registration order
  // (roughly the order backward produces their gradients).
  double bucket_cap_mb = 25.0;
  // The first bucket (the last layers) is small so communication starts early.
  double first_bucket_cap_mb = 1.0;
  // false: every allreduce starts after backward has finished (for
  // measuring what overlap buys).
  bool overlap = true;
  // Broadcast rank 0's buffers (batch-norm running stats) before each forward.
  bool broadcast_buffers = true;
  // Parameters that get no gradient in a backward: true marks them ready with
  // zero gradients so the step completes; false is an error naming them.
  bool find_unused_parameters = false;
  // Average (divide by world size) after the sum, as PyTorch does.
  bool average = true;
  // How each bucket is reduced; null: allreduce_hook().
  CommHook comm_hook = nullptr;
};

// Data parallelism as an in-place transform of a module (torch's composable
// replicate()): the module itself gets a forward pre-hook (broadcast rank
// 0's buffers, arm the gradient synchronization of the next backward) and
// gradient hooks on its parameters (buckets, allreduce as gradients become
// ready); the reducer's state lives on the module (Module::transform_state),
// so a model is parallelised as a sequence of transforms (tensor parallel,
// fully_shard, replicate) and called as itself:
//
//   auto rep = distributed::replicate(model);          // every rank; the default group
//   loss_fn((*model)(x), y).backward();                // gradients averaged over the ranks
//
// `mesh`: a 1-D mesh to replicate over (null: DDPOptions::process_group, or
// the default group). Replicating a module twice is an error.
class Replicated {
 public:
  struct Impl;
  explicit Replicated(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  ProcessGroup& process_group() const;
  nn::Module& module() const;

  // RAII scope: backward inside it does not synchronize (gradients only
  // accumulate locally).
  class NoSync {
   public:
    explicit NoSync(Replicated& rep);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    std::shared_ptr<Impl> impl_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Bucket layout, for tests and logging: parameter indices (registration
  // order) per bucket, in the order buckets are reduced.
  std::vector<std::vector<int64_t>> bucket_indices() const;

  // Takes the transform off the module: its hooks do nothing from now on
  // and the module trains as a plain one.
  void remove();

 private:
  friend int64_t join_uneven_inputs(Replicated& rep, const std::function<void()>& body);
  std::shared_ptr<Impl> impl_;
};

std::shared_ptr<Replicated> replicate(const std::shared_ptr<nn::Module>& module, const DDPOptions& options = {},
                                      std::shared_ptr<DeviceMesh> mesh = nullptr);
// The Replicated state on `module`, or null.
std::shared_ptr<Replicated> replicated_of(const nn::Module& module);

// torch's DistributedDataParallel, the user-facing wrapper: replicate() on
// the wrapped module, taken off again when the wrapper goes (the model then
// trains as a plain module). (*ddp)(x) runs the wrapped module.
class DistributedDataParallel : public nn::Module {
 public:
  explicit DistributedDataParallel(std::shared_ptr<nn::Module> module, DDPOptions options = {});
  ~DistributedDataParallel() override;

  Tensor forward(const Tensor& x) override { return (*module_)(x); }

  nn::Module& module() { return *module_; }
  std::shared_ptr<nn::Module> module_ptr() const { return module_; }
  ProcessGroup& process_group() { return rep_->process_group(); }
  Replicated& replicated() { return *rep_; }

  using NoSync = Replicated::NoSync;
  NoSync no_sync() { return rep_->no_sync(); }
  std::vector<std::vector<int64_t>> bucket_indices() const { return rep_->bucket_indices(); }

 private:
  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<Replicated> rep_;
};

// Gradient accumulation over k micro-batches with one synchronization:
//
//   GradientAccumulator acc(ddp, k);
//   for (int i = 0; i < k; ++i) acc.backward(loss_fn((*ddp)(x[i]), y[i]));
//   opt.step();
//
// backward() scales the loss by 1/k and runs micro-steps 1..k-1 inside
// no_sync; the k-th synchronizes. The count wraps around after k.
class GradientAccumulator {
 public:
  GradientAccumulator(Replicated& rep, int steps);
  GradientAccumulator(DistributedDataParallel& ddp, int steps) : GradientAccumulator(ddp.replicated(), steps) {}
  // Returns true when this call synchronized (the last micro-step).
  bool backward(const Tensor& loss);
  // The same, with the forward run by `loss_fn` inside no_sync() on the
  // micro-steps that do not synchronize (PyTorch's pattern). Needed inside
  // join_uneven_inputs, where ranks learn at forward time whether the
  // backward that follows synchronizes.
  bool backward(const std::function<Tensor()>& loss_fn);
  int steps() const { return steps_; }

 private:
  Replicated& rep_;
  int steps_;
  int done_ = 0;
};

// Uneven inputs, as torch.distributed.algorithms.Join([ddp]) with DDP's
// default (gradients divided by the initial world size): runs `body`, this
// rank's training loop; when a rank's data runs out before the others', it
// does not leave them hanging in their next allreduce but shadows their
// steps (contributing zero gradients, receiving their buffers) until every
// rank's body has returned. Returns the number of steps this rank shadowed.
//
//   int64_t shadowed = distributed::join_uneven_inputs(*ddp, [&] {
//     for (auto& b : loader) { ...; loss((*ddp)(x), y).backward(); opt.step(); }
//   });
//
// Inside, every forward adds one small allreduce (which ranks are still
// training, and whether this step synchronizes gradients), and buffers come
// from the highest-ranked rank still training. Every rank must call it, and
// the body must use this DDP's forward/backward only (SyncBatchNorm or other
// collectives in the body are not shadowed: the signature check names the
// mismatch).
int64_t join_uneven_inputs(Replicated& rep, const std::function<void()>& body);
inline int64_t join_uneven_inputs(DistributedDataParallel& ddp, const std::function<void()>& body) {
  return join_uneven_inputs(ddp.replicated(), body);
}

// Makes every nn::BatchNorm2d under `module` a SyncBatchNorm: in training,
// batch statistics are computed over all ranks of `pg` (null: the default
// group), forward and backward. C++ parents hold typed pointers to their
// children, so modules are not replaced: each BatchNorm2d gets a hook that
// sums its per-channel statistics across ranks (functional::all_reduce,
// differentiable).
// Names, parameters and buffers stay as they are.
void convert_sync_batchnorm(nn::Module& module, std::shared_ptr<ProcessGroup> pg = nullptr);

}  // namespace ember::distributed
