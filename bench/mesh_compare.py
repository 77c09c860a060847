#!/usr/bin/env python3
"""The 8-rank 2x2x2 (pp, dp_shard, tp) GPT step: //examples:gpt beside PyTorch 2.15 composing
FSDP2, DTensor tensor parallelism and pipelining on the same mesh (bench/peers/torch2/mesh_peer.py),
CPU, Gloo, 1 thread per process, interleaved rounds; medians and the ratio.

The model: 8 blocks, dim 256, 4 heads, seq 128, the fortunes corpus' 114 characters, untied head;
a global batch of 16 sequences (8 per data-parallel rank) in 4 micro-batches, 1F1B, tensor
parallelism without sequence parallelism (torch's plan below has none), AdamW.

Ours: the step time of steps 2.. of a run (tokens per step / the run's tokens_per_s metric).
Torch's: the median of its timed steps (the max over ranks of each).

  bazel build -c opt --config=cpu --repo_env=EMBER_CUDA_PATH=/nonexistent //examples:gpt
  python3 bench/mesh_compare.py --gpt bazel-bin/examples/gpt --python ~/.venvs/torch2-peer/bin/python \
      --rounds 3 --out bench/results/mesh_compare.json
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MESH = dict(pp=2, dp_shard=2, tp=2)
MODEL = dict(layers=8, dim=256, heads=4, seq=128, global_batch=16, microbatches=4)


def ours(gpt, steps):
    with tempfile.TemporaryDirectory() as d:
        m = os.path.join(d, "m.jsonl")
        cmd = [gpt, "--nproc", "8", "--pp", "2", "--dp-shard", "2", "--tp", "2", "--sp", "off",
               "--dim", "256", "--heads", "4", "--seq", "128", "--layers", "8", "--global-batch", "16",
               "--microbatches", "4", "--max-steps", str(steps), "--sample-len", "0", "--eval-every", "1000",
               "--checkpoint-dir", d, "--metrics", m]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows = [json.loads(l) for l in open(m)]
    tokens = MODEL["global_batch"] * MODEL["seq"]
    return [1e3 * tokens / r["tokens_per_s"] for r in rows[1:]]


def peer(python, steps):
    out = subprocess.run([python, os.path.join(HERE, "peers/torch2/mesh_peer.py"), "--steps", str(steps)],
                         check=True, capture_output=True, text=True, cwd=os.path.join(HERE, "peers/torch2")).stdout
    rec = [json.loads(l) for l in out.splitlines() if l.startswith("{")][-1]
    if rec.get("kind") != "train":
        raise SystemExit(f"mesh_peer failed: {rec}")
    return rec["step_ms"], rec["torch"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    mine, theirs, version = [], [], ""
    for r in range(a.rounds):
        o = statistics.median(ours(a.gpt, a.steps + 1))
        t, version = peer(a.python, a.steps)
        t = statistics.median(t)
        mine.append(o)
        theirs.append(t)
        print(f"round {r + 1}: ours {o:.1f} ms, torch {t:.1f} ms", flush=True)
    o, t = statistics.median(mine), statistics.median(theirs)
    print(f"2x2x2 (pp, dp_shard, tp) GPT step: ours {o:.1f} ms, torch {t:.1f} ms, ratio {o / t:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(mesh=MESH, model=MODEL, peer=version, rounds=a.rounds, ours_ms=mine, torch_ms=theirs,
                           ours_median_ms=o, torch_median_ms=t, ratio=o / t), f, indent=1)


if __name__ == "__main__":
    main()
