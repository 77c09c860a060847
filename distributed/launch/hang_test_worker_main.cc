// The worker hang_diagnosis_test runs under //tools:launch: a small job that
// goes wrong in one chosen way, so the launcher's teardown and fr_trace have
// a real hang to explain. EMBER_DIST_TIMEOUT_SEC bounds every wait.
//
//   hang_test_worker skip_allreduce   4 ranks, a 2x2 mesh (dp_shard, tp):
//                                     rank 2 skips its dp_shard all-reduce at
//                                     step 5, then computes on
//   hang_test_worker allgather_size   4 ranks: rank 1's all-gather at step 2
//                                     has 8 elements, the others' 4
//   hang_test_worker pp_no_send       2 ranks, a 2-stage GPipe pipeline:
//                                     stage 0 stalls in the forward of
//                                     micro-batch 2 and never sends it
//   hang_test_worker freeze           4 ranks: rank 1 stops itself (SIGSTOP)
//                                     at step 3
//   hang_test_worker healthy          all-reduces for about 4 s, then exits 0
//                                     (the launcher's SIGUSR1 forwarding)
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "core/ops.h"
#include "distributed/device_mesh.h"
#include "distributed/init.h"
#include "distributed/parallel/pp/pipeline.h"
#include "distributed/parallel/pp/stage.h"
#include "nn/functional.h"
#include "nn/layers.h"

namespace ember::distributed {
namespace {

// Long enough for any teardown: the launcher ends us first.
void stall() { std::this_thread::sleep_for(std::chrono::seconds(120)); }

void skip_allreduce(int rank) {
  auto mesh = DeviceMesh::create({2, 2}, {"dp_shard", "tp"});
  auto dp = mesh->group("dp_shard");
  Tensor g = ones({256});
  for (int step = 0; step < 8; ++step) {
    if (rank == 2 && step == 5) {
      std::fprintf(stderr, "rank 2 skips the all-reduce of step 5\n");
      stall();
    }
    dp->allreduce(g)->wait();
  }
  default_group()->barrier()->wait();
}

void allgather_size(int rank) {
  auto pg = default_group();
  for (int step = 0; step < 4; ++step) {
    const int64_t n = rank == 1 && step == 2 ? 8 : 4;
    Tensor out = zeros({n * pg->size()});
    pg->allgather_into_tensor(out, ones({n}))->wait();
  }
}

// Stalls on its `at`-th forward (0-based).
class Stall : public nn::Module {
 public:
  explicit Stall(int at) : nn::Module("Stall"), at_(at) {}
  Tensor forward(const Tensor& x) override {
    if (calls_++ == at_) {
      std::fprintf(stderr, "stage 0 stalls in the forward of micro-batch %d\n", at_);
      stall();
    }
    return x;
  }

 private:
  int at_, calls_ = 0;
};

void pp_no_send(int rank) {
  manual_seed(1);
  nn::Sequential seq;
  seq.push_back(std::make_shared<nn::Linear>(8, 8));
  seq.push_back(std::make_shared<Stall>(rank == 0 ? 2 : -1));
  seq.push_back(std::make_shared<nn::Linear>(8, 8));
  seq.push_back(std::make_shared<nn::Linear>(8, 8));
  auto stages = pp::split_sequential(seq, 2, {2, 2});  // the stall on stage 0
  const pp::Schedule sched = pp::make_schedule("gpipe", 2, 1, 4);
  pp::Pipeline pipe(sched, {stages[rank]}, default_group(),
                    {.loss = [](const Tensor& y, const Tensor& t) { return nn::functional::mse_loss(y, t); }});
  std::vector<Tensor> xs, ys;
  for (int m = 0; m < 4; ++m) xs.push_back(randn({2, 8})), ys.push_back(randn({2, 8}));
  pipe.step(xs, ys);
}

void freeze(int rank) {
  auto pg = default_group();
  Tensor g = ones({64});
  for (int step = 0; step < 6; ++step) {
    if (rank == 1 && step == 3) {
      std::fprintf(stderr, "rank 1 freezes (SIGSTOP) at step 3\n");
      ::raise(SIGSTOP);
    }
    pg->allreduce(g)->wait();
  }
}

void healthy(int rank) {
  auto pg = default_group();
  Tensor g = ones({64});
  for (int step = 0; step < 40; ++step) {
    pg->allreduce(g)->wait();
    if (step == 0) std::fprintf(stderr, "healthy: rank %d ready\n", rank);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace
}  // namespace ember::distributed

int main(int argc, char** argv) {
  using namespace ember::distributed;
  const std::string scenario = argc > 1 ? argv[1] : "";
  init_process_group();
  const int rank = get_rank();
  if (scenario == "skip_allreduce") {
    skip_allreduce(rank);
  } else if (scenario == "allgather_size") {
    allgather_size(rank);
  } else if (scenario == "pp_no_send") {
    pp_no_send(rank);
  } else if (scenario == "freeze") {
    freeze(rank);
  } else if (scenario == "healthy") {
    healthy(rank);
  } else {
    std::fprintf(stderr, "hang_test_worker: unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  destroy_process_group();
  return 0;
}
