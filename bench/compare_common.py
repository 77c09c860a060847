# What the compare scripts (ac_compare.py, fsdp_compare.py, tp_compare.py)
# share: their common arguments, the environment that returns freed memory to
# the OS the same way for both sides, running our benchmark and a peer
# script, reading a peer script's JSON records out of its output, and the
# model-state figures both report.
import argparse, json, os, subprocess

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "torch2")

# Peak RSS measured alike for ours and the peer: glibc returns freed blocks
# above 64 KiB at once, and our caching allocator keeps nothing.
LOW_MEM_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "EMBER_CPU_CACHE_MB": "0"}


def peer_record(out, script):
    """Rank 0's record of `script` in a peer's output (its ranks print
    concurrently: two records may share a line); raises on its error record."""
    dec, pos, records = json.JSONDecoder(), 0, []
    while (start := out.find("{", pos)) >= 0:
        try:
            d, pos = dec.raw_decode(out, start)
            records.append(d)
        except json.JSONDecodeError:
            pos = start + 1
    for d in records:
        if d.get("script") == script:
            if d.get("kind") == "error":
                raise RuntimeError(d["error"])
            if d.get("rank") == 0:
                return d
    raise RuntimeError("no result from the peer:\n" + out)


def compare_parser():
    """The arguments every compare script takes: our benchmark binary, the
    peer's Python and the number of interleaved rounds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--python", default=os.path.expanduser("~/.venvs/torch2-peer/bin/python"))
    ap.add_argument("--rounds", type=int, default=3)
    return ap


def run_env(low_mem):
    return dict(os.environ, **(LOW_MEM_ENV if low_mem else {}))


def run_ours(binary, bench_filter, low_mem):
    """The record of the one benchmark of `binary` that `bench_filter` selects."""
    out = subprocess.run([binary, f"--benchmark_filter={bench_filter}", "--benchmark_format=json"],
                         capture_output=True, text=True, check=True, env=run_env(low_mem)).stdout
    return json.loads(out)["benchmarks"][0]


def run_peer(python, script, args, low_mem):
    """Rank 0's record of peers/torch2/<script>.py run with `args`."""
    out = subprocess.run([python, os.path.join(PEERS, script + ".py")] + args, capture_output=True, text=True,
                         check=True, env=run_env(low_mem)).stdout
    return peer_record(out, script)


def ours_model_state(b):
    """Step time, peak RSS and the model state of our benchmark record b."""
    return dict(ms=b["step_ms_median"], rss=b["peak_rss_MiB"], params=b["param_MiB"], grads=b["grad_MiB"],
                state=b["state_MiB"])


def peer_model_state(d):
    """The same figures of a peer's record d, and its torch version."""
    return dict(ms=d["step_ms_median"], rss=d["peak_minus_baseline_mib"], params=d["param_mib"], grads=d["grad_mib"],
                state=d["optim_state_mib"], torch=d["torch"])
