"""Mixture-of-experts peer (CPU, Gloo): the LLaMA //examples:gpt --moe-experts trains, in PyTorch
2.15 eager, beside ember (bench/moe_compare.py runs both), on one process or with expert
parallelism over --ep ranks.

The model (ember's --arch llama with every block an MoE): token embedding, --layers pre-RMSNorm
blocks of causal multi-head attention with rotary embeddings (Hugging Face's rotate-half, theta
1e4), an MoE feed-forward, final RMSNorm, untied head; no biases.
The MoE, as ember's nn::MoE (and torchtitan's MoE): a router Linear(dim, E) without bias,
softmax scores in float32, torch.topk(k), the k weights renormalised; the (token, choice)
pairs sorted by expert (stable argsort), the tokens gathered in that order, a grouped SwiGLU
written in PyTorch (one torch.mm per expert on its slice of rows, w1/w3 [E, hidden, dim], w2
[E, dim, hidden]), the results scattered back (index_add_) weighted by the scores; the
Switch/Mixtral load-balancing loss (E * sum_e f_e P_e, coefficient 0.01) added to the loss.

Expert parallelism (--ep N, N processes, torchtitan's ExpertParallel on plain collectives):
each rank holds E/N experts; per layer the per-expert counts are exchanged with
all_to_all_single, the tokens sent with all_to_all_single and those uneven splits, regrouped by
local expert, run, regrouped back and returned by the reverse all_to_all_single (an
autograd.Function whose backward is the reverse exchange). The rest of the model is FSDP2
(fully_shard per block and the root, the experts in ignored_params); the experts' gradients are
divided by N (each rank's loss is its own batch's mean). The balance counts are summed over the
ranks (an all_reduce), as ember's.

Timing: --warmup steps, then --steps steps, each after a barrier, the maximum over ranks; AdamW
(lr 1e-3, weight decay 0.1), gradients clipped to 1, 1 thread per process. One JSON line.

  python moe_peer.py --ep 1 --experts 8 --top-k 2
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import peer_common as pc


def rope(seq, hd, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    ang = torch.arange(seq).float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven row splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return AllToAll.apply(g.contiguous(), in_splits, out_splits, ctx.group), None, None, None


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


def grouped_swiglu(x, w1, w2, w3, counts):
    """One torch.mm per expert on its rows (the grouped matmul, written in PyTorch)."""
    outs, at = [], 0
    for e, n in enumerate(counts):
        xe = x[at:at + n]
        outs.append(torch.mm(F.silu(torch.mm(xe, w1[e].t())) * torch.mm(xe, w3[e].t()), w2[e].t()))
        at += n
    return torch.cat(outs) if outs else x.new_zeros((0, w2.shape[1]))


class MoE(nn.Module):
    def __init__(self, dim, hidden, experts, k, ep, group, balance_group):
        super().__init__()
        self.E, self.k, self.ep, self.group, self.balance_group = experts, k, ep, group, balance_group
        self.gate = nn.Linear(dim, experts, bias=False)
        local = experts // ep
        self.w1 = nn.Parameter(torch.randn(local, hidden, dim) * 0.02)
        self.w2 = nn.Parameter(torch.randn(local, dim, hidden) * 0.02)
        self.w3 = nn.Parameter(torch.randn(local, hidden, dim) * 0.02)
        self.aux = None

    def experts(self, rows, counts):
        if self.ep == 1:
            return grouped_swiglu(rows, self.w1, self.w2, self.w3, counts)
        n, El = self.ep, self.E // self.ep
        send = torch.tensor(counts, dtype=torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        frm = recv.view(n, El).tolist()
        send_splits = [sum(counts[r * El:(r + 1) * El]) for r in range(n)]
        recv_splits = [sum(row) for row in frm]
        got = AllToAll.apply(rows, recv_splits, send_splits, self.group)
        starts, at = [[0] * El for _ in range(n)], 0
        for q in range(n):
            for e in range(El):
                starts[q][e], at = at, at + frm[q][e]
        order = [starts[q][e] + i for e in range(El) for q in range(n) for i in range(frm[q][e])]
        order = torch.tensor(order, dtype=torch.int64)
        local = [sum(frm[q][e] for q in range(n)) for e in range(El)]
        s = 1.0 / n
        y = grouped_swiglu(got[order], ScaleGrad.apply(self.w1, s), ScaleGrad.apply(self.w2, s),
                           ScaleGrad.apply(self.w3, s), local)
        back = torch.empty_like(y)
        back[order] = y
        return AllToAll.apply(back, send_splits, recv_splits, self.group)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N = x.shape[0]
        logits = self.gate(x)
        scores = F.softmax(logits.float(), dim=-1)
        w, idx = torch.topk(scores, self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.E)
        rows = x[order // self.k]
        out = self.experts(rows, counts.tolist())
        y = torch.zeros_like(x).index_add_(0, order // self.k, out * w.reshape(-1)[order].unsqueeze(-1))
        c = counts.to(torch.float32)
        if self.balance_group is not None:
            dist.all_reduce(c, group=self.balance_group)
        f = c * (self.E / c.sum().clamp(min=1.0) * self.k)
        self.aux = (scores.mean(0) * f).sum()
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, a, group, balance_group):
        super().__init__()
        d, self.heads = a.dim, a.heads
        self.ln_1, self.ln_2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.moe = MoE(d, a.hidden, a.experts, a.top_k, a.ep, group, balance_group)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        h = self.ln_1(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        return x + self.moe(self.ln_2(x))


class Model(nn.Module):
    def __init__(self, a, group, balance_group):
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.dim)
        self.h = nn.ModuleList(Block(a, group, balance_group) for _ in range(a.layers))
        self.ln_f, self.lm_head = nn.RMSNorm(a.dim, eps=1e-5), nn.Linear(a.dim, a.vocab, bias=False)
        cos, sin = rope(a.seq, a.dim // a.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.h:
            x = b(x, self.cos, self.sin)
        return self.lm_head(self.ln_f(x))


def clip_grad_norm_(model, max_norm, world):
    """torch's clip_grad_norm_ does not take FSDP's DTensor gradients beside the experts' plain ones:
    every element is held by one rank (FSDP shards over the world, each rank its own experts), so
    the squares summed locally and all-reduced are the global norm's."""
    loc = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()
           if p.grad is not None]
    sq = torch.stack([g.pow(2).sum() for g in loc]).sum()
    if world > 1:
        dist.all_reduce(sq)
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in loc:
        g.mul_(coef)


def train_rank(rank, world, a, out):
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    model = Model(a, group, group)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        experts = {p for b in model.h for p in (b.moe.w1, b.moe.w2, b.moe.w3)}
        for b in model.h:
            fully_shard(b, ignored_params=experts)
        fully_shard(model, ignored_params=experts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    per_rank = a.global_batch // world
    times, mine, losses = [], [], []
    for step in range(a.warmup + a.steps):
        g = torch.Generator().manual_seed(1000 + 97 * step)
        tokens = torch.randint(0, a.vocab, (a.global_batch, a.seq + 1), generator=g)[rank * per_rank:(rank + 1) * per_rank]
        x, y = tokens[:, :-1], tokens[:, 1:]
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).reshape(-1, a.vocab), y.reshape(-1))
        aux = sum(b.moe.aux for b in model.h)
        (loss + 0.01 * aux).backward()
        clip_grad_norm_(model, 1.0, world)
        opt.step()
        own = time.perf_counter() - t0
        dt = torch.tensor([own])
        if world > 1:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= a.warmup:
            times.append(dt.item())
            mine.append(own)
        losses.append(round(loss.item(), 6))
    if rank == 0:
        pc.emit(dict(script="moe_peer", kind="train", ep=world, experts=a.experts, top_k=a.top_k,
                     step_ms_median=pc.median_ms(times), step_ms=[round(t * 1e3, 2) for t in times],
                     losses=losses, torch=torch.__version__), out)
    del model, opt, loss
    import gc

    gc.collect()
    if world > 1:
        dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", dest="top_k", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=114)
    ap.add_argument("--global-batch", dest="global_batch", type=int, default=8)
    pc.add_run_args(ap, warmup=1, steps=4)
    a = ap.parse_args()
    if a.ep == 1:
        torch.set_num_threads(1)
        train_rank(0, 1, a, a.out)
    else:
        pc.launch(a.ep, train_rank, a, a.out)


if __name__ == "__main__":
    main()
