"""Context-parallel peer (CPU, Gloo): the GPT //examples:gpt trains, its sequence split over a
cp mesh dimension, beside ember's --cp (bench/cp_compare.py runs both).

PyTorch's own context parallelism (torch.distributed.tensor.experimental.context_parallel) is
tried first on this model and does not run on a CPU: scaled_dot_product_attention on CPU
dispatches to aten._scaled_dot_product_flash_attention_for_cpu, for which DTensor registers no
sharding strategy, and context_parallel only rewrites the CUDA kernels (flash, efficient,
cuDNN). The JSON line carries that error ("torch_cp_error"). So this script writes the
all-gather exchange torchtitan defaults to, on plain torch:
  - the sequence cut into 2*cp chunks, rank r holding chunks r and 2*cp-1-r (head-tail, as
    ember and torch's _HeadTailLoadBalancer), tokens, labels and learned positions alike;
  - every layer all-gathers k and v over cp in one collective (autograd: the backward
    reduce-scatters dk, dv), then each local chunk attends to the keys up to its end with a
    bottom-right causal mask (the keys after it, which causality hides, are not computed: the
    work ember's all-gather does);
  - FSDP2 fully_shard over the cp ranks (each block, then the root; reshard after forward),
    as ember shards over dp_shard x cp; each rank's loss is the mean over its tokens, and FSDP
    averages the gradients, which gives the global mean;
  - gradients clipped to norm 1, AdamW(lr 1e-3, weight decay 0.1), 1 thread per process.

The model: --layers blocks of dim --dim with --heads heads, context --seq, vocabulary --vocab,
learned positions, pre-LayerNorm blocks, tanh GELU 4x MLP, untied head (peer_common.SplitBlock).
--global-batch sequences per step (every cp rank holds its slice of each).

Timing: --warmup steps, then --steps timed steps, each after a barrier, the maximum over ranks
(and each rank's own median: the spread); rank 0 prints one JSON line, with every step's loss
(equal at every cp: the check that the exchange is right).

  python cp_peer.py --cp 2 --seq 1024
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import peer_common as pc


def head_tail(t, cp, r, dim=1):
    """Rank r's chunks r and 2cp-1-r of t along dim."""
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=dim)


class GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 ([B, H, T, D]) over the group; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, g):
        n = dist.get_world_size(ctx.group)
        # Rank-major [n, B, H, Tl, D], flat: reduce_scatter_tensor splits dim 0 (Gloo checks
        # that the output's dim 0 times n is the input's).
        stacked = torch.stack(g.chunk(n, dim=2))
        out = torch.empty(stacked[0].numel())
        dist.reduce_scatter_tensor(out, stacked.reshape(-1), group=ctx.group)
        return out.view(stacked.shape[1:]), None


class CPAttention(pc.SplitAttention):
    """Each local chunk attends only to the keys up to its end (what ember's all-gather computes: the
    prefix fully, its own chunk causally), k and v gathered together in one all-gather."""

    def __init__(self, d, heads, group, chunks, c):
        super().__init__(d, heads)
        self.group, self.chunks, self.c = group, chunks, c  # chunks: this rank's (head, tail) chunk indices
        self.order = None

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        kv = GatherSeq.apply(torch.cat([k, v], dim=-1), self.group)  # rank-major head-tail chunks
        n, c = dist.get_world_size(self.group), self.c
        if self.order is None:  # natural sequence order from the gathered chunks
            where = {}
            for r in range(n):
                where[r], where[2 * n - 1 - r] = 2 * r, 2 * r + 1
            self.order = torch.cat([torch.arange(where[i] * c, (where[i] + 1) * c) for i in range(2 * n)])
        kv = kv.index_select(2, self.order)
        outs = []
        for h, chunk in enumerate(self.chunks):
            end = (chunk + 1) * c
            keys = kv[:, :, :end]
            # Bottom-right causal: query i of the chunk (position chunk*c + i) sees keys j <= chunk*c + i.
            mask = torch.ones(c, end, dtype=torch.bool).tril(diagonal=end - c)
            outs.append(F.scaled_dot_product_attention(q[:, :, h * c:(h + 1) * c], keys[..., :self.head_dim],
                                                       keys[..., self.head_dim:], attn_mask=mask))
        a = torch.cat(outs, dim=2)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok, self.pos = nn.Embedding(a.vocab, a.dim), nn.Embedding(a.seq, a.dim)
        self.blocks = nn.ModuleList(pc.SplitBlock(a.dim, a.heads) for _ in range(a.layers))
        self.ln_f, self.head = nn.LayerNorm(a.dim), nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, x, positions):
        x = self.tok(x) + self.pos(positions)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def torch_cp_error(a, mesh):
    """What torch's own context_parallel says on this CPU (None if it runs)."""
    from torch.distributed.tensor.experimental import context_parallel

    torch.manual_seed(0)
    m = GPT(a)
    x = torch.randint(0, a.vocab, (1, a.seq))
    pos = torch.arange(a.seq).unsqueeze(0)
    try:
        with context_parallel(mesh, buffers=[x, pos], buffer_seq_dims=[1, 1]):
            m(x, pos).sum().backward()
        return None
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"


def train_rank(rank, world, a, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (a.cp,), mesh_dim_names=("cp",))
    error = torch_cp_error(a, mesh)
    group, cp, r = mesh.get_group(), a.cp, mesh.get_local_rank()
    positions = head_tail(torch.arange(a.seq), cp, r, dim=0)
    torch.manual_seed(0)
    model = GPT(a)
    for blk in model.blocks:
        attn = CPAttention(a.dim, a.heads, group, (r, 2 * cp - 1 - r), a.seq // (2 * cp))
        attn.load_state_dict(blk.attn.state_dict())
        blk.attn = attn
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    times, mine, losses = [], [], []
    for step in range(a.warmup + a.steps):
        g = torch.Generator().manual_seed(1000 + 97 * step)
        tokens = torch.randint(0, a.vocab, (a.global_batch, a.seq + 1), generator=g)
        x, y = head_tail(tokens[:, :-1], cp, r), head_tail(tokens[:, 1:], cp, r)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x, positions.unsqueeze(0))
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        own = time.perf_counter() - t0
        dt = torch.tensor([own])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= a.warmup:
            times.append(dt.item())
            mine.append(own)
        lv = loss.detach().clone()
        dist.all_reduce(lv)  # every rank's mean over its tokens: their mean is the global loss
        losses.append(round(lv.item() / cp, 6))
    per_rank = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(per_rank, torch.tensor([pc.median_ms(mine)]))
    if rank == 0:
        pc.emit(dict(script="cp_peer", kind="train", cp=cp, seq=a.seq, exchange="allgather (written here)",
                     step_ms_median=pc.median_ms(times), step_ms=[round(t * 1e3, 2) for t in times],
                     rank_step_ms=[round(p.item(), 2) for p in per_rank], losses=losses,
                     peak_rss_mib=pc.mib(pc.peak_rss_bytes()), torch_cp_error=error, torch=torch.__version__), out)
    # Freed while the group is alive (pp_peer.py: Gloo may abort at exit otherwise).
    del model, opt, logits, loss
    import gc

    gc.collect()
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=114)
    ap.add_argument("--global-batch", dest="global_batch", type=int, default=2)
    pc.add_run_args(ap, warmup=1, steps=3)
    a = ap.parse_args()
    if a.seq % (2 * a.cp):
        raise SystemExit(f"--seq {a.seq} must be a multiple of 2 x --cp = {2 * a.cp} (head-tail chunks)")
    try:
        pc.launch(a.cp, train_rank, a, a.out)
    except Exception as e:
        msg = str(e).strip().splitlines()
        pc.emit(dict(script="cp_peer", kind="error", error=" | ".join(msg[-8:])[:2000]), a.out)


if __name__ == "__main__":
    main()
