"""Activation-checkpointing peer (CPU, Gloo): PyTorch 2's checkpoint_wrapper + fully_shard on
the GPT of bench/ac_bench.cc.

The model is bench/ac_bench.cc's nn::GPT: 8 blocks, d 384, 6 heads, seq 256, vocab 8192,
learned positions, pre-LayerNorm blocks with a fused qkv projection and SDPA attention,
tanh GELU, untied head; 4 sequences per rank; AdamW(lr 1e-3, weight decay 0.01); each block
wrapped by checkpoint_wrapper (non-reentrant) per the policy, then fully_shard per block and
the root (FSDP2, reshard after forward), 2 ranks with 1 thread each.

  policy none        no checkpointing
  policy full        every block
  policy every:2     blocks 1, 3, 5, 7 (torchtitan's ac_freq 2)
  policy selective   every block, with create_selective_checkpoint_contexts saving the
                     outputs of mm / addmm / bmm / SDPA and recomputing the rest (torchtitan's op SAC)

Per rank one JSON line: median step time over --steps after --warmup; fwd_held_mib (RSS at the
end of forward minus before it) and step_peak_mib (peak RSS minus RSS before the forward);
run with MALLOC_MMAP_THRESHOLD_=65536 so freed memory leaves the process (bench/ac_compare.py).

  python ac_peer.py --policy full
"""
import argparse
import functools
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import peer_common as pc

LAYERS, D, HEADS, SEQ, VOCAB, BATCH = 8, 384, 6, 256, 8192, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.c_fc, self.c_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"]
    save = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model, policy):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i, b in enumerate(model.blocks):
        if policy == "none" or (policy.startswith("every:") and (i + 1) % int(policy[6:]) != 0):
            continue
        kw = {"context_fn": selective_context} if policy == "selective" else {}
        model.blocks[i] = checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kw)


def train_rank(rank, world, policy, warmup, steps, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT()
    apply_ac(model, policy)
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH * SEQ,), generator=g)
    times, held, peak = [], 0, 0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        before = pc.rss_bytes()
        loss = F.cross_entropy(model(x).flatten(0, 1), y)
        held = pc.rss_bytes() - before
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = pc.peak_rss_bytes() - before
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
    pc.emit(dict(script="ac_peer", kind="train", policy=policy, world_size=world, rank=rank,
                 fwd_held_mib=pc.mib(held), step_peak_mib=pc.mib(peak), step_ms_median=pc.median_ms(times),
                 final_loss=round(loss.item(), 6), torch=torch.__version__), out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="full")
    pc.add_run_args(ap, warmup=1, steps=4, world=2)
    a = ap.parse_args()
    try:
        pc.launch(a.world, train_rank, a.policy, a.warmup, a.steps, a.out)
    except Exception as e:  # record what does not run on CPU
        msg = str(e).strip().splitlines()
        pc.emit(dict(script="ac_peer", kind="error", policy=a.policy, world_size=a.world,
                     error=" | ".join(msg[-6:])[:1500]), a.out)


if __name__ == "__main__":
    main()
