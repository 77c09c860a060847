"""Pipeline-parallel peer (CPU, Gloo): PyTorch 2's torch.distributed.pipelining on the GPT of
the ember pipeline benchmark.

The model: 8 blocks, d 256, 4 heads, seq 128, vocab 4096, learned positions, token and position
embeddings (x = tok(idx) + pos(arange(T))), peer_common.GPTBlock (pre-LayerNorm, fused qkv with
bias, SDPA causal attention, tanh GELU 4x MLP), final LayerNorm, untied head without bias, no
dropout. Every rank seeds torch.manual_seed(0), builds the whole model and keeps the modules of
its own stages. The 8 blocks are split evenly over the P*V stages; the embeddings go with
stage 0, ln_f + head with the last stage. Each stage is a PipelineStage on the CPU with its
input / output shapes given up front (stage 0 takes int64 token ids [mb, 128], the
activations between stages are float32 [mb, 128, 256], the last stage returns logits
[mb, 128, 4096]), so no shape inference runs.

  schedule gpipe        ScheduleGPipe, one stage per rank
  schedule 1f1b         Schedule1F1B, one stage per rank
  schedule interleaved  ScheduleInterleaved1F1B, V=2 stages per rank (rank r: stages r, r+P)
  schedule zb-h1        ScheduleInterleavedZeroBubble with one stage per rank (ZB-H1: 1F1B with
                        the weight gradients split off to fill the bubble); if torch refuses one
                        stage per rank, ScheduleZBVZeroBubble with 2 stages per rank in a V
                        (rank r: stages r and 2P-1-r). The JSON says which class and V ran.

Data: a global batch of --batch sequences per step, split by the schedule into --microbatches
micro-batches along dim 0; step s draws x = randint(0, 4096, (batch, 129)) from
Generator().manual_seed(1000 + s), inputs x[:, :-1], targets x[:, 1:]. Loss per micro-batch:
F.cross_entropy(logits.reshape(-1, 4096), y.reshape(-1)) (a mean). Torch's default loss
scaling (scale_grads=True) is kept: each micro-batch's mean loss is back-propagated unscaled,
and after the last backward every stage divides its accumulated gradients by the number of
micro-batches, so the gradient is that of the mean over the micro-batches (= the mean over
the whole batch, micro-batches being equal). AdamW(lr 1e-3, weight decay 0.01) over the
stage parameters of the rank, zero_grad + step every step; 1 thread per process.

Timing: --warmup steps, then --steps timed steps; every timed step starts after a
dist.barrier(), is timed on each rank (zero_grad, schedule.step, optimizer step), and the
maximum over ranks (all_reduce MAX) is the step's time. Rank 0 prints one JSON line with the
median over steps, the per-step times, the mean loss over the micro-batches of the last step
(sent from the rank holding the last stage; loss_first: the same for the first warm-up step) and
peak RSS per rank above the baseline.

  python pp_peer.py --schedule 1f1b --world 2 --microbatches 4
"""
import argparse
import gc
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import peer_common as pc

LAYERS, D, HEADS, SEQ, VOCAB = 8, 256, 4, 128, 4096
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(pc.GPTBlock(d=D, heads=HEADS, gelu="tanh") for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)


class Stage(nn.Module):
    """A contiguous run of blocks, with the embeddings in front (first stage) and ln_f + head
    behind (last stage)."""

    def __init__(self, gpt, lo, hi, first, last):
        super().__init__()
        self.tok = gpt.tok if first else None
        self.pos = gpt.pos if first else None
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in range(lo, hi))
        self.ln_f = gpt.ln_f if last else None
        self.head = gpt.head if last else None

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            x = b(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def stage_indices(rank, world, v, style):
    """Global stage indices held by this rank: loop (r, r+P, ...) or V-shape (r, 2P-1-r)."""
    if style == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(v)]


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def build(rank, world, schedule, v, style, mb_size, n_mb):
    """Seeded whole model -> this rank's PipelineStages, optimizer and schedule."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)

    torch.manual_seed(0)
    gpt = GPT()
    n_stages = world * v
    if LAYERS % n_stages:
        raise SystemExit(f"pp_peer: {LAYERS} blocks do not split evenly over {n_stages} stages")
    per = LAYERS // n_stages
    cpu = torch.device("cpu")
    stages, params = [], []
    for s in stage_indices(rank, world, v, style):
        first, last = s == 0, s == n_stages - 1
        mod = Stage(gpt, s * per, (s + 1) * per, first, last)
        # Static metadata: the examples' requires_grad is taken as is, so the float activations
        # must require grad or no gradient travels back between stages.
        inp = (torch.zeros(mb_size, SEQ, dtype=torch.long) if first
               else torch.empty(mb_size, SEQ, D, requires_grad=True))
        out = torch.empty(mb_size, SEQ, VOCAB if last else D, requires_grad=True)
        stages.append(PipelineStage(mod, s, n_stages, device=cpu, input_args=(inp,), output_args=(out,)))
        params += list(mod.parameters())
    del gpt
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], n_mb, loss_fn=loss_fn)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], n_mb, loss_fn=loss_fn)
    elif schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_mb, loss_fn=loss_fn)
    elif style == "v":
        sched = ScheduleZBVZeroBubble(stages, n_mb, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleavedZeroBubble(stages, n_mb, loss_fn=loss_fn)
    return stages, opt, sched


def train_rank(rank, world, schedule, n_mb, batch, warmup, steps, out):
    base_rss = pc.rss_bytes()
    if batch % n_mb:
        raise SystemExit(f"pp_peer: batch {batch} is not a multiple of {n_mb} micro-batches")
    mb_size = batch // n_mb
    v, style = (2, "loop") if schedule == "interleaved" else (1, "loop")
    try:
        stages, opt, sched = build(rank, world, schedule, v, style, mb_size, n_mb)
    except (ValueError, RuntimeError, AssertionError) as e:
        if schedule != "zb-h1":
            raise
        # Construction is local (no communication), so every rank refuses alike and falls back.
        if rank == 0:
            print(f"pp_peer: ScheduleInterleavedZeroBubble refused 1 stage per rank ({e}); "
                  "falling back to ScheduleZBVZeroBubble, 2 stages per rank", file=sys.stderr, flush=True)
        v, style = 2, "v"
        stages, opt, sched = build(rank, world, schedule, v, style, mb_size, n_mb)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)

    times, step_losses = [], []
    for step in range(warmup + steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        losses = []
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        args = (inp,) if has_first else ()
        kw = dict(target=tgt, losses=losses) if has_last else {}
        sched.step(*args, return_outputs=False, **kw)
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(dt.item())
        lt = torch.tensor([torch.stack(losses).mean().item() if has_last else 0.0], dtype=torch.float64)
        dist.all_reduce(lt)  # zero except on the rank holding the last stage
        step_losses.append(lt.item())

    peak = torch.tensor([pc.peak_rss_bytes() - base_rss], dtype=torch.float64)
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        pc.emit(dict(script="pp_peer", rank=0, peer="pp_peer", schedule=schedule, torch_schedule=type(sched).__name__,
                     stages_per_rank=v, world=world, microbatches=n_mb, batch=batch,
                     step_ms_median=pc.median_ms(times), step_ms=[round(t * 1e3, 2) for t in times],
                     loss=round(step_losses[-1], 6), loss_first=round(step_losses[0], 6),
                     peak_minus_baseline_mib=[pc.mib(p.item()) for p in peaks],
                     torch=torch.__version__), out)
    # The stages and schedule sit in reference cycles; left to the interpreter's exit they can be
    # torn down after destroy_process_group, and Gloo then now and then aborts the process
    # ("terminate called without an active exception"). Free them while the group is alive.
    del sched, stages, opt
    gc.collect()
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    pc.add_run_args(ap, warmup=1, steps=5, world=2)
    a = ap.parse_args()
    try:
        pc.launch(a.world, train_rank, a.schedule, a.microbatches, a.batch, a.warmup, a.steps, a.out)
    except Exception as e:
        msg = " | ".join(str(e).strip().splitlines()[-6:])[:1500]
        print(f"pp_peer: schedule {a.schedule} failed on torch {torch.__version__}: {msg}",
              file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
