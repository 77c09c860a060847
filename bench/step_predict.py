#!/usr/bin/env python3
"""The step-time prediction against measured steps (the cost model's validation).

For each configuration //examples:gpt and //examples:resnet_ddp run on 2,
4 and 8 CPU ranks, runs
the example (one thread per rank, its default model: 2 layers, dim 128, 4
heads, context 64, 16 sequences per data-parallel rank and micro-batch,
float32, AdamW), takes the median of its steps' wall times (--metrics'
step_s, after warm-up steps; resnet_ddp's "step time:" line, DDP over the
narrow ResNet-18, 64 Fashion-MNIST images per rank), and asks //tools:plan
for the same mesh with
this machine's measured compute (bench/results/compute_profile.json) and
collectives (bench/results/collectives_fit.json). Rounds interleave the
configurations; the median over rounds is reported. Writes a JSON of every
run and prints the docs' table.

  bazel build -c opt //examples:gpt //tools:plan
  python3 bench/step_predict.py --rounds 3 --out bench/results/step_predict.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# (ranks, the example's flags); the mesh flags are //tools:plan's too.
CONFIGS = [
    (2, "--dp-shard 2"),
    (2, "--dp-shard 2 --strategy grad_op"),
    (2, "--dp-shard 2 --strategy no_shard"),
    (2, "--dp-replicate 2 --dp-shard 1"),
    (2, "--dp-shard 2 --accum-steps 2"),
    (2, "--tp 2 --dp-shard 1"),
    (2, "--tp 2 --dp-shard 1 --sp off"),
    (2, "--pp 2 --dp-shard 1 --pp-schedule 1f1b --microbatches 4"),
    (2, "--pp 2 --dp-shard 1 --pp-schedule gpipe --microbatches 4"),
    (2, "--pp 2 --dp-shard 1 --pp-schedule zb-h1 --microbatches 4"),
    (2, "--pp 2 --dp-shard 1 --pp-schedule interleaved --pp-virtual 2 --microbatches 4 --layers 4"),
    (2, "--dp-shard 2 --ac full"),
    (4, "--dp-shard 4"),
    (4, "--dp-replicate 2 --dp-shard 2"),
    (4, "--dp-shard 2 --tp 2"),
    (4, "--tp 4 --dp-shard 1"),
    (4, "--pp 2 --tp 2 --dp-shard 1 --microbatches 4"),
    (4, "--pp 2 --dp-shard 2 --microbatches 4"),
    (4, "--pp 2 --dp-replicate 2 --dp-shard 1 --microbatches 4"),
    (8, "--dp-shard 8"),
    (8, "--dp-replicate 2 --dp-shard 4"),
    (8, "--dp-shard 4 --tp 2"),
    (8, "--dp-shard 2 --tp 2 --pp 2 --microbatches 4"),
    (8, "--dp-replicate 2 --tp 2 --pp 2 --dp-shard 1 --microbatches 4"),
]
SEQ, DIM, HEADS, BATCH, VOCAB = 64, 128, 4, 16, None
RESNET = [2, 4, 8]  # ranks of //examples:resnet_ddp (DDP), its default 64 images per rank
RESNET_BATCH = 64


def flag(flags, name, default):
    f = flags.split()
    return f[f.index(name) + 1] if name in f else default


def run_example(gpt, ranks, flags, steps, warmup):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [gpt, "--nproc", str(ranks), *flags.split(), "--max-steps", str(steps), "--eval-every", "100000",
               "--sample-len", "0", "--checkpoint-dir", os.path.join(tmp, "ck"), "--metrics", metrics]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"step_predict: {' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
        lines = [json.loads(l) for l in open(metrics)]
        return statistics.median(l["step_s"] for l in lines[warmup:])


def run_resnet(resnet, ranks, steps):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [resnet, "--nproc", str(ranks), "--epochs", "1", "--max-steps", str(steps), "--eval-size", "64",
               "--checkpoint-dir", os.path.join(tmp, "ck")]
        out = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
        line = next((l for l in (out.stdout + out.stderr).splitlines() if "step time: median " in l), None)
        if out.returncode != 0 or line is None:
            sys.exit(f"step_predict: {' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
        return float(line.split("step time: median ")[1].split()[0]) / 1e3


def predict_resnet(plan, ranks, profile, fit):
    cmd = [plan, "--model", "resnet18-narrow", "--gpus", str(ranks), "--gpus-per-host", str(ranks),
           "--global-batch", str(RESNET_BATCH * ranks), "--dtype", "fp32", "--dp-replicate", str(ranks),
           "--dp-shard", "1", "--compute-profile", profile, "--comm-fit", fit]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"step_predict: {' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    step = next(l for l in out.stdout.splitlines() if l.startswith("predicted step: "))
    return float(step.split()[2]), out.stdout


def predict(plan, ranks, flags, profile, fit, vocab):
    dp = ranks // (int(flag(flags, "--tp", 1)) * int(flag(flags, "--pp", 1)))
    pp = int(flag(flags, "--pp", 1))
    micro = int(flag(flags, "--microbatches", flag(flags, "--accum-steps", pp if pp > 1 else 1)))
    # The example's global batch: --batch-size per data-parallel rank and micro-batch.
    batch = BATCH * dp * micro
    f = flags.split()
    args = []
    i = 0
    while i < len(f):
        if f[i] in ("--accum-steps",):
            args += ["--microbatches", f[i + 1]]
        elif f[i] == "--layers":
            pass
        else:
            args += f[i:i + 2]
        i += 2
    layers = flag(flags, "--layers", "2")
    allreduces = 3 + (1 if pp > 1 else 0)  # gradient norm, memory peak, loss (and the loss over pp)
    cmd = [plan, "--layers", layers, "--dim", str(DIM), "--heads", str(HEADS), "--vocab", str(vocab), "--seq",
           str(SEQ), "--gpus", str(ranks), "--gpus-per-host", str(ranks), "--global-batch", str(batch), "--dtype",
           "fp32", *args, "--step-allreduces", str(allreduces), "--compute-profile", profile, "--comm-fit", fit]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"step_predict: {' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    step = next(l for l in out.stdout.splitlines() if l.startswith("predicted step: "))
    return float(step.split()[2]), out.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpt", default="bazel-bin/examples/gpt")
    ap.add_argument("--plan", default="bazel-bin/tools/plan")
    ap.add_argument("--resnet", default="bazel-bin/examples/resnet_ddp")
    ap.add_argument("--profile", default="bench/results/compute_profile.json")
    ap.add_argument("--fit", default="bench/results/collectives_fit.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=114, help="the fortunes' characters, as the example reports")
    ap.add_argument("--only", default="", help="configurations whose flags contain this")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    configs = [("gpt",) + c for c in CONFIGS] + [("resnet_ddp", n, "") for n in RESNET]
    configs = [c for c in configs if a.only in f"{c[0]} {c[1]} {c[2]}"]
    measured = {c: [] for c in configs}
    for r in range(a.rounds):
        for c in configs:
            t = (run_example(a.gpt, c[1], c[2], a.steps, a.warmup) if c[0] == "gpt" else
                 run_resnet(a.resnet, c[1], a.steps))
            measured[c].append(t)
            print(f"round {r + 1}: {c[0]} {c[1]} ranks {c[2]}: {t * 1e3:.1f} ms", file=sys.stderr)
    rows = []
    for c in configs:
        pred, explain = (predict(a.plan, c[1], c[2], a.profile, a.fit, a.vocab) if c[0] == "gpt" else
                         predict_resnet(a.plan, c[1], a.profile, a.fit))
        meas = statistics.median(measured[c])
        rows.append({"example": c[0], "ranks": c[1], "flags": c[2], "measured_s": meas, "rounds_s": measured[c],
                     "predicted_s": pred, "error": pred / meas - 1, "explain": explain})
    print("| example | ranks | flags | measured (median) | predicted | error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        flags = f"`{r['flags']}`" if r["flags"] else "(DDP, the defaults)"
        print(f"| {r['example']} | {r['ranks']} | {flags} | {r['measured_s'] * 1e3:.1f} ms | "
              f"{r['predicted_s'] * 1e3:.1f} ms | {100 * r['error']:+.0f}% |")
    within = sum(abs(r["error"]) <= 0.25 for r in rows)
    print(f"{within} of {len(rows)} within 25 %; median |error| "
          f"{100 * statistics.median(abs(r['error']) for r in rows):.0f}%")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"about": __doc__.split("\n\n")[1], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
