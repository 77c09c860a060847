"""N-D parallelism peer (CPU, Gloo): PyTorch 2's FSDP2 + DTensor tensor parallelism + pipelining
composed on one 3-D mesh (pp, dp_shard, tp), torchtitan's way, on the GPT //examples:gpt trains.

The model is //examples:gpt's: --layers blocks of dim --dim with --heads heads, context --seq,
vocabulary --vocab (the fortunes corpus' 114 characters by default), learned positions,
pre-LayerNorm blocks (q, k, v projections kept separate, as torch's ColwiseParallel needs to
split by heads; the same FLOPs as ember's fused one), tanh GELU 4x MLP, untied head without
bias, no dropout. Every rank seeds torch.manual_seed(0) and builds the whole model.

Composition, in torchtitan's order:
  1. pipeline: the blocks split evenly over the pp ranks (the embeddings with the first stage,
     ln_f and the head with the last), each a PipelineStage with its shapes given up front;
  2. tensor parallelism over tp (no sequence parallelism): ColwiseParallel q, k, v, fc1;
     RowwiseParallel wo, fc2; the token embedding RowwiseParallel, the head ColwiseParallel
     with its logits gathered (Replicate) for the loss;
  3. FSDP2 over dp_shard: fully_shard on every block, then on the stage, reshard_after_forward
     False (torchtitan's default under pipeline parallelism);
  4. Schedule1F1B over pp with --microbatches micro-batches.
Each data-parallel rank trains on its own --global-batch / dp sequences (the tp ranks of one
data-parallel rank share them). AdamW(lr 1e-3, weight decay 0.1), 1 thread per process.

Timing: --warmup steps, then --steps timed steps, each after a barrier, the maximum over ranks;
rank 0 prints one JSON line with the median. If torch cannot compose the three on the CPU the
JSON line says where it failed.

  python mesh_peer.py --pp 2 --dp-shard 2 --tp 2
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import peer_common as pc


class Stage(nn.Module):
    def __init__(self, a, lo, hi, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos = nn.Embedding(a.vocab, a.dim), nn.Embedding(a.seq, a.dim)
        self.blocks = nn.ModuleDict({str(i): pc.SplitBlock(a.dim, a.heads) for i in range(lo, hi)})
        if last:
            self.ln_f, self.head = nn.LayerNorm(a.dim), nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks.values():
            x = b(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def train_rank(rank, world, a, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (a.pp, a.dp_shard, a.tp), mesh_dim_names=("pp", "dp_shard", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp_shard"].get_local_rank()
    torch.manual_seed(0)
    per = a.layers // a.pp
    first, last = pp_rank == 0, pp_rank == a.pp - 1
    stage = Stage(a, pp_rank * per, (pp_rank + 1) * per, first, last)
    plan = {}
    for i in stage.blocks:
        p = f"blocks.{i}."
        for w in ("wq", "wk", "wv"):
            plan[p + "attn." + w] = ColwiseParallel()
        plan[p + "attn.wo"] = RowwiseParallel()
        plan[p + "mlp.fc1"] = ColwiseParallel()
        plan[p + "mlp.fc2"] = RowwiseParallel()
    if first:
        plan["tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if last:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    if a.tp > 1:
        parallelize_module(stage, mesh["tp"], plan)
    if a.dp_shard > 1 or a.force_fsdp:
        for b in stage.blocks.values():
            fully_shard(b, mesh=mesh["dp_shard"], reshard_after_forward=False)
        fully_shard(stage, mesh=mesh["dp_shard"], reshard_after_forward=False)
    dp = a.dp_shard
    mb = a.global_batch // dp // a.microbatches
    # Static shapes; the float activations must require grad, or no gradient travels back.
    inp = torch.zeros(mb, a.seq, dtype=torch.long) if first else torch.empty(mb, a.seq, a.dim, requires_grad=True)
    outp = torch.empty(mb, a.seq, a.vocab if last else a.dim, requires_grad=True)
    pstage = PipelineStage(stage, pp_rank, a.pp, device=torch.device("cpu"), input_args=(inp,), output_args=(outp,),
                           group=mesh["pp"].get_group())

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, a.vocab), y.reshape(-1))

    sched = Schedule1F1B(pstage, a.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.1)
    times = []
    for step in range(a.warmup + a.steps):
        g = torch.Generator().manual_seed(1000 + 97 * step + dp_rank)
        x = torch.randint(0, a.vocab, (a.global_batch // dp, a.seq + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if first:
            sched.step(x[:, :-1].contiguous())
        elif last:
            sched.step(target=x[:, 1:].contiguous())
        else:
            sched.step()
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= a.warmup:
            times.append(dt.item())
    if rank == 0:
        pc.emit(dict(script="mesh_peer", kind="train", mesh=dict(pp=a.pp, dp_shard=a.dp_shard, tp=a.tp),
                     step_ms_median=pc.median_ms(times), step_ms=[round(t * 1e3, 2) for t in times],
                     peak_minus_baseline_mib=pc.mib(pc.peak_rss_bytes()), torch=torch.__version__), out)
    # Freed while the group is alive (pp_peer.py: Gloo may abort at exit otherwise).
    del sched, pstage, opt
    import gc

    gc.collect()
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp-shard", dest="dp_shard", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=114)
    ap.add_argument("--global-batch", dest="global_batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    pc.add_run_args(ap, warmup=1, steps=3)
    ap.add_argument("--force-fsdp", dest="force_fsdp", action="store_true")
    a = ap.parse_args()
    world = a.pp * a.dp_shard * a.tp
    try:
        pc.launch(world, train_rank, a, a.out)
    except Exception as e:
        msg = str(e).strip().splitlines()
        pc.emit(dict(script="mesh_peer", kind="error", error=" | ".join(msg[-8:])[:2000]), a.out)


if __name__ == "__main__":
    main()
