"""Tensor-parallel peer (CPU, Gloo): PyTorch 2's DTensor tensor parallelism on the GPT of bench/tp_bench.cc.

The model is bench/tp_bench.cc's nn::GPT written the way torch's tensor parallelism wants
it (torchtitan's layout): 6 layers, d 512, 8 heads, seq 128, vocab 8192, learned positions,
pre-LayerNorm blocks with separate q, k, v projections (a fused qkv Linear cannot be split
by heads with ColwiseParallel), tanh GELU, untied head; a batch of 4 sequences every tp rank
shares; loss_parallel cross-entropy; AdamW(lr 1e-3, weight decay 0.01); 1 thread per process.

  mode plain   one process
  mode tp      parallelize_module: Colwise q/k/v/fc1 and head, Rowwise wo/fc2 and the embedding
  mode tp_sp   the same with SequenceParallel norms and positions, Shard(1) between regions

Per rank one JSON line: local parameter / gradient / AdamW-state bytes, peak RSS above the
baseline, median step time over --steps after --warmup.

  python tp_peer.py --mode tp_sp --world 2
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import peer_common as pc

LAYERS, D, HEADS, SEQ, VOCAB, BATCH = 6, 512, 8, 128, 8192, 4


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(pc.SplitBlock(D, HEADS) for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, positions):
        x = self.tok(idx) + self.pos(positions)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def parallelize(model, sp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (pc.dist.get_world_size(),), mesh_dim_names=("tp",))
    act = Shard(1) if sp else Replicate()
    plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
            "head": ColwiseParallel(input_layouts=act, use_local_output=False)}
    if sp:
        plan["pos"] = SequenceParallel(sequence_dim=0, use_local_output=True)
        plan["ln_f"] = SequenceParallel()
    for i in range(LAYERS):
        p = f"blocks.{i}."
        for w in ("wq", "wk", "wv"):
            plan[p + "attn." + w] = ColwiseParallel()
        plan[p + "attn.wo"] = RowwiseParallel(output_layouts=act)
        plan[p + "mlp.fc1"] = ColwiseParallel()
        plan[p + "mlp.fc2"] = RowwiseParallel(output_layouts=act)
        if sp:
            plan[p + "ln1"] = SequenceParallel()
            plan[p + "ln2"] = SequenceParallel()
            for m in ("attn", "mlp"):
                plan[p + m] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, plan)
    return mesh


def train_rank(rank, world, mode, warmup, steps, out):
    base_rss = pc.rss_bytes()
    torch.manual_seed(0)
    model = GPT()
    sp = mode == "tp_sp"
    if mode != "plain":
        parallelize(model, sp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1000)  # the same batch on every tp rank
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    chunk = SEQ // world
    positions = torch.arange(rank * chunk, (rank + 1) * chunk) if sp else torch.arange(SEQ)

    def loss_of(logits):
        if mode == "plain":
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    times, gbytes = [], 0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        loss = loss_of(model(x, positions))
        if mode == "plain":
            loss.backward()
        else:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss.backward()
        if step == 0:
            gbytes = pc.grad_bytes(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
    full_loss = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
    pc.emit(dict(script="tp_peer", kind="train", mode=mode, world_size=world, rank=rank,
                 param_mib=pc.mib(pc.param_bytes(model)), grad_mib=pc.mib(gbytes),
                 optim_state_mib=pc.mib(pc.optim_bytes(opt)),
                 peak_minus_baseline_mib=pc.mib(pc.peak_rss_bytes() - base_rss),
                 step_ms_median=pc.median_ms(times), step_ms_min=round(min(times) * 1e3, 2),
                 final_loss=round(full_loss, 6), torch=torch.__version__), out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["plain", "tp", "tp_sp"], default="tp_sp")
    pc.add_run_args(ap, warmup=1, steps=5, world=2)
    a = ap.parse_args()
    world = 1 if a.mode == "plain" else a.world
    try:
        pc.launch(world, train_rank, a.mode, a.warmup, a.steps, a.out)
    except Exception as e:  # record what does not run on CPU
        msg = str(e).strip().splitlines()
        pc.emit(dict(script="tp_peer", kind="error", mode=a.mode, world_size=world,
                     error=" | ".join(msg[-6:])[:1500]), a.out)


if __name__ == "__main__":
    main()
