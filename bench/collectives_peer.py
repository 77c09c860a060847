# torch.distributed's Gloo on the workload of bench/collectives_bench.cc:
# 2 processes on localhost, float32, all_reduce / all_gather_into_tensor /
# reduce_scatter_tensor over the same sizes and iteration counts, each op
# timed back to back on rank 0 after 3 warm-ups, printing nccl-tests' figures:
#   algbw = size / time (size: the whole buffer, as in collectives_bench.cc)
#   busbw = algbw * 2(n-1)/n (allreduce), * (n-1)/n (allgather, reduce_scatter)
#
# PyTorch 1.13's Gloo backend implements neither _allgather_base nor
# reduce_scatter; where the native call raises, the script falls back to what
# a torch user on Gloo does instead and says so in the `impl` column:
# all_gather into views of the output, and all_reduce + copy of this rank's
# block.
#
# Usage: /usr/bin/python3 bench/collectives_peer.py [--sizes 4K,64K,1M] [--ops allreduce,...] [--json]
import argparse, json, os, socket, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ["allreduce", "allgather_into_tensor", "reduce_scatter_tensor"]
SIZES = "4K,64K,256K,1M,4M,16M,64M"


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def iters_for(nbytes):  # as iterations_for() in collectives_bench.cc
    return 200 if nbytes <= 64 << 10 else 50 if nbytes <= 1 << 20 else 20 if nbytes <= 16 << 20 else 10


def make_op(name, whole, part, world):
    """Returns (callable, impl label) for one op on these buffers."""
    if name == "allreduce":
        return (lambda: dist.all_reduce(whole)), "native"
    if name == "allgather_into_tensor":
        try:
            dist.all_gather_into_tensor(whole, part)
            return (lambda: dist.all_gather_into_tensor(whole, part)), "native"
        except (RuntimeError, AttributeError):
            views = list(whole.chunk(world))
            return (lambda: dist.all_gather(views, part)), "emulated: all_gather into views"
    if name == "reduce_scatter_tensor":
        try:
            dist.reduce_scatter_tensor(part, whole)
            return (lambda: dist.reduce_scatter_tensor(part, whole)), "native"
        except (RuntimeError, AttributeError):
            rank = dist.get_rank()
            scratch = torch.empty_like(whole)

            def emulated():
                scratch.copy_(whole)
                dist.all_reduce(scratch)
                part.copy_(scratch.chunk(world)[rank])

            return emulated, "emulated: all_reduce + copy"
    raise ValueError(name)


def worker(rank, world, port, sizes, ops, as_json):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for name in ops:
        for label, nbytes in sizes:
            numel = nbytes // 4
            whole = torch.zeros(numel, dtype=torch.float32)
            part = torch.zeros(numel // world, dtype=torch.float32)
            fn, impl = make_op(name, whole, part, world)
            for _ in range(3):
                fn()
            iters = iters_for(nbytes)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            per_op = (time.perf_counter() - t0) / iters
            factor = 2 * (world - 1) / world if name == "allreduce" else (world - 1) / world
            alg = nbytes / per_op
            rows.append(dict(peer="torch_gloo", torch=torch.__version__, op=name, size=label, bytes=nbytes,
                             world=world, iters=iters, time_us=per_op * 1e6, algbw_GBps=alg / 1e9,
                             busbw_GBps=alg * factor / 1e9, impl=impl))
    if rank == 0:
        if as_json:
            for r in rows:
                print(json.dumps(r), flush=True)
        else:
            print(f"torch {torch.__version__} gloo, {world} processes, float32, back-to-back per op (rank 0)")
            print(f"{'op':<24}{'size':>6}{'time_us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}  impl")
            for r in rows:
                print(f"{r['op']:<24}{r['size']:>6}{r['time_us']:>12.1f}{r['algbw_GBps']:>12.3f}"
                      f"{r['busbw_GBps']:>12.3f}  {r['impl']}", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON line per result instead of the table")
    a = ap.parse_args()
    sizes = [(s, parse_size(s)) for s in a.sizes.split(",")]
    ops = a.ops.split(",")
    for o in ops:
        if o not in OPS:
            sys.exit(f"unknown op {o!r}; choose from {OPS}")
    mp.spawn(worker, args=(a.world, free_port(), sizes, ops, a.json), nprocs=a.world, join=True)
