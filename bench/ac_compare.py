# Activation checkpointing beside PyTorch 2's checkpoint_wrapper +
# fully_shard, rounds interleaved in one run (the machine is noisy): per
# policy (none, selective, every:2, full), our BM_AcStep (bench/ac_bench.cc)
# and bench/peers/torch2/ac_peer.py on the same GPT (8 blocks, seq 256) and
# batch, FSDP over 2 processes, each in fresh processes, both with freed
# memory returned to the OS the same way (MALLOC_MMAP_THRESHOLD_=65536, and
# EMBER_CPU_CACHE_MB=0 for our caching allocator). Per policy: median step
# time, the memory the forward leaves for backward (RSS at its end minus
# before it) and the step's peak above RSS before the forward, both sides
# measured alike; and our allocator's activation bytes at the peak. Prints
# medians, ratios ours/peer, and each policy against our own `none` (the
# memory-against-time curve).
#
#   bazel build -c opt //bench:ac_bench
#   python3 bench/ac_compare.py --ours bazel-out/k8-opt/bin/bench/ac_bench --rounds 3
import datetime, json, statistics, sys

import compare_common
from compare_common import compare_parser

POLICIES = ["none", "selective", "every:2", "full"]


def run_ours(binary, policy):
    b = compare_common.run_ours(binary, f"^BM_AcStep/policy:{policy}/procs:2/", True)
    return dict(ms=b["step_ms_median"], held=b["fwd_held_MiB"], peak=b["step_peak_MiB"], act=b["act_MiB"])


def run_peer(python, policy, steps):
    d = compare_common.run_peer(python, "ac_peer", ["--policy", policy, "--warmup", "1", "--steps", str(steps)], True)
    return dict(ms=d["step_ms_median"], held=d["fwd_held_mib"], peak=d["step_peak_mib"], torch=d["torch"])


def main():
    ap = compare_parser()
    ap.add_argument("--out", help="also write the figures as JSON")
    a = ap.parse_args()
    runs, version = {p: [] for p in POLICIES}, "?"
    for r in range(a.rounds):
        for policy in POLICIES:
            o, p = run_ours(a.ours, policy), run_peer(a.python, policy, 3)
            version = p["torch"]
            runs[policy].append((o, p))
            print(f"round {r + 1}: {policy}: {o['ms']:.0f} vs {p['ms']:.0f} ms, held {o['held']:.0f} vs "
                  f"{p['held']:.0f} MiB", file=sys.stderr, flush=True)
    med = lambda policy, side, key: statistics.median(x[side][key] for x in runs[policy])
    print(f"ember vs torch {version} checkpoint_wrapper + fully_shard, GPT 8x384 seq 256, batch 4 per rank, "
          f"FSDP over 2 CPU Gloo processes, 1 thread each; {a.rounds} rounds, medians; memory of rank 0 (MiB)")
    print(f"{'policy':9s} | {'ours ms':>8s} {'torch ms':>8s} {'ratio':>6s} | {'ours held':>9s} {'torch held':>10s} "
          f"{'ratio':>6s} | {'ours peak':>9s} {'torch peak':>10s} {'ratio':>6s} | {'our act':>7s} | "
          f"{'vs none: time':>13s} {'act':>5s}")
    base_ms, base_act = med("none", 0, "ms"), med("none", 0, "act")
    figures = {}
    for policy in POLICIES:
        om, pm = med(policy, 0, "ms"), med(policy, 1, "ms")
        oh, ph = med(policy, 0, "held"), med(policy, 1, "held")
        op, pp = med(policy, 0, "peak"), med(policy, 1, "peak")
        act = med(policy, 0, "act")
        print(f"{policy:9s} | {om:8.0f} {pm:8.0f} {om / pm:6.2f} | {oh:9.1f} {ph:10.1f} {oh / ph:6.2f} | "
              f"{op:9.1f} {pp:10.1f} {op / pp:6.2f} | {act:7.1f} | {om / base_ms:13.2f} {act / base_act:5.2f}")
        figures[policy] = {"ours_ms": [x[0]["ms"] for x in runs[policy]], "peer_ms": [x[1]["ms"] for x in runs[policy]],
                           "ours_fwd_held_MiB": oh, "peer_fwd_held_MiB": ph, "ours_step_peak_MiB": op,
                           "peer_step_peak_MiB": pp, "ours_act_at_peak_MiB": act}
    if a.out:
        json.dump({"date": datetime.date.today().isoformat(), "rounds": a.rounds, "peer": f"torch {version}",
                   "workloads": {"activation_checkpointing": figures}}, open(a.out, "w"), indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
