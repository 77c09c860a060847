#!/usr/bin/env python3
"""Turns bench/gpu_perf.sh's raw.txt and meta.txt (in the folder given) into
gpu_resnet50.json, gpu_breakdown.json and gpu_gpt.json beside them, and prints
the tables.

gpu_resnet50.json: device, driver, torch and cuDNN versions, date, commit,
and rows: one per configuration (name = config/layout) with ours_ms and
torch_ms (the median over rounds of each round's median step), their
ranges over rounds, and ratio = ours_ms / torch_ms.
gpu_gpt.json: one row per precision (gpt_fsdp/<amp>, <amp>_cudagraph for
the step replayed as one CUDA graph, <amp>_float8 for the blocks' linear
layers in float8, each beside torch's <amp> eager step) with params, mfu (model FLOPs from
PaLM's formula over the device's dense bf16 peak), ours_tokens_per_s,
torch_tokens_per_s, ratio = ours / torch tokens per second, and with the
graph ours_host_fraction (the host's time to queue a step over the step's).
gpu_breakdown.json: per configuration, the top ops of one profiled step,
ours beside PyTorch's; the convolution algorithms ours chose;
and both steps in benchmark mode; bn_cuda_bench's rows when run.
gpu_gpt_breakdown.json (the gpt_breakdown part): one row per precision
(gpt_fsdp/<amp>) with the GPT step's top ops by GPU self time per step,
ours (the profiler's, over 3 steps) beside PyTorch's (torch.profiler, one
step), our GPU's idle time per step and the ops it waited before, and
PyTorch's kernel launches per step.
"""
import json
import os
import re
import statistics
import sys


def parse_kv(line):
    """'a=1 b=x name=rest of line' -> dict; name= takes the rest of the line."""
    out = {}
    m = re.search(r"(?:^| )name=(.*)$", line)
    if m:
        out["name"] = m.group(1)
        line = line[: m.start()]
    for tok in line.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
    return out


# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) by device name, for
# the GPT rows' model FLOPs utilisation: NVIDIA's data sheets (H100 SXM and
# H200 989.4 TFLOP/s, H100 PCIe 756, A100 312).
DENSE_BF16_PEAK = [("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100", 989.4e12), ("A100", 312.0e12)]


def dense_bf16_peak(device):
    for name, peak in DENSE_BF16_PEAK:
        if name in device:
            return peak
    return None


def model_flops_per_token(kv):
    """PaLM's model FLOPs per token, 6 N + 12 L d T (forward and backward,
    attention's products counted whole, as torchtitan and nanoGPT count them;
    a causal kernel skips half of them, which MFU does not credit), with N the
    parameters outside the embeddings (vocabulary x d tokens, T x d
    positions), as torchtitan takes it. None without the line's shape."""
    try:
        n, vocab = int(kv["params"]), int(kv["vocab"])
        layers, dim, seq = int(kv["layers"]), int(kv["dim"]), int(kv["seq"])
    except (KeyError, ValueError):
        return None
    return 6 * (n - vocab * dim - seq * dim) + 12 * layers * dim * seq


def op_row(kv, calls):
    """An op line's fields as a breakdown row; calls: int (one profiled
    step) or float (an average over steps)."""
    return {"name": kv["name"], "calls": calls(kv["calls"]), "self_ms": float(kv["self_ms"]),
            "total_ms": float(kv["total_ms"])}


def gap_row(kv, calls):
    """A line of the GPU's idle time before an op, as a row."""
    return {"name": kv["name"], "calls": calls(kv["calls"]), "gap_ms": float(kv["gap_ms"])}


def print_top_ops(title, ours, torch, n):
    """Two columns of the top n ops: ours | torch, self ms."""
    print(f"\n{title}")
    a, b = ours[:n], torch[:n]
    for i in range(max(len(a), len(b))):
        left = f"{a[i]['name'][:34]:34} {a[i]['self_ms']:8.2f}" if i < len(a) else " " * 43
        right = f"{b[i]['name'][:40]:40} {b[i]['self_ms']:8.2f}" if i < len(b) else ""
        print(f"  {left} | {right}")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: gpu_perf_summary.py OUTDIR")
    d = sys.argv[1]
    meta = {}
    with open(os.path.join(d, "meta.txt")) as f:
        for line in f:
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                meta[k] = v
    dev = meta.get("device", "unknown")
    parts = [p.strip() for p in dev.split(",")]
    head = {
        "device": parts[0],
        "driver": parts[1] if len(parts) > 1 else None,
        "memory": parts[2] if len(parts) > 2 else None,
        "torch": meta.get("torch"),
        "cudnn": meta.get("cudnn"),
        "date": meta.get("date"),
        "commit": meta.get("commit"),
    }
    speed = {}  # (side, config, layout) -> [round medians]
    copies = {}  # (config, layout) -> our layout copies per step (the last round's)
    ops = {}    # (side, config, layout) -> rows
    algos, bench_rows, kernel_rows, launches = [], [], [], []
    idle, gaps = {}, {}  # (config, layout) -> our GPU's idle ms in the profiled step; the ops it waited before
    host = {}  # (config, layout) -> our rounds' median host ms to issue a step
    gpt, gpt_mem = {}, {}  # (side, amp) -> [round tokens/s]; amp -> our peak MiB
    gpt_model, gpt_host = {}, {}  # amp -> our line's fields (params, shape); amp -> [round host fractions]
    gpt_ops, gpt_idle, gpt_gaps, gpt_launches = {}, {}, {}, {}  # (side, amp) -> rows; amp -> ms; rows; counts
    with open(os.path.join(d, "raw.txt")) as f:
        for line in f:
            line = line.rstrip("\n")
            m = re.match(r"part=(\w+) round=(\d+) (.*)$", line)
            if not m:
                continue
            part, rest = m.group(1), m.group(3)
            if part == "algos":
                algos.append(rest)
                continue
            if part == "kernels":
                kernel_rows.append(rest)
                continue
            side = rest.split(" ", 1)[0]
            kv = parse_kv(rest)
            key = (kv.get("config"), kv.get("layout"))
            if part == "gpt_breakdown":
                amp = kv.get("amp")
                if side in ("ours_gpt_op", "torch_gpt_op"):
                    gpt_ops.setdefault((side.split("_")[0], amp), []).append(op_row(kv, float))
                elif side == "ours_gpt_idle":
                    gpt_idle[amp] = float(kv["idle_ms"])
                elif side == "ours_gpt_gap":
                    gpt_gaps.setdefault(amp, []).append(gap_row(kv, float))
                elif side == "torch_gpt_launches":
                    gpt_launches[amp] = {"kernels": int(kv["kernels"]), "copies": int(kv["copies"])}
                continue
            if side in ("ours_gpt", "torch_gpt"):
                gpt.setdefault((side.split("_")[0], kv["amp"]), []).append(float(kv["tokens_per_s"]))
                if "mem_peak_mib" in kv:
                    gpt_mem[kv["amp"]] = float(kv["mem_peak_mib"])
                if side == "ours_gpt":
                    gpt_model[kv["amp"]] = kv
                    if "host_fraction" in kv:
                        gpt_host.setdefault(kv["amp"], []).append(float(kv["host_fraction"]))
                continue
            if side in ("ours", "torch") and part == "speed":
                speed.setdefault((side,) + key, []).append(float(kv["median_ms"]))
                if side == "ours" and "layout_copies" in kv:
                    copies[key] = float(kv["layout_copies"])
                if side == "ours" and "host_ms" in kv:
                    host.setdefault(key, []).append(float(kv["host_ms"]))
            elif side in ("ours_op", "torch_op"):
                ops.setdefault((side[:-3],) + key, []).append(op_row(kv, int))
            elif side == "ours_idle":
                idle[key] = float(kv["idle_ms"])
            elif side == "ours_gap":
                gaps.setdefault(key, []).append(gap_row(kv, int))
            elif side == "torch_launches":
                launches.append({"name": f"{key[0]}/{key[1]}", "torch_kernels": int(kv["kernels"]),
                                 "torch_copies": int(kv["copies"])})
            elif side in ("torch_benchmark", "ours_benchmark"):
                bench_rows.append({"name": f"{key[0]}/{key[1]}", "side": side.split("_")[0],
                                   "median_ms": float(kv["median_ms"])})
    rows = []
    for (side, config, layout), meds in sorted(speed.items()):
        if side != "ours":
            continue
        # <layout>_alt: our step with cuDNN called the other way (gpu_perf.sh),
        # <layout>_cudagraph: our step replayed as one CUDA graph; each beside
        # PyTorch's eager step in that layout.
        theirs = speed.get(("torch", config, layout.removesuffix("_alt").removesuffix("_cudagraph")), [])
        row = {"name": f"{config}/{layout}", "rounds": len(meds),
               "ours_ms": round(statistics.median(meds), 2), "ours_range_ms": [round(min(meds), 2), round(max(meds), 2)]}
        if (config, layout) in copies:
            row["ours_layout_copies_per_step"] = copies[(config, layout)]
        if (config, layout) in host:
            row["ours_host_ms"] = round(statistics.median(host[(config, layout)]), 3)
            row["ours_host_fraction"] = round(row["ours_host_ms"] / row["ours_ms"], 3)
        if theirs:
            row.update({"torch_ms": round(statistics.median(theirs), 2),
                        "torch_range_ms": [round(min(theirs), 2), round(max(theirs), 2)]})
            row["ratio"] = round(row["ours_ms"] / row["torch_ms"], 3)
        rows.append(row)
    if rows:
        with open(os.path.join(d, "gpu_resnet50.json"), "w") as f:
            json.dump(dict(head, workload="ResNet-50 training step, batch 256, 224x224, SGD momentum",
                           rows=rows), f, indent=1)
        print(f"{'config/layout':16} {'ours ms':>10} {'torch ms':>10} {'ratio':>7}")
        for r in rows:
            print(f"{r['name']:16} {r['ours_ms']:10.2f} {r.get('torch_ms', float('nan')):10.2f} "
                  f"{r.get('ratio', float('nan')):7.3f}")
    if gpt:
        grows = []
        for amp in sorted({a for (_, a) in gpt}):
            # <amp>_cudagraph: our step replayed as one CUDA graph; <amp>_float8:
            # our blocks' linears in float8 (MFU still over the bf16 peak, as
            # torchtitan reports it); each beside PyTorch's eager step in <amp>.
            base = amp.removesuffix("_cudagraph").removesuffix("_float8")
            o, t = gpt.get(("ours", amp), []), gpt.get(("torch", base), [])
            row = {"name": f"gpt_fsdp/{amp}", "rounds": len(o)}
            model = gpt_model.get(amp, {})
            if "params" in model:
                row["params"] = int(model["params"])
            if o:
                row.update({"ours_tokens_per_s": round(statistics.median(o), 1),
                            "ours_range": [round(min(o), 1), round(max(o), 1)], "ours_peak_mib": gpt_mem.get(amp)})
                flops = model_flops_per_token(model)
                peak = dense_bf16_peak(head.get("device", ""))
                if flops and peak:
                    row["mfu"] = round(row["ours_tokens_per_s"] * flops / peak, 4)
            if amp in gpt_host:
                row["ours_host_fraction"] = round(statistics.median(gpt_host[amp]), 4)
            if t:
                row.update({"torch_tokens_per_s": round(statistics.median(t), 1),
                            "torch_range": [round(min(t), 1), round(max(t), 1)]})
            if o and t:
                row["ratio"] = round(row["ours_tokens_per_s"] / row["torch_tokens_per_s"], 3)
            grows.append(row)
        with open(os.path.join(d, "gpu_gpt.json"), "w") as f:
            json.dump(dict(head, workload="GPT, one GPU, FULL_SHARD (ours) / FSDP2 fully_shard (torch), AdamW, "
                                         "clip 1.0; ratio = ours / torch tokens per second (higher is faster)",
                           rows=grows), f, indent=1)
        print(f"\n{'gpt':24} {'ours tok/s':>12} {'torch tok/s':>12} {'ratio':>7}")
        for r in grows:
            print(f"{r['name']:24} {r.get('ours_tokens_per_s', float('nan')):12.1f} "
                  f"{r.get('torch_tokens_per_s', float('nan')):12.1f} {r.get('ratio', float('nan')):7.3f}")
    if gpt_ops:
        brows = []
        for amp in sorted({a for (_, a) in gpt_ops}):
            brows.append({"name": f"gpt_fsdp/{amp}", "ours_top_ops": gpt_ops.get(("ours", amp), []),
                          "torch_top_ops": gpt_ops.get(("torch", amp), []), "ours_gpu_idle_ms": gpt_idle.get(amp),
                          "ours_idle_before": gpt_gaps.get(amp, []), "torch_launches": gpt_launches.get(amp)})
        with open(os.path.join(d, "gpu_gpt_breakdown.json"), "w") as f:
            json.dump(dict(head, workload="GPT step on one GPU (gpu_gpt.json's), per step: ours over 3 profiled "
                                         "steps, torch over one",
                           note="self_ms: GPU self time (ours: the profiler's CUDA event pairs; torch: "
                                "torch.profiler's self device time); host self time where no GPU ran (--smoke)",
                           rows=brows), f, indent=1)
        for r in brows:
            print_top_ops(f"{r['name']}: top ops per step (ours | torch), self ms", r["ours_top_ops"],
                          r["torch_top_ops"], 15)
            if r["ours_gpu_idle_ms"] is not None:
                print(f"  our GPU idle a step: {r['ours_gpu_idle_ms']:.2f} ms")
    if ops or algos or kernel_rows:
        configs = sorted({(c, l) for (_, c, l) in ops})
        breakdown = {"configs": [], "algorithms_ours": algos, "benchmark_mode": bench_rows, "torch_launches": launches,
                     "batch_norm_kernels": kernel_rows}
        for c, l in configs:
            breakdown["configs"].append({"name": f"{c}/{l}", "ours_top_ops": ops.get(("ours", c, l), []),
                                         "torch_top_ops": ops.get(("torch", c, l), []),
                                         "ours_gpu_idle_ms": idle.get((c, l)), "ours_idle_before": gaps.get((c, l), [])})
        with open(os.path.join(d, "gpu_breakdown.json"), "w") as f:
            json.dump(dict(head, note="ours: GPU time per op from the profiler's CUDA event pairs; "
                                     "torch: self CUDA time from torch.profiler", **breakdown), f, indent=1)
        for cfg in breakdown["configs"]:
            print_top_ops(f"{cfg['name']}: top ops (ours | torch), self ms", cfg["ours_top_ops"],
                          cfg["torch_top_ops"], 12)
            if cfg["ours_gpu_idle_ms"] is not None:
                print(f"  our GPU idle in the step: {cfg['ours_gpu_idle_ms']:.2f} ms, before: " +
                      ", ".join(f"{g['name']} {g['gap_ms']:.2f}" for g in cfg["ours_idle_before"][:5]))


if __name__ == "__main__":
    main()
