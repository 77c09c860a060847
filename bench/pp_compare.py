# Pipeline schedules beside PyTorch 2's torch.distributed.pipelining, rounds
# interleaved in one run (the machine is noisy): per schedule (gpipe, 1f1b,
# interleaved with 2 stages per rank, zb-h1), our BM_PpStep
# (bench/pp_bench.cc) and bench/peers/torch2/pp_peer.py on the same GPT
# (8 x 256, seq 128, vocab 4096), the same batch of 8 sequences in 4
# micro-batches, 2 processes of 1 thread, Gloo, each in fresh processes.
# Prints the median step times and the ratio ours/peer, our measured bubble
# beside the simulator's (measured costs per stage and transfer latency),
# our activation peaks per rank beside the simulator's live micro-batches,
# and ZB-H1's step against 1F1B's (ours: the simulator says ZB-H1 is faster
# when W is a large part of the backward).
#
#   bazel build -c opt //bench:pp_bench
#   python3 bench/pp_compare.py --ours bazel-out/k8-opt/bin/bench/pp_bench --rounds 3
import argparse, datetime, json, os, statistics, subprocess, sys

from compare_common import peer_record

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "torch2", "pp_peer.py")
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]


def run_ours(binary, schedule):
    out = subprocess.run([binary, f"--benchmark_filter=^BM_PpStep/schedule:{schedule}/",
                          "--benchmark_format=json"], capture_output=True, text=True, check=True).stdout
    b = json.loads(out)["benchmarks"][0]
    keys = ["step_ms_median", "bubble_measured", "bubble_simulated", "f_ms", "b_ms", "w_ms", "comm_ms",
            "act_peak_MiB_rank0", "act_peak_MiB_rank1", "live_rank0", "live_rank1"]
    return {k: b[k] for k in keys}


def run_peer(python, schedule, steps):
    out = subprocess.run([python, PEER, "--schedule", schedule, "--world", "2", "--microbatches", "4",
                          "--warmup", "1", "--steps", str(steps)], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(PEER)).stdout
    return peer_record(out, "pp_peer")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--python", default=os.path.expanduser("~/.venvs/torch2-peer/bin/python"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--out", help="also write the figures as JSON")
    a = ap.parse_args()
    schedules = a.schedules.split(",")
    ours, peer = {s: [] for s in schedules}, {s: [] for s in schedules}
    for r in range(a.rounds):
        for s in schedules:
            o = run_ours(a.ours, s)
            p = run_peer(a.python, s, 5)
            ours[s].append(o)
            peer[s].append(p)
            print(f"round {r + 1}: {s}: {o['step_ms_median']:.0f} vs {p['step_ms_median']:.0f} ms "
                  f"({p.get('torch_schedule', '?')})", file=sys.stderr, flush=True)
    version = next(iter(peer.values()))[0].get("torch", "?")
    med = lambda rows, k: statistics.median(x[k] for x in rows)
    print(f"ember vs torch {version} torch.distributed.pipelining, GPT 8x256 seq 128 vocab 4096, batch 8 in 4 "
          f"micro-batches, 2 processes x 1 thread, CPU Gloo; {a.rounds} rounds, medians")
    print(f"{'schedule':11s} | {'ours ms':>8s} {'torch ms':>8s} {'ratio':>6s} | {'torch class':26s} | "
          f"{'bubble':>6s} {'sim':>6s} | {'F':>5s} {'B':>5s} {'W':>5s} {'comm':>5s} ms | "
          f"{'act0 MiB':>8s} {'act1 MiB':>8s} {'live0':>5s} {'live1':>5s}")
    for s in schedules:
        om, pm = med(ours[s], "step_ms_median"), med(peer[s], "step_ms_median")
        o = ours[s][len(ours[s]) // 2]
        print(f"{s:11s} | {om:8.0f} {pm:8.0f} {om / pm:6.2f} | {peer[s][0].get('torch_schedule', '?'):26s} | "
              f"{med(ours[s], 'bubble_measured'):6.3f} {med(ours[s], 'bubble_simulated'):6.3f} | "
              f"{med(ours[s], 'f_ms'):5.1f} {med(ours[s], 'b_ms'):5.1f} {med(ours[s], 'w_ms'):5.1f} "
              f"{med(ours[s], 'comm_ms'):5.2f}    | {o['act_peak_MiB_rank0']:8.1f} {o['act_peak_MiB_rank1']:8.1f} "
              f"{o['live_rank0']:5.0f} {o['live_rank1']:5.0f}")
    if "zb-h1" in ours and "1f1b" in ours:
        z, f = med(ours["zb-h1"], "step_ms_median"), med(ours["1f1b"], "step_ms_median")
        print(f"ours zb-h1 / 1f1b step: {z / f:.3f} (simulated bubble {med(ours['zb-h1'], 'bubble_simulated'):.3f} vs "
              f"{med(ours['1f1b'], 'bubble_simulated'):.3f})")
    if a.out:
        json.dump({"date": datetime.date.today().isoformat(), "rounds": a.rounds, "peer": f"torch {version}",
                   "workloads": {"pp": {s: {"ours": ours[s], "peer": peer[s]} for s in schedules}}},
                  open(a.out, "w"), indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
