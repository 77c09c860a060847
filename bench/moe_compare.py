#!/usr/bin/env python3
"""The mixture-of-experts GPT step: //examples:gpt --moe-experts on one process and with expert
parallelism (--ep 2 over --dp-shard 2) beside PyTorch 2.15 eager on the same model
(bench/peers/torch2/moe_peer.py: the same router, a grouped SwiGLU written in PyTorch, and for ep
2 all_to_all_single with the same uneven splits), CPU, Gloo, 1 thread per process, interleaved
rounds; medians and the ratio ours / torch (below 1: ours faster).

The model: LLaMA blocks (RMSNorm, rotary multi-head attention, no biases), every block an MoE of
--experts SwiGLU experts of --hidden, top --top-k, softmax router, renormalised weights, the
load-balancing loss at 0.01; the fortunes corpus' 114 characters; a global batch of 8 sequences of
--seq; AdamW, gradients clipped to 1. At ep 2 the rest of the model is FSDP over the 2 ranks on
both sides (torch: FSDP2 with the experts in ignored_params).

Ours: each step's slowest rank (max of the metrics' step_s_by_rank), steps 2.. of a run.
Torch's: the median of its timed steps (the max over ranks of each).

  bazel build -c opt --config=cpu --repo_env=EMBER_CUDA_PATH=/nonexistent //examples:gpt
  python3 bench/moe_compare.py --gpt bazel-bin/examples/gpt --python ~/.venvs/torch2-peer/bin/python \\
      --rounds 3 --out bench/results/moe_compare.json
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def ours(a, ep, steps):
    """Per step: the slowest rank's milliseconds (steps 2..)."""
    with tempfile.TemporaryDirectory() as d:
        m = os.path.join(d, "m.jsonl")
        mesh = ["--nproc", "1"] if ep == 1 else ["--nproc", str(ep), "--dp-shard", str(ep), "--ep", str(ep)]
        cmd = [a.gpt, *mesh, "--arch", "llama", "--dim", str(a.dim), "--heads", str(a.heads), "--layers",
               str(a.layers), "--seq", str(a.seq), "--global-batch", "8", "--moe-experts", str(a.experts),
               "--moe-top-k", str(a.top_k), "--moe-hidden", str(a.hidden), "--max-steps", str(steps),
               "--sample-len", "0", "--eval-every", "1000", "--lr", "1e-3", "--checkpoint-dir", d, "--metrics", m]
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        rows = [json.loads(l) for l in open(m)][1:]
    return [1e3 * max(r["step_s_by_rank"]) for r in rows]


def peer(a, ep, steps):
    out = subprocess.run([a.python, os.path.join(HERE, "peers/torch2/moe_peer.py"), "--ep", str(ep), "--layers",
                          str(a.layers), "--dim", str(a.dim), "--heads", str(a.heads), "--hidden", str(a.hidden),
                          "--experts", str(a.experts), "--top-k", str(a.top_k), "--seq", str(a.seq), "--steps",
                          str(steps)],
                         check=True, capture_output=True, text=True, cwd=os.path.join(HERE, "peers/torch2"),
                         env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    recs = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    train = [r for r in recs if r.get("kind") == "train"]
    if not train:
        raise SystemExit(f"moe_peer failed: {out}")
    return train[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--eps", default="1,2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", dest="top_k", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    eps = [int(e) for e in a.eps.split(",")]
    mine = {e: [] for e in eps}
    theirs = {e: [] for e in eps}
    rec = {}
    for r in range(a.rounds):
        line = []
        for e in eps:
            mine[e].append(statistics.median(ours(a, e, a.steps + 1)))
            rec = peer(a, e, a.steps)
            theirs[e].append(rec["step_ms_median"])
            line.append(f"ep {e}: ours {mine[e][-1]:.1f} ms, torch {theirs[e][-1]:.1f} ms")
        print(f"round {r + 1}: {'; '.join(line)}", flush=True)
    model = dict(layers=a.layers, dim=a.dim, heads=a.heads, hidden=a.hidden, experts=a.experts, top_k=a.top_k,
                 seq=a.seq, global_batch=8)
    result = dict(model=model, rounds=a.rounds, torch=rec.get("torch"), threads_per_process=1, by_ep={})
    for e in eps:
        o, t = statistics.median(mine[e]), statistics.median(theirs[e])
        result["by_ep"][str(e)] = dict(ours_ms=mine[e], torch_ms=theirs[e], ours_median_ms=o, torch_median_ms=t,
                                       ratio=o / t)
        print(f"MoE step, ep {e}: ours {o:.1f} ms, torch {t:.1f} ms, ratio {o / t:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
