#!/usr/bin/env python3
"""Why our fused attention kernels run slower than PyTorch's SDPA flash
kernels on a GPU: Nsight Compute (ncu, `--set full`) on both, the shapes of
bench/attention_compare.py (batch 8, sequence 2,048, hidden 2,048, bf16),
one forward + backward step each of head dim 64 causal, 128 causal and 128.
TFLOP/s says how far apart they are; this says where the cycles go: issue
slots used, the tensor pipe's share, active and eligible warps, the stall
reasons of the warps that could not issue (PC sampling), shared memory's
bank conflicts, instructions executed, and the SASS instructions the most
samples stalled at, ours beside theirs (the largest forward and backward
kernel of each step: flash_forward_kernel / flash_backward_kernel against
FlashAttention-2's flash_fwd_kernel / flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel).

  python3 bench/attention_profile.py --ours "bash .gpu/run.sh attention_cuda_bench" \\
      --dir /tmp/attn_prof [--json gpu_attention_profile.json] [--ncu PATH]
  python3 bench/attention_profile.py --summarize DIR [--json F]

The first runs ncu (about 40 replays a kernel, so a few seconds each) and
then summarizes; the second summarizes the CSV files a run left in DIR
(ncu's raw, source and details pages, one set a side and configuration),
on any machine. DIR keeps those CSV files: columns this summary leaves out
are there. Clocks are left alone (--clock-control none), as on the device
machine's METHOD.md; percentages and counts compare, durations are what the
clocks gave.
"""
import argparse
import csv
import datetime
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

# The shapes, FLOP count, bundle commit and device line of attention_compare.py,
# whose figures this explains.
from attention_compare import B, HIDDEN, T, commit, device_meta, flops

CONFIGS = [(64, True), (128, True), (128, False)]  # head dim, causal: forward + backward each

# The ncu raw page's metrics this summary reads, by the start of their
# names (a section may add suffixes; the first match wins).
METRICS = [
    ("duration_us", "gpu__time_duration.sum"),
    ("sm_throughput_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue_active_pct", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warps_active_per_scheduler", "smsp__warps_active.avg.per_cycle_active"),
    ("warps_eligible_per_scheduler", "smsp__warps_eligible.avg.per_cycle_active"),
    ("cycles_per_issued_instruction", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("registers_per_thread", "launch__registers_per_thread"),
    ("shared_per_block_bytes", "launch__shared_mem_per_block_dynamic"),
    ("block_limit_registers", "launch__occupancy_limit_registers"),
    ("block_limit_shared", "launch__occupancy_limit_shared_mem"),
    ("achieved_occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("instructions", "smsp__inst_executed.sum"),
    ("shared_bank_conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"),
    ("shared_wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"),
    ("dram_bytes", "dram__bytes.sum"),
    # Spills: local memory's loads and stores (a kernel at 255 registers).
    ("local_load_bytes", "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"),
    ("local_store_bytes", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"),
]
# Tensor-pipe utilisation: whichever of these columns the section wrote.
TENSOR = re.compile(r"^sm__pipe_tensor\w*cycles_active\.avg\.pct_of_peak_sustained_(active|elapsed)$|"
                    r"^sm__inst_executed_pipe_tensor\w*\.avg\.pct_of_peak_sustained_active$")
# Stall reasons from PC sampling (a count of samples each), the not-issued
# variants left out: they repeat the same samples.
STALL = re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+?)(\.sum)?$")


def not_issued(column):
    """The not-issued variant of a stall column (smsp__..._not_issued on the
    raw page, "stall_... (Not Issued)" on the SASS page): the same samples
    again, restricted."""
    return "not_issued" in re.sub(r"[ -]+", "_", column.lower())


def label(d, causal):
    return f"d{d}{' causal' if causal else ''}"


def tag(d, causal):
    return f"d{d}{'c' if causal else ''}"


# ---- reading ncu's CSV pages ----


def read_table(path, must):
    """Rows of a CSV page as dicts, from the first line whose fields hold
    every name in `must` (ncu prints ==PROF== lines and, on the raw page, a
    units row after the header). Returns (header, rows)."""
    if not os.path.exists(path):
        return [], []
    with open(path, newline="", errors="replace") as f:
        lines = list(csv.reader(f))
    for i, fields in enumerate(lines):
        if all(m in fields for m in must):
            header = fields
            rows = [dict(zip(header, r)) for r in lines[i + 1:] if len(r) == len(header)]
            return header, rows
    return [], []


def number(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return None


def kernel_rows(raw_csv):
    """The raw page's kernels in launch order (dicts of column -> value),
    its header and its units (column -> unit). The raw page is wide (a
    column a metric, a units row under the header); a page in the long
    form (a row a metric: Metric Name, Metric Unit, Metric Value) is
    turned wide."""
    header, rows = read_table(raw_csv, ["Kernel Name"])
    if "Metric Name" in header and "Metric Value" in header:
        wide, units = {}, {}
        for r in rows:
            k = wide.setdefault(r["ID"], {"ID": r["ID"], "Kernel Name": r["Kernel Name"]})
            k[r["Metric Name"]] = r["Metric Value"]
            units[r["Metric Name"]] = r.get("Metric Unit", "")
        names = list(dict.fromkeys(m for k in wide.values() for m in k))
        rows, header = list(wide.values()), names
    else:
        units = next((r for r in rows if number(r.get("ID")) is None), {})
    ks = sorted((r for r in rows if number(r.get("ID")) is not None), key=lambda r: number(r["ID"]))
    return header, ks, units


def pick_kernels(rows, side):
    """(forward, backward): ours by name; theirs the longest kernel named
    fwd / bwd (FlashAttention-2's), else the two longest in launch order."""
    def dur(r):
        return number(r.get("gpu__time_duration.sum")) or 0.0

    def longest(pred):
        c = [r for r in rows if pred(r["Kernel Name"])]
        return max(c, key=dur) if c else None

    if side == "ours":
        return longest(lambda n: "flash_forward_kernel" in n), longest(lambda n: "flash_backward_kernel" in n)
    fwd, bwd = longest(lambda n: "fwd" in n), longest(lambda n: "bwd" in n and "dq_dk_dv" in n)
    if (fwd is None or bwd is None) and len(rows) >= 2:
        fwd, bwd = sorted(sorted(rows, key=dur)[-2:], key=lambda r: number(r["ID"]))
    return fwd, bwd


def kernel_summary(header, r, units):
    s = {"kernel": r["Kernel Name"][:160]}
    for key_, start in METRICS:
        col = next((h for h in header if h.startswith(start)), None)
        v = number(r.get(col)) if col else None
        if v is None:
            continue
        if key_ == "duration_us":
            v *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(units.get(col, "nsecond"), 1e-3)
        s[key_] = round(v, 3)
    values = {h: number(r.get(h)) for h in header}
    tensor = {h: round(v, 2) for h, v in values.items() if TENSOR.match(h) and v is not None}
    if tensor:
        s["tensor_pipe_pct"] = tensor
    stalls = {}
    for h, v in values.items():
        m = STALL.match(h)
        if m and not not_issued(h) and v:
            stalls[m.group(1)] = stalls.get(m.group(1), 0) + v
    total = sum(stalls.values())
    if total:
        s["stall_share"] = {k: round(v / total, 4) for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]) if v / total >= 0.005}
    return s


def source_tables(path):
    """The SASS page's tables, one a profiled kernel in launch order (each
    starts with its own header row)."""
    if not os.path.exists(path):
        return []
    with open(path, newline="", errors="replace") as f:
        lines = list(csv.reader(f))
    tables = []
    for fields in lines:
        if "Source" in fields and any(h.startswith("Warp Stall Sampling") for h in fields):
            tables.append((fields, []))
        elif tables and len(fields) == len(tables[-1][0]):
            tables[-1][1].append(dict(zip(tables[-1][0], fields)))
    return tables


def source_summary(table, top=25):
    """One kernel's SASS: samples by opcode and the instructions the most
    samples stalled at, each with its leading stall reasons."""
    header, rows = table
    all_col = next((h for h in header if h.startswith("Warp Stall Sampling (All")), None)
    if all_col is None or not rows:
        return None
    reasons = [h for h in header if (h.startswith("stall_") or STALL.match(h)) and not not_issued(h)]
    by_op, items = {}, []
    for r in rows:
        n = number(r.get(all_col)) or 0.0
        src = r["Source"].strip()
        op = re.sub(r"^@!?\w+\s+", "", src).split(" ")[0]
        by_op[op] = by_op.get(op, 0.0) + n
        if n:
            why = sorted(((number(r[h]) or 0.0, STALL.sub(r"\1", h).replace("stall_", "")) for h in reasons),
                         reverse=True)
            items.append((n, r.get("Address", ""), src, [f"{w} {int(c)}" for c, w in why[:3] if c]))
    total = sum(by_op.values())
    if not total:
        return None
    items.sort(key=lambda x: -x[0])
    return {"samples": int(total),
            "by_opcode": {k: round(v / total, 4) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]},
            "top_instructions": [{"share": round(n / total, 4), "address": a, "sass": s_[:90], "stalls": w}
                                 for n, a, s_, w in items[:top]]}


def summarize(d):
    rows = []
    for hd, causal in CONFIGS:
        row = {"name": label(hd, causal), "forward_flop": flops(hd, causal, False)}
        for side in ("ours", "torch"):
            base = os.path.join(d, f"{side}_{tag(hd, causal)}")
            header, ks, units = kernel_rows(base + "_raw.csv")
            fwd, bwd = pick_kernels(ks, side) if ks else (None, None)
            tables = source_tables(base + "_source.csv")
            for part, r in (("fwd", fwd), ("bwd", bwd)):
                if r is None:
                    continue
                s = kernel_summary(header, r, units)
                # The SASS page's tables follow the raw page's kernels.
                if len(tables) == len(ks):
                    src = source_summary(tables[ks.index(r)])
                    if src:
                        s["sass"] = src
                if s.get("duration_us"):
                    work = row["forward_flop"] * (2.5 if part == "bwd" else 1.0)
                    s["tflops"] = round(work / (s["duration_us"] * 1e-6) / 1e12, 1)
                row[f"{side}_{part}"] = s
        rows.append(row)
    return rows


def print_table(rows):
    keys = ["duration_us", "tflops", "issue_active_pct", "warps_active_per_scheduler", "warps_eligible_per_scheduler",
            "cycles_per_issued_instruction", "registers_per_thread", "achieved_occupancy_pct", "instructions",
            "shared_bank_conflicts", "shared_wavefronts", "local_load_bytes", "local_store_bytes"]
    for row in rows:
        for part in ("fwd", "bwd"):
            o, t = row.get(f"ours_{part}"), row.get(f"torch_{part}")
            print(f"== {row['name']} {part}: ours {o['kernel'][:60] if o else '(none)'} | "
                  f"torch {t['kernel'][:60] if t else '(none)'}")
            for k in keys:
                if (o and k in o) or (t and k in t):
                    print(f"  {k:32s} {str(o.get(k, '-') if o else '-'):>14s} {str(t.get(k, '-') if t else '-'):>14s}")
            for s, name in ((o, "ours"), (t, "torch")):
                if s and "tensor_pipe_pct" in s:
                    print(f"  tensor pipe ({name}): {s['tensor_pipe_pct']}")
                if s and "stall_share" in s:
                    print(f"  stalls ({name}): " + ", ".join(f"{k} {v:.1%}" for k, v in list(s["stall_share"].items())[:8]))


# ---- running ncu ----


def find_ncu(given):
    for c in [given, shutil.which("ncu"), "/usr/local/cuda/bin/ncu", *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))]:
        if c and os.path.exists(c):
            return c
    return None


TORCH_STEP = """
import sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
d, causal = int(sys.argv[1]), sys.argv[2] == "1"
q, k, v, g = (torch.randn({b}, {hidden} // d, {t}, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for x in (q, k, v):
    x.requires_grad_(True)
def step():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(g)
for _ in range(2):
    step()
torch.cuda.synchronize()
torch.cuda.profiler.start()
step()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
""".format(b=B, hidden=HIDDEN, t=T)


def run_ncu(ncu, d, side, hd, causal, cmd, extra, log):
    rep = os.path.join(d, f"{side}_{tag(hd, causal)}")
    base = [ncu, "--clock-control", "none", "--target-processes", "all", "--set", "full", "--import-source", "no",
            "-f", "-o", rep] + extra
    p = subprocess.run(base + cmd, capture_output=True, text=True)
    log.write(f"$ {shlex.join(base + cmd)}\nrc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}\n")
    if not os.path.exists(rep + ".ncu-rep"):
        print(f"{side} {label(hd, causal)}: ncu wrote no report (rc {p.returncode}): {p.stderr[-400:]}", flush=True)
        return
    for page, args in (("raw", ["--page", "raw", "--csv", "--print-units", "base"]),
                       ("source", ["--page", "source", "--csv", "--print-source", "sass"]),
                       ("details", ["--page", "details", "--csv"])):
        with open(f"{rep}_{page}.csv", "w") as f:
            q = subprocess.run([ncu, "--import", rep + ".ncu-rep"] + args, stdout=f, stderr=subprocess.PIPE, text=True)
        log.write(f"export {page} rc {q.returncode} {q.stderr[-400:]}\n")
    os.remove(rep + ".ncu-rep")  # the CSV pages hold what is read; the report is tens of MB


def profile(a):
    ncu = find_ncu(a.ncu)
    if not ncu:
        sys.exit("attention_profile: no ncu (Nsight Compute) on this machine (--ncu PATH)")
    os.makedirs(a.dir, exist_ok=True)
    script = os.path.join(a.dir, "torch_step.py")
    with open(script, "w") as f:
        f.write(TORCH_STEP)
    with open(os.path.join(a.dir, "ncu.log"), "a") as log:
        for hd, causal in CONFIGS:
            # Ours: the benchmark's warm-up step, then the first timed one
            # (launches 3 and 4 of the two kernels: --launch-skip counts the
            # kernels the name filter lets through).
            run_ncu(ncu, a.dir, "ours", hd, causal,
                    shlex.split(a.ours) + [f"--benchmark_filter=^BM_Attention/{hd}/{int(causal)}/1/1/0/0/0/0/"],
                    ["--kernel-name", "regex:flash_(forward|backward)_kernel", "--launch-skip", "2", "--launch-count",
                     "2"], log)
            # Theirs: every kernel between cudaProfilerStart and Stop (one
            # step after two warm-up steps); the summary takes the longest
            # forward and backward ones.
            run_ncu(ncu, a.dir, "torch", hd, causal, [sys.executable, script, str(hd), "1" if causal else "0"],
                    ["--profile-from-start", "off", "--launch-count", "12"], log)
            print(f"profiled {label(hd, causal)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", help="the command that runs //bench:attention_cuda_bench")
    ap.add_argument("--dir", help="where ncu's CSV pages go")
    ap.add_argument("--summarize", metavar="DIR", help="only summarize the CSV pages in DIR")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ncu", default=None)
    a = ap.parse_args()
    if a.summarize:
        d = a.summarize
    else:
        if not a.ours or not a.dir:
            ap.error("--ours and --dir (or --summarize DIR)")
        profile(a)
        d = a.dir
    rows = summarize(d)
    print_table(rows)
    if not any(k.startswith(("ours_", "torch_")) for r in rows for k in r):
        print(f"attention_profile: no kernel found in {d}'s CSV pages", file=sys.stderr)
        return 1
    if a.json:
        meta = device_meta(False) if not a.summarize and shutil.which("nvidia-smi") else {}
        doc = dict(meta, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   commit=commit(),
                   workload=f"ncu --set full, one forward + backward step, bf16, batch {B}, sequence {T}, hidden "
                   f"{HIDDEN}: ours (flash_forward_kernel, flash_backward_kernel) beside PyTorch SDPA's flash "
                   "backend (FlashAttention-2's flash_fwd_kernel, flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel); "
                   "tflops from ncu's duration (unlocked clocks); stall_share: PC samples by stall reason; sass: "
                   "samples by opcode and the top stalled instructions of the step's profiled kernels",
                   command="python3 bench/attention_profile.py --ours 'bash .gpu/run.sh attention_cuda_bench' "
                   "--dir DIR --json gpu_attention_profile.json", rows=rows)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
