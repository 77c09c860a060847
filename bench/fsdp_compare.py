# FSDP beside PyTorch's fully_shard, rounds interleaved in one run (the
# machine is noisy): per configuration, our BM_FsdpStep (bench/fsdp_bench.cc)
# and bench/peers/torch2/fsdp_peer.py on the same model, batch and
# strategy, each in fresh processes. Step time: both with their default
# allocators, every round. Memory (round 1 only; it does not wander): peak
# RSS above the process's baseline with freed memory returned to the OS, the
# same way for both (MALLOC_MMAP_THRESHOLD_=65536, and EMBER_CPU_CACHE_MB=0
# for our caching allocator), and that peak beyond parameters, gradients and
# optimizer state (what neither side can shard away: activations, gathered
# units, temporaries, communication buffers). Prints medians and the ratios
# ours/peer.
#
#   bazel build -c opt //bench:fsdp_bench
#   python3 bench/fsdp_compare.py --ours bazel-out/k8-opt/bin/bench/fsdp_bench --rounds 3
import datetime, json, statistics, sys

import compare_common
from compare_common import compare_parser, ours_model_state, peer_model_state

# (model, our mode, procs, peer strategy)
CONFIGS = [(m, ours, n, peer) for m in ("gpt", "mlp") for ours, n, peer in (
    ("plain", 1, "plain"), ("full", 1, "fsdp2_full"), ("ddp", 2, "ddp"), ("full", 2, "fsdp2_full"),
    ("grad_op", 2, "fsdp2_grad_op"), ("no_shard", 2, "fsdp2_hsdp_replicate"))]


def run_ours(binary, model, mode, procs, low_mem):
    return ours_model_state(
        compare_common.run_ours(binary, f"^BM_FsdpStep/model:{model}/mode:{mode}/procs:{procs}/", low_mem))


def run_peer(python, model, strategy, procs, low_mem, steps):
    args = ["--models", model, "--strategies", strategy, "--world", str(procs), "--warmup", "1", "--steps", str(steps)]
    return peer_model_state(compare_common.run_peer(python, "fsdp_peer", args, low_mem))


def main():
    ap = compare_parser()
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--out", help="also write the figures as JSON (bench/plot_scaling.py plots them)")
    a = ap.parse_args()
    configs = [c for c in CONFIGS if c[0] in a.models.split(",")]
    times, mem, version = {}, {}, "?"
    for r in range(a.rounds):
        for model, mode, procs, peer in configs:
            key = (model, mode, procs)
            o = run_ours(a.ours, model, mode, procs, False)
            p = run_peer(a.python, model, peer, procs, False, 3)
            version = p["torch"]
            times.setdefault(key, []).append((o["ms"], p["ms"]))
            if r == 0:
                mem[key] = (run_ours(a.ours, model, mode, procs, True), run_peer(a.python, model, peer, procs, True, 3))
            print(f"round {r + 1}: {model} {mode} x{procs}: {o['ms']:.0f} vs {p['ms']:.0f} ms", file=sys.stderr,
                  flush=True)
    print(f"ember vs torch {version} fully_shard, CPU Gloo, 1 thread per rank; {a.rounds} rounds, medians; "
          "memory of rank 0 (MiB)")
    print(f"{'model':5s} {'mode':9s} {'procs':>5s} | {'ours ms':>8s} {'torch ms':>8s} {'ratio':>6s} | "
          f"{'ours p/g/s':>18s} {'torch p/g/s':>18s} | {'ours peak':>9s} {'torch peak':>10s} {'ratio':>6s} | "
          f"{'ours beyond':>11s} {'torch beyond':>12s} {'ratio':>6s}")
    beyond = lambda d: d["rss"] - d["params"] - d["grads"] - d["state"]
    for model, mode, procs, peer in configs:
        key = (model, mode, procs)
        om = statistics.median(t[0] for t in times[key])
        pm = statistics.median(t[1] for t in times[key])
        o, p = mem[key]
        pgs = lambda d: f"{d['params']:.0f}/{d['grads']:.0f}/{d['state']:.0f}"
        print(f"{model:5s} {mode:9s} {procs:5d} | {om:8.0f} {pm:8.0f} {om / pm:6.2f} | {pgs(o):>18s} {pgs(p):>18s} | "
              f"{o['rss']:9.0f} {p['rss']:10.0f} {o['rss'] / p['rss']:6.2f} | "
              f"{beyond(o):11.0f} {beyond(p):12.0f} {beyond(o) / beyond(p):6.2f}")
    if a.out:
        fsdp = {f"{m}/{mode}/{procs}": {"ours_ms": [t[0] for t in times[(m, mode, procs)]],
                                        "peer_ms": [t[1] for t in times[(m, mode, procs)]],
                                        "ours_peak_MiB": mem[(m, mode, procs)][0]["rss"],
                                        "peer_peak_MiB": mem[(m, mode, procs)][1]["rss"],
                                        "ours_beyond_state_MiB": beyond(mem[(m, mode, procs)][0]),
                                        "peer_beyond_state_MiB": beyond(mem[(m, mode, procs)][1])}
                for m, mode, procs, _ in configs}
        json.dump({"date": datetime.date.today().isoformat(), "rounds": a.rounds, "peer": f"torch {version}",
                   "workloads": {"fsdp": fsdp}}, open(a.out, "w"), indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
