// Sharded checkpoint throughput on 2 ranks (processes), the workload of
// bench/peers/torch2/dcp_peer.py: the GPT of fsdp_bench (6 layers, d 512,
// 27.4 M parameters) under fully_shard FULL_SHARD with AdamW state, about
// 330 MB per checkpoint over both ranks.
//
//   BM_CkptSave   save_sharded_checkpoint (fsynced, committed), GB/s of all ranks' data
//   BM_CkptLoad   load_sharded_checkpoint of that checkpoint into the same layout
//   BM_CkptAsync  AsyncCheckpointer: how long save() blocks the training loop
//                 (blocking_ms) beside the plain host copy of the same state
//                 (host_copy_ms), and how long until the checkpoint is committed
//   BM_DiskWrite  the disk's raw sequential write of the same bytes (one file per
//                 rank, written and fsynced in parallel): the ceiling for saves
//
//   bazel run -c opt //bench:ckpt_bench
//   bench/ckpt_compare.py --ours bazel-bin/bench/ckpt_bench   # beside PyTorch DCP, interleaved
//
// Checkpoints go to $EMBER_CKPT_BENCH_DIR (default $TMPDIR or /tmp). Loads
// read from the page cache the save just filled, as DCP's do in the peer.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_group.h"
#include "core/ops.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/comm/backends.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "nn/functional.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

constexpr int kWorld = 2;

std::string bench_dir() {
  const char* d = std::getenv("EMBER_CKPT_BENCH_DIR");
  const char* t = std::getenv("TMPDIR");
  return std::string(d && *d ? d : t && *t ? t : "/tmp") + "/ember_ckpt_bench";
}

struct Trained {
  std::shared_ptr<nn::GPT> gpt;
  std::shared_ptr<distributed::FSDPModule> fsdp;
  std::unique_ptr<optim::AdamW> opt;
  int64_t local_bytes = 0;  // this rank's parameters and optimizer state
};

Trained build(distributed::ProcessGroup& pg) {
  Trained t;
  manual_seed(0);
  t.gpt = std::make_shared<nn::GPT>(
      nn::GPTOptions{.vocab_size = 8192, .block_size = 128, .n_layer = 6, .n_head = 8, .n_embd = 512});
  distributed::FSDPOptions o;
  o.mesh = distributed::DeviceMesh::from_group(
      std::shared_ptr<distributed::ProcessGroup>(&pg, [](distributed::ProcessGroup*) {}), "dp_shard");
  t.fsdp = distributed::fully_shard_auto(t.gpt, {.types = {"TransformerBlock"}}, o);
  t.opt = std::make_unique<optim::AdamW>(t.gpt->parameters(), optim::AdamWOptions{.lr = 1e-3});
  manual_seed(1000 + pg.rank());
  Tensor x = randint(0, 8192, {1, 128}), y = randint(0, 8192, {128});
  nn::functional::cross_entropy((*t.gpt)(x).reshape({-1, 8192}), y).backward();
  t.opt->step();
  for (const Tensor& p : t.gpt->parameters()) {
    t.local_bytes += static_cast<int64_t>(p.nbytes());
    for (const auto& [n, s] : t.opt->state(p)) t.local_bytes += static_cast<int64_t>(s.nbytes());
  }
  return t;
}

// Sum over the ranks.
double total(distributed::ProcessGroup& pg, double mine) {
  Tensor t = full({1}, mine, DType::Float64);
  pg.allreduce(t)->wait();
  return t.item();
}

void BM_CkptSave(benchmark::State& state) {
  auto g = bench::join_group("BM_CkptSave", kWorld);
  Trained t = build(*g->pg);
  const std::string dir = bench_dir() + "/save";
  const double bytes = total(*g->pg, static_cast<double>(t.local_bytes));
  const double median = bench::timed_median(state, g->pg.get(), [&] {
    absl::Status s = distributed::save_sharded_checkpoint(dir, *t.gpt, t.opt.get(), nullptr, {}, *g->pg);
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
    return s.ok();
  });
  state.counters["GB_per_s"] = bytes / median / 1e9;
  state.counters["save_ms"] = median * 1e3;
  state.counters["MB_total"] = bytes / 1e6;
}

void BM_CkptLoad(benchmark::State& state) {
  auto g = bench::join_group("BM_CkptLoad", kWorld);
  Trained t = build(*g->pg);
  const std::string dir = bench_dir() + "/load";
  const double bytes = total(*g->pg, static_cast<double>(t.local_bytes));
  if (!distributed::save_sharded_checkpoint(dir, *t.gpt, t.opt.get(), nullptr, {}, *g->pg).ok()) {
    state.SkipWithError("save failed");
    return;
  }
  const double median = bench::timed_median(state, g->pg.get(), [&] {
    auto s = distributed::load_sharded_checkpoint(dir, *t.gpt, t.opt.get(), nullptr, *g->pg);
    if (!s.ok()) state.SkipWithError(std::string(s.status().message()).c_str());
    return s.ok();
  });
  state.counters["GB_per_s"] = bytes / median / 1e9;
  state.counters["load_ms"] = median * 1e3;
}

void BM_CkptAsync(benchmark::State& state) {
  auto g = bench::join_group("BM_CkptAsync", kWorld);
  Trained t = build(*g->pg);
  // The background thread's own group, on the same store under a prefix.
  distributed::AsyncCheckpointer ckpt(distributed::make_gloo_group(
      std::make_shared<distributed::PrefixStore>("async_ckpt", g->store), g->pg->rank(), kWorld));
  const std::string dir = bench_dir() + "/async";
  std::vector<double> complete, copy, blocking;
  const double median = bench::timed_median(state, g->pg.get(), [&] {
    absl::Status s = ckpt.save(dir, *t.gpt, t.opt.get(), nullptr, {}, *g->pg);
    blocking.push_back(ckpt.last_staging_seconds());
    const auto t0 = bench::Clock::now();
    if (s.ok()) s = ckpt.wait();
    complete.push_back(ckpt.last_staging_seconds() + std::chrono::duration<double>(bench::Clock::now() - t0).count());
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
    return s.ok();
  });
  // The plain host copy of the same tensors, for the blocking target: both
  // ranks at once, as they stage at once (they share the memory bandwidth).
  for (int i = 0; i < 3; ++i) {
    g->pg->barrier()->wait();
    const auto t0 = bench::Clock::now();
    std::vector<Tensor> copies;
    for (const Tensor& p : t.gpt->parameters()) {
      copies.push_back(p.detach().clone());
      for (const auto& [n, s] : t.opt->state(p)) copies.push_back(s.clone());
    }
    copy.push_back(std::chrono::duration<double>(bench::Clock::now() - t0).count());
  }
  std::sort(complete.begin(), complete.end());
  std::sort(copy.begin(), copy.end());
  std::sort(blocking.begin(), blocking.end());
  state.counters["blocking_ms"] = blocking[blocking.size() / 2] * 1e3;
  state.counters["host_copy_ms"] = copy[copy.size() / 2] * 1e3;
  state.counters["complete_ms"] = complete[complete.size() / 2] * 1e3;
  state.counters["save_call_ms_median"] = median * 1e3;
}

void BM_DiskWrite(benchmark::State& state) {
  auto g = bench::join_group("BM_DiskWrite", kWorld);
  Trained t = build(*g->pg);
  std::filesystem::create_directories(bench_dir());
  const std::string path = bench_dir() + "/raw-" + std::to_string(g->pg->rank());
  std::vector<char> buf(static_cast<size_t>(t.local_bytes), 1);
  const double bytes = total(*g->pg, static_cast<double>(t.local_bytes));
  const double median = bench::timed_median(state, g->pg.get(), [&] {
    g->pg->barrier()->wait();
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    size_t done = 0;
    while (fd >= 0 && done < buf.size()) {
      const ssize_t w = ::write(fd, buf.data() + done, std::min<size_t>(buf.size() - done, 8 << 20));
      if (w <= 0) break;
      done += static_cast<size_t>(w);
    }
    if (fd >= 0) ::fsync(fd), ::close(fd);
    g->pg->barrier()->wait();
    return done;
  });
  std::filesystem::remove(path);
  state.counters["GB_per_s"] = bytes / median / 1e9;
  state.counters["write_ms"] = median * 1e3;
}

BENCHMARK(BM_DiskWrite)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CkptSave)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CkptLoad)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CkptAsync)->Iterations(5)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace ember

