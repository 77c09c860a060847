#!/usr/bin/env python3
"""Sharded checkpoints beside PyTorch DCP, interleaved in one run.

Each round runs bench/ckpt_bench (ours: save, load, async save and the disk's
raw write on 2 processes) and bench/peers/torch2/dcp_peer.py's save phase
(dcp.save and dcp.async_save from 2 FSDP2 ranks, the same GPT and AdamW
state, ~330 MB), then prints the medians and the ratios.

  bazel build -c opt //bench:ckpt_bench
  bench/ckpt_compare.py --ours bazel-bin/bench/ckpt_bench [--rounds 3]

The peer needs bench/peers/torch2/setup-venv.sh (~/.venvs/torch2-peer).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from compare_common import compare_parser

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "peers", "torch2", "dcp_peer.py")


def ours(binary, tmp):
    env = dict(os.environ, EMBER_CKPT_BENCH_DIR=tmp, TMPDIR=tmp)
    out = subprocess.run([binary, "--benchmark_format=json"], env=env, capture_output=True, text=True, check=True)
    rows = {b["name"].split("/")[0]: b for b in json.loads(out.stdout)["benchmarks"]}
    return dict(disk_GBps=rows["BM_DiskWrite"]["GB_per_s"], save_ms=rows["BM_CkptSave"]["save_ms"],
                save_GBps=rows["BM_CkptSave"]["GB_per_s"], load_ms=rows["BM_CkptLoad"]["load_ms"],
                load_GBps=rows["BM_CkptLoad"]["GB_per_s"], async_block_ms=rows["BM_CkptAsync"]["blocking_ms"],
                host_copy_ms=rows["BM_CkptAsync"]["host_copy_ms"], async_done_ms=rows["BM_CkptAsync"]["complete_ms"],
                MB=rows["BM_CkptSave"]["MB_total"])


def peer(python, tmp):
    d = os.path.join(tmp, "dcp")
    out = subprocess.run([python, PEER, "--model", "gpt", "--dir", d, "--phases", "save"], capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(PEER))
    saves = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{") and '"kind": "save"' in l]
    layout = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{") and '"kind": "layout"' in l]
    mb = sum(f["bytes"] for f in layout[0]["files"]) / 1e6 if layout else float("nan")
    save_s = max(r["save_s"] for r in saves)
    return dict(save_ms=save_s * 1e3, save_GBps=mb / 1e3 / save_s,
                async_block_ms=max(r.get("async_return_s", float("nan")) for r in saves) * 1e3,
                async_done_ms=max(r.get("async_complete_s", float("nan")) for r in saves) * 1e3, MB=mb)


def main():
    ap = compare_parser()
    a = ap.parse_args()
    runs = {"ours": [], "dcp": []}
    for r in range(a.rounds):
        for who in ("ours", "dcp"):
            tmp = tempfile.mkdtemp(prefix="ckpt_compare_", dir=os.environ.get("TMPDIR", "/tmp"))
            try:
                runs[who].append(ours(a.ours, tmp) if who == "ours" else peer(a.python, tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            print(f"round {r + 1} {who}: " + json.dumps({k: round(v, 3) for k, v in runs[who][-1].items()}),
                  flush=True)
    med = {who: {k: statistics.median(x[k] for x in v) for k in v[0]} for who, v in runs.items()}
    o, p = med["ours"], med["dcp"]
    print(f"\nmedians of {a.rounds} interleaved rounds, 2 ranks, GPT + AdamW state "
          f"(ours {o['MB']:.0f} MB, DCP {p['MB']:.0f} MB):")
    print(f"  {'':28} {'ours':>10} {'DCP':>10} {'ours/DCP':>9}")
    for key, label in (("save_ms", "save (ms)"), ("save_GBps", "save (GB/s)"), ("async_block_ms", "async: blocks (ms)"),
                       ("async_done_ms", "async: committed (ms)")):
        print(f"  {label:28} {o[key]:10.1f} {p[key]:10.1f} {o[key] / p[key]:9.2f}")
    print(f"  {'load, 2 -> 2 ranks (ms)':28} {o['load_ms']:10.1f} {'':>10}   ({o['load_GBps']:.2f} GB/s)")
    print(f"  {'raw disk write (GB/s)':28} {o['disk_GBps']:10.2f}   save at {o['save_GBps'] / o['disk_GBps']:.2f} of it")
    print(f"  {'host copy (ms)':28} {o['host_copy_ms']:10.1f}   async blocks {o['async_block_ms'] / o['host_copy_ms']:.2f}x it")


if __name__ == "__main__":
    sys.exit(main())
