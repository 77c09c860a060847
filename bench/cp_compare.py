#!/usr/bin/env python3
"""Context parallelism's GPT step: //examples:gpt --cp N with each exchange beside PyTorch 2.15 on
the same model, sequence and cp ranks (bench/peers/torch2/cp_peer.py), CPU, Gloo, 1 thread per
process, interleaved rounds; medians, the ratio, each side's spread of step times over ranks, and
each rank's time in the blocks' attention kernels (from a --profile run: what the head-tail layout
balances; the step times are equal by construction, the collectives wait for the slowest).

PyTorch's own context_parallel does not run on a CPU (cp_peer.py says why, and its JSON line
carries the error), so the peer is torch's model with the all-gather exchange written in the peer
script: head-tail chunks, k and v all-gathered per layer, FSDP2 over the cp ranks.

The model: 4 blocks, dim 256, 4 heads, the fortunes corpus' 114 characters, learned positions,
untied head; a global batch of 2 sequences of --seq characters, each split over the cp ranks;
FSDP over cp, gradients clipped to 1, AdamW.

Ours: each step's slowest rank (max of the metrics' step_s_by_rank), steps 2.. of a run.
Torch's: the median of its timed steps (the max over ranks of each).

  bazel build -c opt --config=cpu --repo_env=EMBER_CUDA_PATH=/nonexistent //examples:gpt
  python3 bench/cp_compare.py --gpt bazel-bin/examples/gpt --python ~/.venvs/torch2-peer/bin/python \\
      --cp 2 --seq 1024 --rounds 3 --out bench/results/cp_compare.json
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = dict(layers=4, dim=256, heads=4, global_batch=2)


def gpt_run(gpt, cp, seq, exchange, steps, d, *extra):
    """//examples:gpt on the model, cp ranks, checkpoints in d."""
    cmd = [gpt, "--nproc", str(cp), "--cp", str(cp), "--cp-exchange", exchange, "--dim", str(MODEL["dim"]),
           "--heads", str(MODEL["heads"]), "--layers", str(MODEL["layers"]), "--seq", str(seq),
           "--global-batch", str(MODEL["global_batch"]), "--max-steps", str(steps), "--sample-len", "0",
           "--eval-every", "1000", "--checkpoint-dir", d, *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def ours(gpt, cp, seq, exchange, steps):
    """Per step: the slowest rank's seconds, and the spread (max - min) / max over ranks."""
    with tempfile.TemporaryDirectory() as d:
        m = os.path.join(d, "m.jsonl")
        gpt_run(gpt, cp, seq, exchange, steps, d, "--metrics", m)
        rows = [json.loads(l) for l in open(m)][1:]
    per_rank = [r["step_s_by_rank"] for r in rows]
    return [1e3 * max(s) for s in per_rank], [(max(s) - min(s)) / max(s) for s in per_rank]


KERNELS = ("scaled_dot_product_attention_lse", "scaled_dot_product_attention_block_grads")


def attention_balance(gpt, cp, seq, exchange):
    """Each rank's milliseconds in the blocks' attention kernels (forward and backward, 3 profiled steps):
    the work head-tail balances, without the waits a step's wall time hides it behind."""
    with tempfile.TemporaryDirectory() as d:
        gpt_run(gpt, cp, seq, exchange, 6, d, "--profile", os.path.join(d, "prof"))
        per_rank = []
        for r in range(cp):
            j = json.load(open(os.path.join(d, "prof", f"trace-rank{r}.json")))
            events = j["traceEvents"] if isinstance(j, dict) else j
            per_rank.append(sum(e.get("dur", 0) for e in events if e.get("name") in KERNELS) / 1e3)
    return per_rank


def peer(python, cp, seq, steps):
    out = subprocess.run([python, os.path.join(HERE, "peers/torch2/cp_peer.py"), "--cp", str(cp), "--seq", str(seq),
                          "--layers", str(MODEL["layers"]), "--dim", str(MODEL["dim"]), "--heads",
                          str(MODEL["heads"]), "--global-batch", str(MODEL["global_batch"]), "--steps", str(steps)],
                         check=True, capture_output=True, text=True, cwd=os.path.join(HERE, "peers/torch2")).stdout
    recs = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    train = [r for r in recs if r.get("kind") == "train"]  # an abort at exit follows a finished run's line
    if not train:
        raise SystemExit(f"cp_peer failed: {recs}")
    return train[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--exchanges", default="ring,allgather,alltoall")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    exchanges = a.exchanges.split(",")
    mine = {e: [] for e in exchanges}
    spread = {e: [] for e in exchanges}
    theirs, their_spread, rec = [], [], {}
    for r in range(a.rounds):
        line = []
        for e in exchanges:
            ms, sp = ours(a.gpt, a.cp, a.seq, e, a.steps + 1)
            mine[e].append(statistics.median(ms))
            spread[e].append(statistics.median(sp))
            line.append(f"ours {e} {mine[e][-1]:.1f} ms")
        rec = peer(a.python, a.cp, a.seq, a.steps)
        theirs.append(rec["step_ms_median"])
        rs = rec["rank_step_ms"]
        their_spread.append((max(rs) - min(rs)) / max(rs))
        print(f"round {r + 1}: {', '.join(line)}, torch {theirs[-1]:.1f} ms", flush=True)
    t = statistics.median(theirs)
    result = dict(cp=a.cp, seq=a.seq, model=MODEL, rounds=a.rounds, torch=rec.get("torch"),
                  torch_cp_error=rec.get("torch_cp_error"), torch_ms=theirs, torch_median_ms=t,
                  torch_rank_spread=statistics.median(their_spread), ours={})
    print(f"torch {rec.get('torch')} context_parallel on CPU: {rec.get('torch_cp_error')}")
    for e in exchanges:
        o = statistics.median(mine[e])
        result["ours"][e] = dict(ms=mine[e], median_ms=o, ratio=o / t, rank_spread=statistics.median(spread[e]))
        print(f"cp {a.cp} x seq {a.seq} GPT step, {e}: ours {o:.1f} ms, torch (all-gather) {t:.1f} ms, "
              f"ratio {o / t:.2f}; step-time spread over ranks ours {100 * statistics.median(spread[e]):.1f}%, "
              f"torch {100 * statistics.median(their_spread):.1f}%")
    for e in [x for x in exchanges if x != "alltoall"]:  # Ulysses attends to whole sequences: nothing to balance
        ms = attention_balance(a.gpt, a.cp, a.seq, e)
        result["ours"][e]["attention_ms_by_rank"] = ms
        print(f"{e}: attention kernels by rank (3 steps) {', '.join(f'{m:.1f}' for m in ms)} ms, "
              f"spread {100 * (max(ms) - min(ms)) / max(ms):.1f}%")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
