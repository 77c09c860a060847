#!/usr/bin/env python3
"""Before/after of a change on the distributed step benchmarks: runs two
builds' fsdp_bench, tp_bench and pp_bench (directories --before and
--after, each holding the three binaries) interleaved, round after round,
and prints the median time per step of each workload, the ratio and each
side's range over the rounds (a markdown table)."""
import argparse
import json
import statistics
import subprocess
import sys

RUNS = [("fsdp_bench", "model:(gpt|mlp)/mode:(full|grad_op)/procs:2"),
        ("tp_bench", "mode:tp(_sp)?/procs:2"),
        ("pp_bench", "schedule:(1f1b|zb-h1|interleaved)/procs:2")]
UNIT = {"ns": 1e6, "us": 1e3, "ms": 1, "s": 1e-3}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", required=True, help="directory of the first build's benchmarks")
    ap.add_argument("--after", required=True, help="directory of the second build's benchmarks")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    res = {}
    for rnd in range(a.rounds):
        for bench, filt in RUNS:
            for side, d in (("before", a.before), ("after", a.after)):
                out = subprocess.run([f"{d}/{bench}", f"--benchmark_filter={filt}", "--benchmark_format=json"],
                                     capture_output=True, text=True, check=True).stdout
                for x in json.loads(out[out.index("{"):])["benchmarks"]:
                    res.setdefault((bench, x["name"]), {}).setdefault(side, []).append(
                        x["real_time"] / UNIT[x["time_unit"]])
        print("round", rnd + 1, "of", a.rounds, file=sys.stderr)
    print("| workload | before (ms) | after (ms) | after / before | before's rounds | after's rounds |")
    print("|---|---|---|---|---|---|")
    for (bench, name), v in res.items():
        b, f = statistics.median(v["before"]), statistics.median(v["after"])
        label = name.split("/iterations")[0].split("/", 1)[1]
        print(f"| `{bench}` {label} | {b:.1f} | {f:.1f} | {f / b:.2f} | "
              f"{min(v['before']):.0f}-{max(v['before']):.0f} | {min(v['after']):.0f}-{max(v['after']):.0f} |")


if __name__ == "__main__":
    main()
