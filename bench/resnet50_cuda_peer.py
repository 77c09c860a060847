#!/usr/bin/env python3
"""PyTorch's side of BM_ResNet50StepCuda (bench/train_bench.cc): torchvision's
ResNet-50, batch 256 of 224x224 random images, SGD (lr 0.1, momentum 0.9,
weight decay 1e-4), zero_grad + forward + cross-entropy + backward + step,
loss.item() at the end of each step as ours does. Runs on the lent GPU
machine (its python3 has torch and torchvision); tools/gpu_check.sh runs it
beside ours in one call.

  python3 bench/resnet50_cuda_peer.py [--steps 10] [--tf32]

By default float32 convolutions run without TF32, as ours do (CUDNN_FMA_MATH);
--tf32 shows PyTorch's default (torch.backends.cudnn.allow_tf32 = True).
Prints one line per layout: median step time and images per second.
"""
import argparse
import statistics
import time

import torch
import torchvision


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tf32", action="store_true")
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = a.tf32
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.benchmark = False  # ours uses cuDNN's heuristics, not measured choices
    for channels_last in (True, False):
        torch.manual_seed(0)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        model = torchvision.models.resnet50(num_classes=1000).cuda().to(memory_format=fmt)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        x = torch.randn(a.batch, 3, 224, 224, device="cuda").to(memory_format=fmt)
        y = torch.randint(0, 1000, (a.batch,), device="cuda")

        def step():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()

        for _ in range(3):
            step()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"torch ResNet50 step batch {a.batch} channels_last={int(channels_last)} tf32={int(a.tf32)}: "
              f"median {med * 1e3:.1f} ms, {a.batch / med:.0f} img/s")


if __name__ == "__main__":
    main()
