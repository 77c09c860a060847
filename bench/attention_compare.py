#!/usr/bin/env python3
"""Attention on the GPU: ours (//bench:attention_cuda_bench, the fused and
the blocked kernels) beside PyTorch's scaled_dot_product_attention with its
flash backend (torch.nn.attention.sdpa_kernel(FLASH_ATTENTION)), the same
shapes (batch 8, sequence 2,048, hidden 2,048 as 32 heads of 64 or 16 of
128, bfloat16; causal and, at d 128, not), forward and forward + backward,
FLOPs counted as FlashAttention does (4 b h T^2 d forward, halved when
causal; backward 2.5x). Rounds interleave ours and PyTorch; the JSON rows
hold the medians over rounds and ours / PyTorch TFLOP/s (higher is faster).
The float32 rows (names ending "float32": head dim 64 causal, the GPT's, and
128) put the path our op takes for float32 beside SDPA's efficient backend,
PyTorch's for float32 (three TF32 tensor-core products a product).

  python3 bench/attention_compare.py --ours "bash .gpu/run.sh attention_cuda_bench" \\
      [--rounds 3] [--out gpu_attention.json] [--lean] [--smoke]

--lean: only our fused kernels with their default tiles (the rows the
ratio is set on), not the blocked, deterministic, 64-key and one-stage
ones: 6 of the 18 runs of ours a round.

--smoke: tiny shapes on the CPU for PyTorch and ours read from a canned
line, to check the script itself without a GPU.
"""
import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys

B, T, HIDDEN = 8, 2048, 2048


def flops(d, causal, bwd, b=B, t=T):
    fwd = 4.0 * b * (HIDDEN // d) * t * t * d / (2 if causal else 1)
    return fwd * (3.5 if bwd else 1.0)


def key(d, causal, bwd, f32=False):
    return f"d{d}{' causal' if causal else ''} {'fwd+bwd' if bwd else 'fwd'}{' float32' if f32 else ''}"


# (head dim, causal, backward, fused, deterministic, key tiles, backward
# stages, float32): (.., 1, 1, 0, 0, 0) is the fused backward with its dQ
# pass (deterministic_algorithms) instead of atomics; key tiles 64 the fused
# kernels with 64-key tiles instead of the default 128, stages 1 the fused
# backward loading its query tiles in one stage instead of two
# (set_attention_cuda_flash_tiles); float32 1 float32 q, k, v on the op's
# default path.
CONFIGS = [(64, 1, 0, 1, 0, 0, 0, 0), (64, 1, 1, 1, 0, 0, 0, 0), (64, 1, 0, 0, 0, 0, 0, 0), (64, 1, 1, 0, 0, 0, 0, 0),
           (128, 1, 0, 1, 0, 0, 0, 0), (128, 1, 1, 1, 0, 0, 0, 0), (128, 1, 0, 0, 0, 0, 0, 0),
           (128, 1, 1, 0, 0, 0, 0, 0), (128, 0, 0, 1, 0, 0, 0, 0), (128, 0, 1, 1, 0, 0, 0, 0),
           (64, 1, 1, 1, 1, 0, 0, 0), (128, 1, 1, 1, 1, 0, 0, 0), (64, 1, 0, 1, 0, 64, 0, 0),
           (64, 1, 1, 1, 0, 64, 0, 0), (128, 1, 1, 1, 0, 64, 0, 0), (128, 0, 1, 1, 0, 64, 0, 0),
           (64, 1, 1, 1, 0, 0, 1, 0), (128, 1, 1, 1, 0, 0, 1, 0),
           (64, 1, 0, 1, 0, 0, 0, 1), (64, 1, 1, 1, 0, 0, 0, 1), (128, 1, 1, 1, 0, 0, 0, 1)]
# PyTorch's side of the float32 rows: (head dim, causal, backward).
TORCH_F32 = [(64, True, False), (64, True, True), (128, True, True)]


def lean(cfg):
    """The fused kernels with their default tiles and stages and dQ atomics,
    and the float32 rows (the op's default path for float32)."""
    return cfg[3] == 1 and cfg[4] == 0 and cfg[5] == 0 and cfg[6] == 0


def commit():
    """COMMIT, else the bundle's stamp (tools/gpu_bundle.sh), else unknown."""
    stamp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".gpu", "COMMIT")
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    return open(stamp).read().strip() if os.path.exists(stamp) else "unknown"


def run_ours(cmd, configs):
    """{(impl, key): TFLOP/s} from the benchmark's JSON, one process per
    configuration so that one failing leaves the others measured (its
    stderr's tail goes to ours'  stderr)."""
    res = {}
    for cfg in configs:
        p = subprocess.run(shlex.split(cmd) + ["--benchmark_format=json",
                                               "--benchmark_filter=BM_Attention/" + "/".join(map(str, cfg)) + "/"],
                           capture_output=True, text=True)
        if p.returncode != 0 or "{" not in p.stdout:
            print(f"ours {cfg} failed (rc {p.returncode}): {p.stderr[-1500:]}", file=sys.stderr, flush=True)
            continue
        for bm in json.loads(p.stdout[p.stdout.index("{"):])["benchmarks"]:
            if bm.get("error_occurred"):  # no GPU (--smoke)
                continue
            # flash fwd+bwd d64 causal (flash-det: deterministic, flash-k64: 64-key tiles, flash-s1: one stage;
            # f32: float32 on the op's default path, the row's ours beside torch's float32)
            label = bm["label"].split()
            impl, mode, d, causal = label[0], label[1], int(label[2][1:]), "causal" in label
            f32 = impl == "f32"
            res[("flash" if f32 else impl, key(d, causal, mode == "fwd+bwd", f32))] = bm["TFLOP/s"]
    return res


def run_torch(smoke):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    dev = "cpu" if smoke else "cuda"
    b, t = (1, 128) if smoke else (B, T)
    res = {}
    runs = [(d, causal, bwd, False) for d, causal in [(64, True), (128, True), (128, False)] for bwd in (False, True)]
    runs += [(d, causal, bwd, True) for d, causal, bwd in TORCH_F32]
    for d, causal, bwd, f32 in runs:
        h = HIDDEN // d
        q, k, v, g = (torch.randn(b, h, t, d, device=dev, dtype=torch.float32 if f32 else torch.bfloat16)
                      for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(bwd)

        def step():
            if smoke:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            else:  # flash takes 16-bit inputs alone; float32 goes to the efficient backend
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION if f32 else SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if bwd:
                out.backward(g)

        for _ in range(3):
            step()
        iters = 2 if smoke else 30
        if smoke:
            import time
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            sec = (time.perf_counter() - t0) / iters
        else:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            torch.cuda.synchronize()
            sec = start.elapsed_time(end) / 1e3 / iters
        res[key(d, causal, bwd, f32)] = flops(d, causal, bwd, b, t) / sec / 1e12
    return res, torch.__version__


def device_meta(smoke):
    if smoke:
        return {"device": "cpu (smoke)"}
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip().split(", ")
    return {"device": q[0], "driver": q[1], "memory": q[2]}


def write(a, ours, torch_runs, version, final):
    """The JSON of the rounds so far: written after each round, so a run
    cut short by its time limit still leaves the finished rounds."""
    rows = []
    for k_ in sorted(torch_runs[0]):
        th = [t_[k_] for t_ in torch_runs]
        fl = [o[("flash", k_)] for o in ours if ("flash", k_) in o]
        bl = [o[("blocked", k_)] for o in ours if ("blocked", k_) in o]
        dt = [o[("flash-det", k_)] for o in ours if ("flash-det", k_) in o]
        k64 = [o[("flash-k64", k_)] for o in ours if ("flash-k64", k_) in o]
        s1 = [o[("flash-s1", k_)] for o in ours if ("flash-s1", k_) in o]
        row = {"name": k_, "rounds": len(th), "torch_tflops": round(statistics.median(th), 1),
               "torch_range": [round(min(th), 1), round(max(th), 1)]}
        if fl:
            row.update(ours_tflops=round(statistics.median(fl), 1), ours_range=[round(min(fl), 1), round(max(fl), 1)],
                       ratio=round(statistics.median(fl) / statistics.median(th), 3))
        if bl:
            row["ours_blocked_tflops"] = round(statistics.median(bl), 1)
        if dt:
            row["ours_deterministic_tflops"] = round(statistics.median(dt), 1)
        if k64:
            row["ours_k64_tflops"] = round(statistics.median(k64), 1)
        if s1:
            row["ours_s1_tflops"] = round(statistics.median(s1), 1)
        rows.append(row)
        if final:
            print(json.dumps(row))
    doc = dict(device_meta(a.smoke), torch=version,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               commit=commit(),
               workload=f"scaled_dot_product_attention, bfloat16 (float32 in the rows so named), batch {B}, "
               f"sequence {T}, hidden {HIDDEN}; "
               "ours: the fused (flash) kernels and the blocked ones, through the op and autograd (deterministic: "
               "the fused backward with its dQ pass instead of atomics; k64: 64-key tiles instead of 128; s1: the backward's "
               "query tiles in one stage instead of two; float32 rows: the op's path for float32); torch: SDPA's "
               "flash backend (float32: its efficient backend); TFLOP/s as FlashAttention counts them; ratio = ours flash / torch (higher is faster)",
               rows=rows, command="python3 bench/attention_compare.py --ours 'bash .gpu/run.sh attention_cuda_bench' "
               f"--rounds {a.rounds}" + (" --lean" if a.lean else ""))
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="gpu_attention.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--lean", action="store_true")
    a = ap.parse_args()
    configs = [c for c in CONFIGS if lean(c)] if a.lean else CONFIGS
    ours, torch_runs, version = [], [], None
    for r in range(a.rounds):
        ours.append(run_ours(a.ours, configs))
        tr, version = run_torch(a.smoke)
        torch_runs.append(tr)
        for k_, v_ in sorted(tr.items()):
            print(f"round {r} {k_}: ours flash {ours[-1].get(('flash', k_), float('nan')):.1f} "
                  f"blocked {ours[-1].get(('blocked', k_), float('nan')):.1f} torch {v_:.1f} TFLOP/s", flush=True)
        write(a, ours, torch_runs, version, r == a.rounds - 1)


if __name__ == "__main__":
    sys.exit(main())
