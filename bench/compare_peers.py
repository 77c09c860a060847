# Interleaves our benchmarks with the PyTorch peers, both of them: Debian's
# PyTorch 1.13 (/usr/bin/python3) and 2.15 (the venv of
# bench/peers/torch2/setup-venv.sh, skipped with a note when absent). Each
# run goes under guard.py (waits for a quiet machine). This machine moves
# ±30% between runs minutes apart, so only figures from one interleaved run
# are compared: per round, ours, then each peer, for every workload.
# Prints medians, ranges and the ratio ours / faster peer (time; < 1: we are
# faster; the CPU speed targets are <= 0.8), and with --out writes
# the figures as JSON (bench/plot_scaling.py and bench/README.md's table read it).
#
#   bazel build -c opt //bench:train_bench //bench:ddp_scaling //bench:collectives_bench //examples:mlp_fashion
#   python3 bench/compare_peers.py resnet mlp ddp --rounds 3 --out bench/results/peers.json
#   python3 bench/compare_peers.py collectives --rounds 2 --out bench/results/collectives.json
#   python3 bench/compare_peers.py --table bench/results/peers.json    # bench/README.md's table from a saved run
import argparse, datetime, json, os, platform, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.environ.get("EMBER_PEERS", os.path.join(ROOT, "bench", "peers"))
PY = "/usr/bin/python3"
PY2 = os.path.expanduser(os.environ.get("EMBER_TORCH2_PY", "~/.venvs/torch2-peer/bin/python"))
GUARD = [PY, os.path.join(PEERS, "guard.py")]
BIN = os.path.join(ROOT, "bazel-out", "k8-opt", "bin")


def peers():
    out = [("torch 1.13", PY)]
    if os.path.exists(PY2):
        out.append(("torch 2.15", PY2))
    else:
        print(f"note: {PY2} missing (bench/peers/torch2/setup-venv.sh makes it): PyTorch 2.15 not compared",
              file=sys.stderr)
    return out


def run(cmd, env=None):
    full = GUARD + [f"--env={k}={v}" for k, v in (env or {}).items()] + ["--"] + cmd if GUARD else cmd
    p = subprocess.run(full, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, **(env or {})))
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}")
    lines, out = [], []
    for line in p.stdout.splitlines():
        lines.append(line)
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out, lines


def ours_gbench(binary, flt, extra=()):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        # guard only sees the console output; the JSON file carries the figures.
        run([os.path.join(BIN, "bench", binary), f"--benchmark_filter={flt}", f"--benchmark_out={f.name}",
             "--benchmark_out_format=json", *extra])
        return json.load(open(f.name))["benchmarks"]


def peer_json(py, script, args, key):
    res, _ = run([py, os.path.join(PEERS, script), *args])
    rows = [r for r in res if key in r]
    if not rows:
        sys.exit(f"{script} printed no '{key}'")
    return rows[-1]


class Results:
    """Per workload: lists of seconds (and peak RSS MiB) per implementation."""

    def __init__(self):
        self.w = {}

    def add(self, workload, impl, seconds, rss=None, **extra):
        d = self.w.setdefault(workload, {"impls": {}})
        e = d["impls"].setdefault(impl, {"s": [], "rss_mib": []})
        e["s"].append(seconds)
        if rss is not None:
            e["rss_mib"].append(rss)
        d.update(extra)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def workload_resnet(res, r, pe):
    for w in (16, 64):
        b = ours_gbench("train_bench", f"^BM_ResNet18Step/{w}/64/", ["--benchmark_min_time=" + ("8" if w == 64 else "3")])
        res.add(f"resnet18_w{w}_step", "ours", b[0]["real_time"] / 1e3, b[0].get("peak_rss_MiB"),
                what=f"ResNet-18 small stem, width {w}, batch 64, 1x28x28, SGD step, 2 threads, fp32")
        for name, py in pe:
            d = peer_json(py, "resnet18_train_step.py",
                          ["--threads", "2", "--width", str(w), "--steps", "10" if w == 64 else "30"], "median_s")
            res.add(f"resnet18_w{w}_step", name, d["median_s"], d.get("peak_rss_mib"))


def workload_mlp(res, r, pe):
    _, lines = run([os.path.join(BIN, "examples", "mlp_fashion"), "--epochs", "1", "--seed", str(r)],
                   env={"OMP_NUM_THREADS": "2"})
    train = [float(l.split("train ")[1].split(" s")[0]) for l in lines if l.startswith("epoch 1:")]
    if not train:
        sys.exit("mlp_fashion printed no 'epoch 1: ... train X s' line:\n" + "\n".join(lines))
    res.add("mlp_epoch", "ours", train[0],
            what="MLP 784-512-256-10 on Fashion-MNIST, one epoch (469 steps of 128), Adam, 2 threads")
    for name, py in pe:
        d = peer_json(py, "mlp_epoch.py", ["--threads", "2", "--seeds", str(r)], "epoch_median_s")
        res.add("mlp_epoch", name, d["epoch_median_s"])


def workload_ddp(res, r, pe, widths=(16, 64)):
    # DDP over Gloo, batch 32 per rank, 1 thread per process: ours on 1, 2
    # and 4 processes (4 oversubscribe 2 cores), the peers on 1 and 2
    # (bench/peers/ddp_resnet.py). Step times for the table, img/s for the
    # scaling plot.
    sc = res.w.setdefault("ddp_scaling", {"img_per_s": {}, "what": "DDP scaling, ResNet-18, batch 32 per rank"})
    for w in widths:
        for x in ours_gbench("ddp_scaling", f"BM_DdpStep/width:{w}/"):
            procs = int(x["name"].split("procs:")[1].split("/")[0])
            overlap = "overlap:0" not in x["name"]
            if overlap:
                sc["img_per_s"].setdefault("ours", {}).setdefault(f"{w}/{procs}", []).append(x["img_per_s"])
            if procs == 1:
                res.add(f"ddp_w{w}_1proc", "ours", x["step_ms_median"] / 1e3,
                        what=f"1 process x 1 thread, ResNet-18 width {w}, batch 32 (DDP's baseline)")
            elif procs == 2 and overlap:
                res.add(f"ddp_w{w}_step", "ours", x["step_ms_median"] / 1e3,
                        what=f"DDP over Gloo, 2 processes x 1 thread, ResNet-18 width {w}, batch 32 per rank")
        for name, py in pe:
            # 10 timed steps at width 64 (a second each), the peer's default 30 at 16.
            out, _ = run([py, os.path.join(PEERS, "ddp_resnet.py"), "--width", str(w), "--rounds", "1", "--steps",
                          "10" if w == 64 else "30"])
            for d in out:
                procs = {"resnet18_1proc_1thread": 1, "resnet18_ddp_gloo": 2}.get(d.get("anchor"))
                if procs is None:
                    continue
                res.add(f"ddp_w{w}_" + ("1proc" if procs == 1 else "step"), name, d["median_s"])
                sc["img_per_s"].setdefault(name, {}).setdefault(f"{w}/{procs}", []).append(32 * procs / d["median_s"])


SIZE = {"4K": 4 << 10, "64K": 64 << 10, "256K": 256 << 10, "1M": 1 << 20, "4M": 4 << 20, "16M": 16 << 20,
        "64M": 64 << 20}


def workload_collectives(res, r, pe):
    # Bus bandwidth (GB/s) per op and message size, 2 processes over Gloo
    # on localhost: ours (collectives_bench) and torch.distributed's Gloo
    # (bench/collectives_peer.py, under 1.13: both ship the same Gloo).
    coll = res.w.setdefault("collectives", {"busbw_GBps": {}, "what": "Gloo collectives, 2 processes, float32"})
    for b in ours_gbench("collectives_bench", "."):
        op, label = b["name"].split("/")[:2]
        coll["busbw_GBps"].setdefault("ours", {}).setdefault(f"{op.replace('gloo_', '')}/{SIZE[label]}", []).append(
            b["busbw"] / 1e9)
    name, py = pe[0]
    out, _ = run([py, os.path.join(ROOT, "bench", "collectives_peer.py"), "--json"])
    for d in out:
        if "op" in d:
            coll["busbw_GBps"].setdefault(name, {}).setdefault(f"{d['op']}/{d['bytes']}", []).append(d["busbw_GBps"])


WORKLOADS = {"resnet": workload_resnet, "mlp": workload_mlp, "ddp": workload_ddp, "collectives": workload_collectives}


def table(data):
    lines = ["| workload | ours | PyTorch 1.13 | PyTorch 2.15 | ours / faster peer | peak RSS MiB ours / faster peer |",
             "|---|---|---|---|---|---|"]
    for k, d in data["workloads"].items():
        im = d.get("impls", {})
        if "ours" not in im or not im["ours"]["s"]:
            continue
        ours = med(im["ours"]["s"])
        ps = {n: med(im[n]["s"]) for n in ("torch 1.13", "torch 2.15") if n in im and im[n]["s"]}
        if not ps:
            continue
        fast = min(ps, key=ps.get)

        def cell(n):
            if n not in im or not im[n]["s"]:
                return "-"
            xs = im[n]["s"]
            return f"{med(xs):.4g} s ({min(xs):.4g}-{max(xs):.4g})"

        rss = "-"
        if im["ours"]["rss_mib"] and im.get(fast, {}).get("rss_mib"):
            rss = f"{med(im['ours']['rss_mib']):.0f} / {med(im[fast]['rss_mib']):.0f}"
        lines.append(f"| {d.get('what', k)} | {cell('ours')} | {cell('torch 1.13')} | {cell('torch 2.15')} | "
                     f"**{ours / ps[fast]:.2f}** (vs {fast}) | {rss} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", help="workloads: " + ", ".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--table", help="print bench/README.md's table of a saved run and exit")
    ap.add_argument("--no-guard", action="store_true", help="run without guard.py (a machine known to be quiet)")
    a = ap.parse_args()
    if a.table:
        print(table(json.load(open(a.table))))
        return
    if not a.what or any(w not in WORKLOADS for w in a.what):
        ap.error("name one or more workloads of: " + ", ".join(WORKLOADS))
    if a.no_guard:
        GUARD.clear()
    pe = peers()
    res = Results()
    for r in range(a.rounds):
        for w in a.what:
            WORKLOADS[w](res, r, pe)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    data = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""),
            "rounds": a.rounds, "peers": [n for n, _ in pe], "workloads": res.w}
    for k, d in res.w.items():
        for impl, e in d.get("impls", {}).items():
            if e["s"]:
                print(f"{k:28s} {impl:11s} median {med(e['s']):.4g} s  range {min(e['s']):.4g}-{max(e['s']):.4g}"
                      + (f"  peak RSS {med(e['rss_mib']):.0f} MiB" if e["rss_mib"] else ""))
    print(table(data))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        json.dump(data, open(a.out, "w"), indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
