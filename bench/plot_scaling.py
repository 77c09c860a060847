# bench/README.md's plots, from the JSON bench/compare_peers.py --out writes:
#   docs/plots/ddp_scaling.png      throughput and efficiency vs ranks (ours, and the peers where measured)
#   docs/plots/collectives.png      bus bandwidth vs message size per collective (ours vs torch's Gloo)
#   docs/plots/peers.png            step / epoch time of each workload, ours beside both peers
#   docs/plots/fsdp.png             FSDP step time and per-rank peak memory by strategy, ours and torch's fully_shard
# Medians of the run's rounds; error bars span min to max.
#
#   tools/setup.sh --plots                     # Debian's python3-matplotlib
#   /usr/bin/python3 bench/plot_scaling.py     # replot from bench/results/*.json
#   /usr/bin/python3 bench/plot_scaling.py --run   # rerun the benchmarks (interleaved with the peers), then plot
import argparse, json, os, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
OUT = os.path.join(ROOT, "docs", "plots")
COLORS = {"ours": "tab:blue", "torch 1.13": "tab:orange", "torch 2.15": "tab:green"}


def stats(xs):
    m = statistics.median(xs)
    return m, m - min(xs), max(xs) - m


def subtitle(data):
    return f"{data.get('cpu') or data.get('machine', '')}, {data.get('date', '')}, {data.get('rounds', '?')} rounds"


def errorbars(st):
    """The medians and the error bars (min to max) of stats() figures."""
    return dict(y=[s[0] for s in st], yerr=[[s[1] for s in st], [s[2] for s in st]])


def save(fig, title, data, path):
    """Titles the figure (with the run's subtitle) and writes it; True."""
    fig.suptitle(title + subtitle(data))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def plot_ddp(plt, data, path):
    sc = data["workloads"].get("ddp_scaling")
    if not sc:
        return False
    ips = sc["img_per_s"]
    widths = sorted({int(k.split("/")[0]) for impl in ips.values() for k in impl})
    fig, axes = plt.subplots(2, len(widths), figsize=(5 * len(widths), 7), squeeze=False)
    for col, w in enumerate(widths):
        for impl, series in ips.items():
            pts = sorted((int(k.split("/")[1]), v) for k, v in series.items() if int(k.split("/")[0]) == w)
            if not pts:
                continue
            ranks = [p for p, _ in pts]
            st = [stats(v) for _, v in pts]
            axes[0][col].errorbar(ranks, **errorbars(st), marker="o", capsize=3, label=impl, color=COLORS.get(impl))
            one = dict(pts).get(1)
            if one:
                base = statistics.median(one)
                axes[1][col].plot(ranks, [s[0] / (r * base) for r, s in zip(ranks, st)], marker="o", label=impl,
                                  color=COLORS.get(impl))
        axes[0][col].set_title(f"ResNet-18 width {w}, batch 32 per rank")
        axes[0][col].set_ylabel("images/s (all ranks)")
        axes[1][col].set_ylabel("efficiency (img/s per rank / 1 process)")
        axes[1][col].axhline(1.0, color="grey", lw=0.5)
        axes[1][col].set_ylim(0, 1.1)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("processes (1 thread each; 2 cores: 4 oversubscribe)")
            ax.set_xticks([1, 2, 4])
            ax.grid(alpha=0.3)
            ax.legend()
    return save(fig, "DDP over Gloo: ", data, path)


def plot_collectives(plt, data, path):
    c = data["workloads"].get("collectives")
    if not c:
        return False
    bw = c["busbw_GBps"]
    ops = ["allreduce", "allgather_into_tensor", "reduce_scatter_tensor"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, op in zip(axes, ops):
        for impl, series in bw.items():
            pts = sorted((int(k.split("/")[1]), v) for k, v in series.items() if k.split("/")[0] == op)
            if not pts:
                continue
            st = [stats(v) for _, v in pts]
            ax.errorbar([p for p, _ in pts], **errorbars(st), marker="o", capsize=3, label=impl, color=COLORS.get(impl))
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    return save(fig, "Gloo collectives, 2 processes on localhost, float32: ", data, path)


def plot_peers(plt, data, path):
    rows = [(k, d) for k, d in data["workloads"].items() if d.get("impls") and "ours" in d["impls"]]
    if not rows:
        return False
    impls = ["ours", "torch 1.13", "torch 2.15"]
    fig, axes = plt.subplots(1, len(rows), figsize=(2.6 * len(rows), 4), squeeze=False)
    for ax, (k, d) in zip(axes[0], rows):
        names, meds, errs, cols = [], [], [[], []], []
        for impl in impls:
            xs = d["impls"].get(impl, {}).get("s")
            if not xs:
                continue
            m, lo, hi = stats(xs)
            names.append(impl.replace("torch ", "pt "))
            meds.append(m)
            errs[0].append(lo)
            errs[1].append(hi)
            cols.append(COLORS[impl])
        ax.bar(names, meds, yerr=errs, color=cols, capsize=3)
        ax.set_title(k, fontsize=9)
        ax.set_ylabel("seconds (lower is better)")
        ax.tick_params(axis="x", labelsize=8)
    return save(fig, "Time per step / epoch, ours and PyTorch: ", data, path)


def plot_fsdp(plt, data, path):
    f = data["workloads"].get("fsdp")
    if not f:
        return False
    keys = list(f)
    peer = data.get("peer", "torch")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    x = range(len(keys))
    labels = [k.replace("/", "\n", 1).replace("/", " x") for k in keys]
    for i, (name, series) in enumerate((("ours", "ours_ms"), (peer, "peer_ms"))):
        st = [stats(f[k][series]) for k in keys]
        axes[0].bar([j + (i - 0.5) * 0.4 for j in x], [s[0] for s in st], 0.4,
                    yerr=[[s[1] for s in st], [s[2] for s in st]], capsize=3, label=name,
                    color=COLORS.get(name, "tab:green" if i else "tab:blue"))
    for i, (name, key) in enumerate((("ours", "ours_peak_MiB"), (peer, "peer_peak_MiB"))):
        axes[1].bar([j + (i - 0.5) * 0.4 for j in x], [f[k][key] for k in keys], 0.4, label=name,
                    color=COLORS.get(name, "tab:green" if i else "tab:blue"))
    axes[0].set_ylabel("step ms (lower is better)")
    axes[1].set_ylabel("rank 0 peak RSS above baseline, MiB (freed memory returned)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=8)
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
    return save(fig, f"FSDP (model/strategy x processes), ours and {peer}'s fully_shard: ", data, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true", help="rerun compare_peers.py first (about an hour)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.run:
        subprocess.run(["bazel", "build", "-c", "opt", "//bench:train_bench", "//bench:ddp_scaling",
                        "//bench:collectives_bench", "//examples:mlp_fashion"], cwd=ROOT, check=True)
        cp = os.path.join(ROOT, "bench", "compare_peers.py")
        subprocess.run([sys.executable, cp, "resnet", "mlp", "ddp", "collectives", "--rounds", str(a.rounds),
                        "--out", os.path.join(RESULTS, "peers.json")], check=True)
        subprocess.run(["bazel", "build", "-c", "opt", "//bench:fsdp_bench"], cwd=ROOT, check=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fsdp_compare.py"), "--ours",
                        os.path.join(ROOT, "bazel-out", "k8-opt", "bin", "bench", "fsdp_bench"), "--models", "gpt",
                        "--rounds", str(a.rounds), "--out", os.path.join(RESULTS, "fsdp.json")], check=True)
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_scaling.py needs matplotlib: tools/setup.sh --plots (Debian's python3-matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(OUT, exist_ok=True)
    done = []
    for name in sorted(os.listdir(RESULTS)) if os.path.isdir(RESULTS) else []:
        if not name.endswith(".json"):
            continue
        data = json.load(open(os.path.join(RESULTS, name)))
        for fn, png in ((plot_ddp, "ddp_scaling.png"), (plot_collectives, "collectives.png"),
                        (plot_peers, "peers.png"), (plot_fsdp, "fsdp.png")):
            if fn(plt, data, os.path.join(OUT, png)):
                done.append(os.path.join("docs", "plots", png))
            plt.close("all")
    if not done:
        sys.exit(f"no results in {RESULTS}: run with --run, or compare_peers.py --out first")
    print("wrote " + ", ".join(done))


if __name__ == "__main__":
    main()
