"""LLaMA-style training step in PyTorch eager (CPU): the model of bench/llama_bench.cc.

6 blocks, d 512, 8 heads of 64, 4 key/value heads (grouped-query attention through
F.scaled_dot_product_attention(enable_gqa=True)), rotary embeddings in Hugging Face LLaMA's
rotate-half form (float32 tables), F.rms_norm (eps 1e-5), SwiGLU 1408, no biases, untied head,
vocab 8192, seq 256, batch 4; AdamW(lr 1e-3, weight decay 0.01, foreach), float32, all cores.
One JSON line: median step time over --steps after --warmup, tokens/s, parameters.

  python llama_peer.py --steps 8
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYERS, D, HEADS, KV, FFN, VOCAB, SEQ, BATCH = 6, 512, 8, 4, 1408, 8192, 256, 4
HD = D // HEADS


def rope_tables(seq, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, HD, 2, dtype=torch.int64).float() / HD))
    ang = torch.arange(seq).float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()  # [T, HD]


def rotate_half(x):
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return torch.cat([-x2, x1], -1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.RMSNorm(D, eps=1e-5), nn.RMSNorm(D, eps=1e-5)
        self.q = nn.Linear(D, HEADS * HD, bias=False)
        self.k = nn.Linear(D, KV * HD, bias=False)
        self.v = nn.Linear(D, KV * HD, bias=False)
        self.o = nn.Linear(HEADS * HD, D, bias=False)
        self.gate = nn.Linear(D, FFN, bias=False)
        self.up = nn.Linear(D, FFN, bias=False)
        self.down = nn.Linear(FFN, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.ln_1(x)
        q = self.q(h).view(B, T, HEADS, HD).transpose(1, 2)
        k = self.k(h).view(B, T, KV, HD).transpose(1, 2)
        v = self.v(h).view(B, T, KV, HD).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        h = self.ln_2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.RMSNorm(D, eps=1e-5)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        cos, sin = rope_tables(SEQ)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.h:
            x = b(x, self.cos, self.sin)
        return self.lm_head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    y = torch.randint(0, VOCAB, (BATCH * SEQ,))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        step()
    ts = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    ms = ts[len(ts) // 2]
    print(json.dumps({"script": "llama_peer", "rank": 0, "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "step_ms_median": ms, "tokens_per_s": BATCH * SEQ * 1e3 / ms,
                      "params_M": sum(p.numel() for p in model.parameters()) / 1e6}), flush=True)


if __name__ == "__main__":
    main()
