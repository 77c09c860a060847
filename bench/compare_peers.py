# Interleaves our benchmarks with the PyTorch peers in shared/peers/, each run
# under guard.py (waits for a quiet machine, records others' load), and prints
# medians, ranges and the ratio of medians. This machine moves ±30% between
# runs minutes apart, so only figures from one interleaved run are compared.
#
#   bazel build -c opt //bench:train_bench //bench:collectives_bench   (runs bazel-out/k8-opt/bin/...)
#   /usr/bin/python3 bench/compare_peers.py resnet --rounds 3
#   /usr/bin/python3 bench/compare_peers.py collectives --rounds 2
#   /usr/bin/python3 bench/compare_peers.py ddp --rounds 2 [--widths 16,64]   (bazel build -c opt //bench:ddp_scaling)
import argparse, json, os, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.environ.get("EMBER_PEERS", os.path.join(ROOT, "..", "shared", "peers"))
PY = "/usr/bin/python3"
GUARD = [PY, os.path.join(PEERS, "guard.py"), "--"]


def run(cmd):
    p = subprocess.run(GUARD + cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}")
    out = []
    for line in p.stdout.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def ours_gbench(binary, flt, extra=()):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        # guard only sees the console output; the JSON file carries the figures.
        info = run([os.path.join(ROOT, "bazel-out", "k8-opt", "bin", "bench", binary), f"--benchmark_filter={flt}",
                    f"--benchmark_out={f.name}", "--benchmark_out_format=json", *extra])
        res = json.load(open(f.name))["benchmarks"]
    return res, info


def summary(name, xs, unit):
    return f"{name}: median {statistics.median(xs):.4g} {unit} (range {min(xs):.4g}-{max(xs):.4g}, n={len(xs)})"


def resnet(a):
    ours = {64: [], 16: []}
    peer = {64: [], 16: []}
    for r in range(a.rounds):
        res, _ = ours_gbench("train_bench", "BM_ResNet18Step", ["--benchmark_min_time=15"])
        for b in res:
            w = int(b["name"].split("/")[1])
            ours[w].append(b["real_time"] / 1e3)  # ms -> s
        for w in (64, 16):
            lines = run([PY, os.path.join(PEERS, "resnet18_train_step.py"), "--threads", "2", "--width", str(w)])
            d = [l for l in lines if "median_s" in l or "step_median_s" in l]
            key = "median_s" if "median_s" in d[-1] else "step_median_s"
            peer[w].append(d[-1][key])
        print(f"round {r + 1}: ours {[(w, round(v[-1], 4)) for w, v in ours.items()]}, "
              f"peer {[(w, round(v[-1], 4)) for w, v in peer.items()]}", flush=True)
    for w in (64, 16):
        print(summary(f"ResNet-18 w{w} b64 step, ours", ours[w], "s"))
        print(summary(f"ResNet-18 w{w} b64 step, PyTorch", peer[w], "s"))
        print(f"  ratio PyTorch/ours = {statistics.median(peer[w]) / statistics.median(ours[w]):.2f}x (>1: we are faster)")


def collectives(a):
    ours, peer = {}, {}
    for r in range(a.rounds):
        res, _ = ours_gbench("collectives_bench", ".")
        for b in res:
            ours.setdefault(b["name"].split("/iterations")[0], []).append(b["busbw"] / 1e9)
        for d in run([PY, os.path.join(ROOT, "bench", "collectives_peer.py"), "--json"]):
            if "op" in d:
                peer.setdefault((d["op"], d["bytes"]), []).append(d["busbw_GBps"])
        print(f"round {r + 1} done", flush=True)
    print(json.dumps({"ours": ours, "peer": {f"{k[0]}/{k[1]}": v for k, v in peer.items()}}, indent=1))


def ddp(a):
    # 1 process vs 2-process DDP over Gloo, 1 thread each, batch 32 per rank:
    # ours (bench/ddp_scaling, overlap on and off) beside the peer's
    # ddp_resnet.py, one round of each in turn. Efficiency = t_1proc / t_ddp
    # (same per-rank batch, so 1.0 is perfect linear scaling).
    for w in [int(x) for x in a.widths.split(",")]:
        ours = {"1": [], "on": [], "off": []}
        peer = {"1": [], "ddp": []}
        for r in range(a.rounds):
            res, _ = ours_gbench("ddp_scaling", f"width:{w}/procs:(1|2)/")
            for b in res:
                key = "1" if "/procs:1/" in b["name"] else ("on" if "overlap:1" in b["name"] else "off")
                ours[key].append(b["step_ms_median"] / 1e3)
            for d in run([PY, os.path.join(PEERS, "ddp_resnet.py"), "--width", str(w), "--rounds", "1"]):
                if d.get("anchor") == "resnet18_1proc_1thread":
                    peer["1"].append(d["median_s"])
                elif d.get("anchor") == "resnet18_ddp_gloo":
                    peer["ddp"].append(d["median_s"])
            print(f"w{w} round {r + 1}: ours 1proc {ours['1'][-1]:.4f} s, DDP on {ours['on'][-1]:.4f}, "
                  f"off {ours['off'][-1]:.4f}; peer 1proc {peer['1'][-1]:.4f}, DDP {peer['ddp'][-1]:.4f}", flush=True)
        med = {k: statistics.median(v) for k, v in ours.items()}
        pmed = {k: statistics.median(v) for k, v in peer.items()}
        for k, v in ours.items():
            print(summary(f"w{w} ours step ({k})", v, "s"))
        for k, v in peer.items():
            print(summary(f"w{w} PyTorch step ({k})", v, "s"))
        e_on, e_off, e_peer = med["1"] / med["on"], med["1"] / med["off"], pmed["1"] / pmed["ddp"]
        print(f"  w{w} efficiency: ours {e_on:.3f} (overlap off {e_off:.3f}), PyTorch {e_peer:.3f}; "
              f"ours/PyTorch {e_on / e_peer:.2f}; DDP step PyTorch/ours {pmed['ddp'] / med['on']:.2f}x; "
              f"overlap off/on {med['off'] / med['on']:.3f}", flush=True)


ap = argparse.ArgumentParser()
ap.add_argument("what", choices=["resnet", "collectives", "ddp"])
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--widths", default="16,64")
a = ap.parse_args()
{"resnet": resnet, "collectives": collectives, "ddp": ddp}[a.what](a)
