#!/usr/bin/env python3
"""Per-rank memory of //examples:gpt on every 8-rank mesh: the mesh planner's
prediction (distributed/parallel/mesh_plan.h, printed by the run as "memory
plan (mesh planner, ...)") beside the measured peak ("memory peak", the
largest rank's, by part). One run per mesh, float32 on the CPU (Gloo).

  bazel build -c opt --config=cpu --repo_env=EMBER_CUDA_PATH=/nonexistent //examples:gpt
  python3 bench/mesh_memory.py --gpt bazel-bin/examples/gpt --out bench/results/mesh_memory.json
"""
import argparse
import json
import re
import subprocess
import sys
import tempfile

MODEL = ["--dim", "256", "--heads", "4", "--seq", "128", "--layers", "8", "--max-steps", "3",
         "--global-batch", "32", "--microbatches", "4", "--sample-len", "0", "--eval-every", "100"]


def meshes(world=8, heads=4, layers=8):
    for pp in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8):
            if tp > heads or (world // pp) % tp or pp > layers:
                continue
            rest = world // pp // tp
            for shard in [d for d in range(1, rest + 1) if rest % d == 0]:
                yield rest // shard, shard, tp, pp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt", required=True)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for r, s, t, p in meshes():
        with tempfile.TemporaryDirectory() as d:
            cmd = [a.gpt, "--nproc", "8", "--dp-replicate", str(r), "--dp-shard", str(s), "--tp", str(t),
                   "--pp", str(p)] + MODEL + ["--checkpoint-dir", d]
            out = subprocess.run(cmd, capture_output=True, text=True).stdout
        peak = re.search(r"memory peak ([0-9.]+) MiB: params ([0-9.]+), grads ([0-9.]+), optimizer ([0-9.]+), "
                         r"gathered ([0-9.]+), activations ([0-9.]+), other ([0-9.]+)", out)
        plan = re.search(r"memory plan \(mesh planner, [^)]*\): ([0-9.]+) MiB: params\+grads\+optimizer ([0-9.]+), "
                         r"gathered ([0-9.]+), activations ([0-9.]+), buffers ([0-9.]+)", out)
        step = re.findall(r"(\d+) tok/s", out)
        if not peak or not plan:
            print(f"R{r} S{s} T{t} P{p}: no memory lines\n{out[-2000:]}", file=sys.stderr)
            continue
        m = [float(x) for x in peak.groups()]
        q = [float(x) for x in plan.groups()]
        rows.append({"dp_replicate": r, "dp_shard": s, "tp": t, "pp": p,
                     "measured_mib": m[0], "measured": {"params": m[1], "grads": m[2], "optimizer": m[3],
                                                        "gathered": m[4], "activations": m[5], "other": m[6]},
                     "planned_mib": q[0], "planned": {"state": q[1], "gathered": q[2], "activations": q[3],
                                                      "buffers": q[4]},
                     "error": q[0] / m[0] - 1, "tokens_per_s": int(step[-1]) if step else 0})
        x = rows[-1]
        print(f"| {r} | {s} | {t} | {p} | {x['planned_mib']:.1f} | {x['measured_mib']:.1f} | {100 * x['error']:+.1f}% "
              f"| {m[1] + m[2] + m[3]:.1f} / {q[1]:.1f} | {m[4]:.1f} / {q[2]:.1f} | {m[5]:.1f} / {q[3]:.1f} |",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": MODEL, "rows": rows}, f, indent=1)
    worst = max(abs(x["error"]) for x in rows)
    print(f"{len(rows)} meshes; largest error {100 * worst:.1f}%")


if __name__ == "__main__":
    main()
