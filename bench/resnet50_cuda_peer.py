#!/usr/bin/env python3
"""PyTorch's side of bench/gpu_step.cc (and of train_bench's
BM_ResNet50StepCuda): torchvision's ResNet-50, batch 256 of 224x224 random
images, SGD (lr 0.1, momentum 0.9, weight decay 1e-4), zero_grad + forward +
cross-entropy + backward + step, loss.item() at the end of each step as ours
does. Runs on the lent GPU machine (its python3 has torch and torchvision);
bench/gpu_perf.sh runs it beside ours, rounds interleaved.

  python3 bench/resnet50_cuda_peer.py [--configs fp32,tf32,bf16] [--layouts nchw,cl]
      [--batch 256] [--image 224] [--warmup 3] [--steps 10] [--profile-top K]
      [--benchmark] [--device cuda|cpu]

Configurations (the same names as gpu_step's):
  fp32  float32 without TF32 (cudnn.allow_tf32 = matmul.allow_tf32 = False);
  tf32  PyTorch's defaults (cuDNN may use TF32, matmul not);
  bf16  torch.autocast(bfloat16) around forward and loss, TF32 defaults.
--benchmark sets torch.backends.cudnn.benchmark (measured algorithm choice;
off by default, as ours picks by heuristics unless asked). --device cpu
exists for gpu_perf.sh --smoke on a machine without a GPU.

Prints one line per (config, layout), as gpu_step does:
  torch config=tf32 layout=cl batch=256 median_ms=... min_ms=... max_ms=... steps=10
and with --profile-top K one profiled step's top K ops by self CUDA time
(torch.profiler, CUDA activity) as `torch_op config=.. layout=.. calls=..
self_ms=.. total_ms=.. name=..` lines.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_profile import op_fields, profile_step  # noqa: E402


def step_fn(model, opt, x, y, amp, device):
    def step():
        opt.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def run(a, config, layout):
    torch.backends.cudnn.allow_tf32 = config != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = a.benchmark
    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
    model = torchvision.models.resnet50(num_classes=1000).to(a.device).to(memory_format=fmt)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(a.batch, 3, a.image, a.image, device=a.device).to(memory_format=fmt)
    y = torch.randint(0, 1000, (a.batch,), device=a.device)
    step = step_fn(model, opt, x, y, config == "bf16", a.device)
    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"torch config={config} layout={layout} batch={a.batch} median_ms={statistics.median(times):.3f} "
          f"min_ms={min(times):.3f} max_ms={max(times):.3f} steps={len(times)}", flush=True)
    if a.profile_top > 0:
        rows, launches = profile_step(step, a.device, a.profile_top)
        if launches:
            print(f"torch_launches config={config} layout={layout} kernels={launches[0]} copies={launches[1]}",
                  flush=True)
        for r in rows:
            print(f"torch_op config={config} layout={layout} {op_fields(r)}", flush=True)
    del model, opt, x, y
    if a.device == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="fp32,tf32,bf16")
    ap.add_argument("--layouts", default="nchw,cl")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-top", type=int, default=0)
    ap.add_argument("--benchmark", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args()
    configs, layouts = a.configs.split(","), a.layouts.split(",")
    for c in configs:
        if c not in ("fp32", "tf32", "bf16"):
            sys.exit(f"resnet50_cuda_peer: unknown config '{c}' (fp32, tf32, bf16)")
    for l in layouts:
        if l not in ("nchw", "cl"):
            sys.exit(f"resnet50_cuda_peer: unknown layout '{l}' (nchw, cl)")
    if a.steps < 1:
        sys.exit("resnet50_cuda_peer: --steps must be at least 1")
    for c in configs:
        for l in layouts:
            run(a, c, l)


if __name__ == "__main__":
    main()
