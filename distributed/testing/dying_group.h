// A process group whose last rank dies (_exit(42)) a moment into one
// chosen collective: the failure tests of ZeRO and FSDP kill a peer in the
// middle of a parameter all-gather or a gradient reduce-scatter, and check
// that the survivors fail fast naming the collective and the rank.
//
//   auto pg = std::make_shared<DyingGroup>(make_gloo_group(...), "reduce_scatter_tensor", /*after=*/0);
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distributed/comm/backends.h"
#include "distributed/comm/process_group.h"
#include "distributed/init.h"
#include "distributed/store/store.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed::testing {

class DyingGroup : public ProcessGroup {
 public:
  // The last rank dies 2 ms into its call number after + 1 of `op`
  // ("allgather_into_tensor" or "reduce_scatter_tensor"), after issuing it.
  DyingGroup(std::shared_ptr<ProcessGroup> inner, std::string op, int after = 0)
      : ProcessGroup(inner->rank(), inner->size()), inner_(std::move(inner)), op_(std::move(op)), left_(after) {}
  std::string backend_name() const override { return inner_->backend_name(); }
  Device device() const override { return inner_->device(); }

 protected:
  std::shared_ptr<Work> do_allreduce(const Tensor& t, ReduceOp op) override { return inner_->allreduce(t, op); }
  std::shared_ptr<Work> do_broadcast(const Tensor& t, int root) override { return inner_->broadcast(t, root); }
  std::shared_ptr<Work> do_reduce(const Tensor& t, int root, ReduceOp op) override {
    return inner_->reduce(t, root, op);
  }
  std::shared_ptr<Work> do_allgather(const std::vector<Tensor>& outs, const Tensor& in) override {
    return inner_->allgather(outs, in);
  }
  std::shared_ptr<Work> do_allgather_into_tensor(const Tensor& out, const Tensor& in) override {
    return maybe_die("allgather_into_tensor", inner_->allgather_into_tensor(out, in));
  }
  std::shared_ptr<Work> do_reduce_scatter_tensor(const Tensor& out, const Tensor& in, ReduceOp op,
                                                 bool consume) override {
    return maybe_die("reduce_scatter_tensor", consume ? inner_->reduce_scatter_tensor_consuming_input(out, in, op)
                                                      : inner_->reduce_scatter_tensor(out, in, op));
  }
  std::shared_ptr<Work> do_all_to_all_single(const Tensor& out, const Tensor& in) override {
    return inner_->all_to_all_single(out, in);
  }
  std::shared_ptr<Work> do_all_to_all_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& out_elems,
                                        const std::vector<int64_t>& in_elems) override {
    auto rows = [](const std::vector<int64_t>& elems, const Tensor& t) {
      std::vector<int64_t> r;
      const int64_t row = t.sizes()[0] ? t.numel() / t.sizes()[0] : 1;
      for (int64_t e : elems) r.push_back(row ? e / row : 0);
      return r;
    };
    return inner_->all_to_all_single(out, in, rows(out_elems, out), rows(in_elems, in));
  }
  std::shared_ptr<Work> do_barrier() override { return inner_->barrier(); }
  std::shared_ptr<Work> do_send(const Tensor& t, int dst, int tag) override { return inner_->send(t, dst, tag); }
  std::shared_ptr<Work> do_recv(const Tensor& t, int src, int tag) override { return inner_->recv(t, src, tag); }

 private:
  std::shared_ptr<Work> maybe_die(const char* op, std::shared_ptr<Work> w) {
    if (op_ == op && rank() == size() - 1 && left_-- == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::fflush(stdout);
      _exit(42);
    }
    return w;
  }
  std::shared_ptr<ProcessGroup> inner_;
  std::string op_;
  int left_;
};

// A Gloo group of the worker's rank wrapped in a DyingGroup. The timeout is
// long (60 s), so failing fast cannot mean waiting for it: Gloo notices the
// dead peer when a socket reports it, else the group's liveness check finds
// the rank gone at the store within a second or two. The store client
// speaks for its rank, as init_process_group's does, so the store knows when
// a rank leaves without its goodbye.
inline std::shared_ptr<DyingGroup> dying_gloo_group(const WorkerEnv& env, std::string op, int after = 0) {
  ProcessGroupOptions po;
  po.timeout = std::chrono::seconds(60);
  TCPStoreOptions so;
  so.rank = env.rank;
  so.timeout = std::chrono::seconds(30);
  auto store = std::make_shared<TCPStore>(env.store_host, env.store_port, so);
  return std::make_shared<DyingGroup>(make_gloo_group(store, env.rank, env.world_size, po), std::move(op), after);
}

}  // namespace ember::distributed::testing
