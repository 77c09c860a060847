# Tensor parallelism beside PyTorch 2's DTensor tensor parallelism, rounds
# interleaved in one run (the machine is noisy): per mode (one process, TP 2,
# TP 2 + sequence parallelism), our BM_TpStep (bench/tp_bench.cc) and
# bench/peers/torch2/tp_peer.py on the same GPT and batch, each in fresh
# processes. Step time every round; memory in round 1 only (it does not
# wander): parameters/gradients/optimizer state of rank 0, peak RSS above
# the process's baseline with freed memory returned to the OS the same way
# for both (MALLOC_MMAP_THRESHOLD_=65536, and EMBER_CPU_CACHE_MB=0 for our
# caching allocator), and our activation bytes. Prints medians and the
# ratios ours/peer, and our TP figures against our one process.
#
#   bazel build -c opt //bench:tp_bench
#   python3 bench/tp_compare.py --ours bazel-out/k8-opt/bin/bench/tp_bench --rounds 3
import datetime, json, statistics, sys

import compare_common
from compare_common import compare_parser, ours_model_state, peer_model_state

MODES = [("plain", 1), ("tp", 2), ("tp_sp", 2)]


def run_ours(binary, mode, procs, low_mem):
    b = compare_common.run_ours(binary, f"^BM_TpStep/mode:{mode}/procs:{procs}/", low_mem)
    return dict(ours_model_state(b), act=b["act_MiB"])


def run_peer(python, mode, procs, low_mem, steps):
    args = ["--mode", mode, "--world", str(procs), "--warmup", "1", "--steps", str(steps)]
    return peer_model_state(compare_common.run_peer(python, "tp_peer", args, low_mem))


def main():
    ap = compare_parser()
    ap.add_argument("--out", help="also write the figures as JSON")
    a = ap.parse_args()
    times, mem, version = {}, {}, "?"
    for r in range(a.rounds):
        for mode, procs in MODES:
            o = run_ours(a.ours, mode, procs, False)
            p = run_peer(a.python, mode, procs, False, 5)
            version = p["torch"]
            times.setdefault(mode, []).append((o["ms"], p["ms"]))
            if r == 0:
                mem[mode] = (run_ours(a.ours, mode, procs, True), run_peer(a.python, mode, procs, True, 3))
            print(f"round {r + 1}: {mode} x{procs}: {o['ms']:.0f} vs {p['ms']:.0f} ms", file=sys.stderr, flush=True)
    print(f"ember vs torch {version} DTensor tensor parallelism, GPT 6x512, CPU Gloo, 1 thread per rank; "
          f"{a.rounds} rounds, medians; memory of rank 0 (MiB)")
    print(f"{'mode':6s} {'procs':>5s} | {'ours ms':>8s} {'torch ms':>8s} {'ratio':>6s} | {'ours p+g+s':>10s} "
          f"{'torch p+g+s':>11s} | {'ours peak':>9s} {'torch peak':>10s} {'ratio':>6s} | {'ours act':>8s}")
    for mode, procs in MODES:
        om = statistics.median(t[0] for t in times[mode])
        pm = statistics.median(t[1] for t in times[mode])
        o, p = mem[mode]
        total = lambda d: d["params"] + d["grads"] + d["state"]
        print(f"{mode:6s} {procs:5d} | {om:8.0f} {pm:8.0f} {om / pm:6.2f} | {total(o):10.1f} {total(p):11.1f} | "
              f"{o['rss']:9.0f} {p['rss']:10.0f} {o['rss'] / p['rss']:6.2f} | {o['act']:8.1f}")
    one = mem["plain"][0]
    for mode, procs in MODES[1:]:
        o = mem[mode][0]
        print(f"ours {mode}: model state {(o['params'] + o['grads'] + o['state']) / (one['params'] + one['grads'] + one['state']):.3f}"
              f" x one process's; activations {o['act'] / (one['act'] / procs):.3f} x one process's / {procs}")
    if a.out:
        json.dump({"date": datetime.date.today().isoformat(), "rounds": a.rounds, "peer": f"torch {version}",
                   "workloads": {"tp": {m: {"ours_ms": [t[0] for t in times[m]], "peer_ms": [t[1] for t in times[m]],
                                            "ours": mem[m][0], "peer": mem[m][1]} for m, _ in MODES}}},
                  open(a.out, "w"), indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
