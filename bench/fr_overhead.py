#!/usr/bin/env python3
"""The flight recorder's cost on distributed GPT steps: runs fsdp_bench's
GPT steps (FSDP full shard and DDP, 2 processes) and pp_bench's 1F1B
pipeline (2 processes) with the recorder off (EMBER_FR_BUFFER=0) and on
(the default ring of 2,000 entries), interleaved round after round (the
order alternating), and prints the median step of each side, the ratio
on / off and each side's range (a markdown table); --json writes them.

  bazel build -c opt --config=cpu //bench:fsdp_bench //bench:pp_bench
  python3 bench/fr_overhead.py --bin-dir bazel-bin/bench --rounds 5 --json bench/results/fr_overhead.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

RUNS = [("fsdp_bench", "model:gpt/mode:(full|ddp)/procs:2"),
        ("pp_bench", "schedule:1f1b/procs:2")]
UNIT = {"ns": 1e6, "us": 1e3, "ms": 1, "s": 1e-3}
SIDES = {"off": "0", "on": "2000"}


def run(path, filt, buffer):
    env = dict(os.environ, EMBER_FR_BUFFER=buffer)
    out = subprocess.run([path, f"--benchmark_filter={filt}", "--benchmark_format=json"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return {x["name"]: x["real_time"] / UNIT[x["time_unit"]] for x in json.loads(out[out.index("{"):])["benchmarks"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True, help="directory holding fsdp_bench and pp_bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the medians and rounds here")
    a = ap.parse_args()
    res = {}
    for rnd in range(a.rounds):
        order = list(SIDES) if rnd % 2 == 0 else list(reversed(SIDES))
        for bench, filt in RUNS:
            for side in order:
                for name, ms in run(os.path.join(a.bin_dir, bench), filt, SIDES[side]).items():
                    res.setdefault(name, {}).setdefault(side, []).append(ms)
        print("round", rnd + 1, "of", a.rounds, file=sys.stderr)
    print("| workload | recorder off (ms) | on (ms) | on / off | off's rounds | on's rounds |")
    print("|---|---|---|---|---|---|")
    table = {}
    for name, v in res.items():
        off, on = statistics.median(v["off"]), statistics.median(v["on"])
        label = name.split("/iterations")[0]
        table[label] = {"off_ms": off, "on_ms": on, "ratio": on / off, "off_rounds": v["off"], "on_rounds": v["on"]}
        print(f"| `{label}` | {off:.1f} | {on:.1f} | {on / off:.3f} | "
              f"{min(v['off']):.1f}-{max(v['off']):.1f} | {min(v['on']):.1f}-{max(v['on']):.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": a.rounds, "workloads": table}, f, indent=1)


if __name__ == "__main__":
    main()
