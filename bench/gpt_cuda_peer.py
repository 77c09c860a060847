#!/usr/bin/env python3
"""PyTorch's side of bench/gpu_perf.sh's `gpt` part: the GPT of //examples:gpt_fsdp
(peer_common's pre-norm blocks with the tanh GELU, untied bias-free LM head,
AdamW betas 0.9/0.99 weight decay 0.1, global-norm clipping at 1.0) under
FSDP2 (fully_shard on every block and the root) on one GPU over NCCL, random
tokens of the given vocabulary. --amp bf16 is FSDP2's MixedPrecisionPolicy
(bf16 parameters and compute, float32 reduction), as our --amp bf16.

Prints one line per run:
  torch_gpt amp=off tokens_per_s=... step_ms=... steps=N
tokens_per_s is the median over the timed steps (each ends with loss.item(),
the one host synchronisation our step makes too). --profile-top K then
profiles one more step (bench/peer_profile.py): its top K ops by self
device time as `torch_gpt_op amp=.. calls=.. self_ms=.. total_ms=.. name=..`
lines, and `torch_gpt_launches amp=.. kernels=.. copies=..` on a GPU.
--device cpu (Gloo) rehearses the script where there is no GPU.
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "torch2"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_common import GPTBlock  # noqa: E402  the fsdp peers' block, with GPT-2's tanh GELU
from peer_profile import op_fields, profile_step  # noqa: E402


class GPT(nn.Module):
    def __init__(self, vocab, seq, layers, d, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(GPTBlock(d, heads, gelu="tanh") for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--amp", choices=["off", "bf16"], default="off")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--profile-top", type=int, default=0)
    a = ap.parse_args()
    # As ours: float32 matmuls without TF32 (torch's default for matmul;
    # set explicitly so an environment cannot change it).
    torch.backends.cuda.matmul.allow_tf32 = False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    dev = torch.device(a.device)
    if a.device == "cuda":
        torch.cuda.set_device(0)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(a.vocab, a.seq, a.layers, a.dim, a.heads).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.amp == "bf16" else None
    kw = {"mp_policy": mp} if mp else {}
    for b in model.h:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.99), weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    rates, times = [], []
    tokens = a.batch_size * a.seq

    def batch():
        return torch.randint(0, a.vocab, (a.batch_size, a.seq + 1), generator=g)

    def step(batch):  # timed from the copy to the device on (drawing the batch is not)
        x, y = batch[:, :-1].to(dev, non_blocking=True), batch[:, 1:].to(dev, non_blocking=True)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    for i in range(a.warmup + a.steps):
        b = batch()
        t0 = time.perf_counter()
        step(b)
        dt = time.perf_counter() - t0
        if i >= a.warmup:
            rates.append(tokens / dt)
            times.append(dt * 1e3)
    print(f"torch_gpt amp={a.amp} tokens_per_s={statistics.median(rates):.1f} "
          f"step_ms={statistics.median(times):.3f} steps={a.steps}", flush=True)
    if a.profile_top > 0:
        b = batch()
        rows, launches = profile_step(lambda: step(b), a.device, a.profile_top)
        if launches:
            print(f"torch_gpt_launches amp={a.amp} kernels={launches[0]} copies={launches[1]}", flush=True)
        for r in rows:
            print(f"torch_gpt_op amp={a.amp} {op_fields(r)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
