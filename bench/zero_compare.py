# ZeRO-1 against DDP, ours beside PyTorch's ZeroRedundancyOptimizer, rounds
# interleaved in one run (the machine is noisy): every round runs our
# BM_MlpAdamStep (bench/ddp_scaling.cc) for opt:ddp and opt:zero, then
# bench/zero_peer.py with each given Python (both modes), all at --nproc.
# Prints per configuration the median over rounds of the step time, the
# optimizer-state bytes of rank 0, and the ratios ours/peer and zero/ddp.
#
#   bazel build -c opt //bench:ddp_scaling
#   python3 bench/zero_compare.py --ours bazel-out/k8-opt/bin/bench/ddp_scaling \
#       --pythons /usr/bin/python3,$HOME/.venvs/torch2-peer/bin/python --nproc 2 --rounds 3
import argparse, json, os, statistics, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))


def ours(binary, nproc):
    out = subprocess.run([binary, f"--benchmark_filter=BM_MlpAdamStep/opt:.*/procs:{nproc}/",
                          "--benchmark_format=json"], capture_output=True, text=True, check=True).stdout
    rows = {}
    for b in json.loads(out)["benchmarks"]:
        mode = "zero" if "opt:zero" in b["name"] else "ddp"
        rows[mode] = (b["step_ms_median"], b["state_MiB"] * (1 << 20))
    return rows


def peer(python, nproc, steps, warmup):
    out = subprocess.run([python, os.path.join(HERE, "zero_peer.py"), "--nproc", str(nproc), "--steps", str(steps),
                          "--warmup", str(warmup), "--json"], capture_output=True, text=True, check=True).stdout
    rows, version = {}, "?"
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            version = d["torch"]
            rows[d["mode"]] = (d["step_ms_median"], d["optim_state_bytes"][0])
    return version, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--pythons", default="/usr/bin/python3")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    results = {}  # (who, mode) -> [(ms, bytes)]
    for r in range(a.rounds):
        for mode, v in ours(a.ours, a.nproc).items():
            results.setdefault(("ember", mode), []).append(v)
        for py in a.pythons.split(","):
            version, rows = peer(py, a.nproc, a.steps, a.warmup)
            for mode, v in rows.items():
                results.setdefault((f"torch {version}", mode), []).append(v)
        print(f"round {r + 1} done", file=sys.stderr, flush=True)
    med = {k: (statistics.median(x[0] for x in v), v[0][1]) for k, v in results.items()}
    print(f"nproc {a.nproc}, {a.rounds} rounds, medians")
    print(f"{'who':28s} {'mode':5s} {'step ms':>9s} {'state MiB/rank':>15s} {'zero/ddp time':>14s}")
    for (who, mode), (ms, b) in sorted(med.items()):
        ratio = ms / med[(who, "ddp")][0] if (who, "ddp") in med else float("nan")
        print(f"{who:28s} {mode:5s} {ms:9.1f} {b / (1 << 20):15.1f} {ratio:14.2f}")
    for (who, mode), (ms, b) in sorted(med.items()):
        if who != "ember" and ("ember", mode) in med:
            print(f"ember / {who} {mode}: step time {med[('ember', mode)][0] / ms:.2f}x")


if __name__ == "__main__":
    main()
