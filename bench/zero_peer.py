# torch.distributed's ZeroRedundancyOptimizer (ZeRO stage 1: Adam state
# sharded over ranks, gradients all-reduced by DDP, updated parameters
# broadcast back by their owners) against plain DDP + Adam, over Gloo on CPU,
# N processes on localhost. Workload (the C++ side implements the same):
#   model: Linear(2048,4096) ReLU Linear(4096,4096) ReLU Linear(4096,4096) ReLU
#          Linear(4096,2048), float32, torch.manual_seed(0) on every rank
#          (50,345,984 parameters)
#   data:  per rank x = randn([batch, 2048]) with seed 1000+rank,
#          y = randn([batch, 2048]) with seed 2000+rank; loss = mse_loss(model(x), y)
#   modes: ddp  = DistributedDataParallel(model) + Adam(lr=1e-3)
#          zero = DistributedDataParallel(model) + ZeroRedundancyOptimizer(
#                     params, optimizer_class=Adam, lr=1e-3,
#                     parameters_as_bucket_view=--bucket-view)
#   step:  zero_grad(set_to_none=True), forward, backward, optimizer.step;
#          every rank times each step (perf_counter) after a dist.barrier() at
#          its start; --warmup untimed steps, then --steps timed ones.
# Reported per mode: rank 0's median step ms and the max over ranks of each
# rank's median; per rank, the bytes of every tensor in the rank-local
# optimizer state (ZeRO: opt.optim.state, Adam: opt.state; `step` tensors
# included) and the process's peak RSS (ru_maxrss) at the end.
# Each mode runs in its own freshly spawned process group, so memory figures
# are never mixed; modes are interleaved over --rounds.
#
# zero_grad is called with set_to_none=True explicitly: the default differs
# between torch 1.x (False) and 2.x (True). Adam runs its single-tensor
# (for-loop) implementation on CPU in both 1.13 and 2.x.
#
# Usage: /usr/bin/python3 bench/zero_peer.py [--modes ddp,zero] [--nproc 2]
#            [--batch 32] [--steps 10] [--warmup 3] [--rounds 1] [--threads 1]
#            [--bucket-view] [--json]
import argparse, json, resource, socket, statistics, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = ["ddp", "zero"]
IN, HIDDEN, OUT = 2048, 4096, 2048


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def state_bytes(state):
    """Bytes of every tensor in an optimizer's per-parameter state dict."""
    total = 0
    for per_param in state.values():
        for v in per_param.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


def worker(rank, world, port, mode, a, out_q):
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = make_model()
    nparams = sum(p.numel() for p in model.parameters())
    ddp = DDP(model)
    if mode == "ddp":
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    else:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                      parameters_as_bucket_view=a.bucket_view)
    x = torch.randn(a.batch, IN, generator=torch.Generator().manual_seed(1000 + rank))
    y = torch.randn(a.batch, OUT, generator=torch.Generator().manual_seed(2000 + rank))

    times = []
    for i in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if i >= a.warmup:
            times.append((t1 - t0) * 1e3)
    final_loss = loss.item()

    local_state = opt.optim.state if mode == "zero" else opt.state
    mine = dict(median=statistics.median(times), times=times, state_bytes=state_bytes(local_state),
                rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, loss=final_loss)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        row = dict(peer="torch", torch=torch.__version__, mode=mode, nproc=world, params=nparams,
                   batch=a.batch, steps=a.steps, warmup=a.warmup, threads=a.threads,
                   bucket_view=a.bucket_view if mode == "zero" else None,
                   step_ms_median=gathered[0]["median"],
                   step_ms_max_rank_median=max(g["median"] for g in gathered),
                   step_ms_rank_medians=[g["median"] for g in gathered],
                   optim_state_bytes=[g["state_bytes"] for g in gathered],
                   peak_rss_mib=[round(g["rss_mib"], 1) for g in gathered],
                   final_loss_rank0=gathered[0]["loss"])
        out_q.put(row)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_row(r):
    mib = lambda b: b / (1 << 20)
    label = r["mode"] + (" (bucket view)" if r["bucket_view"] else "")
    print(f"{label:<20} step ms median rank0 {r['step_ms_median']:9.1f}  max-rank median "
          f"{r['step_ms_max_rank_median']:9.1f}", flush=True)
    print(f"{'':<20} optimizer state MiB/rank {[round(mib(b), 1) for b in r['optim_state_bytes']]}"
          f" (total {mib(sum(r['optim_state_bytes'])):.1f})  peak RSS MiB/rank {r['peak_rss_mib']}",
          flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=1, help="times to run every mode, interleaved")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each rank")
    ap.add_argument("--bucket-view", action="store_true", help="ZeRO parameters_as_bucket_view=True")
    ap.add_argument("--json", action="store_true", help="one JSON line per mode and round instead of text")
    a = ap.parse_args()
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            sys.exit(f"unknown mode {m!r}; choose from {MODES}")
    if a.steps < 1:
        sys.exit("--steps must be at least 1")
    if not a.json:
        print(f"torch {torch.__version__} gloo CPU, {a.nproc} processes, batch {a.batch}, "
              f"{a.warmup} warm-up + {a.steps} timed steps, {a.threads} thread(s)/rank", flush=True)
    ctx = mp.get_context("spawn")
    for rnd in range(a.rounds):
        for mode in modes:
            q = ctx.SimpleQueue()
            mp.spawn(worker, args=(a.nproc, free_port(), mode, a, q), nprocs=a.nproc, join=True)
            row = q.get()
            row["round"] = rnd
            if a.json:
                print(json.dumps(row), flush=True)
            else:
                if a.rounds > 1:
                    print(f"round {rnd}")
                print_row(row)
