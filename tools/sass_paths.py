#!/usr/bin/env python3
"""Instructions a kernel's loops issue per iteration on their full-tile path.

A static measure of a CUDA kernel change that a machine without a GPU can
take: from a cubin's SASS (cuobjdump), for each loop that holds tensor-core
instructions, the path through one iteration with the most tensor-core
instructions and, among those, the fewest instructions in all: in an
attention kernel, the iteration over a whole tile that needs no mask, which
is nearly every iteration. A mask test predicated into every score, a
conditional exp2 compiled to a branch a score, or a tile load looping over
thread-dependent trip counts all show up here as instructions the path issues
for no tensor-core work; the loop's static size (both copies of a branch)
does not say that. For a loop with exponentials (MUFU) it also counts
those issued among tensor-core instructions (one within four instructions
on either side, no barrier between): an attention kernel whose softmax runs
in a stretch of its own leaves the tensor pipe idle for it. The runs of
consecutive tensor-core instructions (average, longest) and how many of
them reuse an operand register say the same of the products' side. Where the
listing carries each instruction's control bits (cuobjdump prints them), it
models one warp issuing the iteration alone: stall counts and scoreboard
waits, with assumed latencies (issue_model).

    nvcc ... -cubin -o attention.cubin core/ops/attention_flash.cu
    tools/sass_paths.py attention.cubin 'flash_forward_kernel<ember::BFloat16, 128,'

The pattern is a regular expression searched in each demangled kernel name.
cuobjdump comes with the full CUDA toolkit (--cuobjdump, or $CUOBJDUMP, or
PATH); /usr/local/cuda's compiler-only install here lacks it, and NVIDIA's
nvidia-cuda-cuobjdump wheel carries it. The same command reads any cubin,
also one taken out of a library with `cuobjdump -xelf`, such as the
FlashAttention kernels of PyTorch's libtorch_cuda.so (bench/README.md).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

TENSOR = {"HMMA", "HGMMA", "IMMA", "QGMMA", "IGMMA", "BGMMA", "UTCHMMA"}
CLASSES = [
    ("tensor", TENSOR),
    ("ldsm", {"LDSM"}),
    ("shared", {"LDS", "STS"}),
    ("global", {"LDG", "STG", "LDGSTS", "REDG", "RED", "ATOMG", "LDGDEPBAR", "DEPBAR"}),
    ("local", {"LDL", "STL"}),
    ("mufu", {"MUFU"}),
    ("fp32", {"FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "F2FP", "FCHK", "FRND", "F2F"}),
    ("shfl", {"SHFL"}),
    ("control", {"BRA", "BSSY", "BSYNC", "BAR", "WARPSYNC", "BREAK", "EXIT", "CALL", "RET", "NOP"}),
]


def demangle(names):
    if not names:
        return []
    tool = shutil.which("c++filt")
    if not tool:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def functions(cuobjdump, cubin):
    """({mangled name: [(address, instruction text)]}, {mangled name: [control
    bits or None]}) of every kernel in the cubin: the control bits are the
    instruction's second 64-bit word, which cuobjdump prints on the next line."""
    text = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    funcs, ctls, cur, cur_ctl = {}, {}, None, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            cur_ctl = ctls.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
            cur_ctl.append(None)
            continue
        m = re.match(r"\s*/\* (0x[0-9a-f]{16}) \*/\s*$", line)
        if m and cur_ctl:
            cur_ctl[-1] = int(m.group(1), 16)
    return funcs, ctls


# Control bits (Volta and later: bits 105-125 of an instruction, 41-61 of
# its second word): cycles to stall before the warp's next instruction, the
# scoreboard this one's result sets (variable-latency instructions), the one
# its operands' reads release, and the scoreboards it waits on.
def control(word):
    c = word >> 41
    return {"stall": c & 0xF, "write": (c >> 5) & 7, "read": (c >> 8) & 7, "wait": (c >> 11) & 0x3F}


# Assumed latencies (cycles) of the instructions that set a scoreboard, from
# published Hopper microbenchmarks; read scoreboards free after READ_RELEASE.
LATENCY = {"LDSM": 33, "LDS": 30, "LDL": 40, "LDG": 500, "LDGSTS": 20, "MUFU": 20, "SHFL": 25, "S2R": 25,
           "LDC": 20, "HMMA": 34, "REDG": 20, "ATOMS": 30}
READ_RELEASE = 4


def issue_model(ins, ctl, path, rounds=3):
    """One warp issuing the path alone, again and again: an instruction
    issues when the warp's last one's stall count has passed and every
    scoreboard it waits on is ready. Returns (cycles of the last round,
    the path's sum of stall counts, cycles spent waiting on scoreboards in
    it), or None where the listing has no control bits. No other warp, no
    pipe's throughput: a measure of the order in which a kernel's
    instructions meet their operands, not of its speed."""
    if any(ctl[i] is None for i in path):
        return None
    ready = [0] * 6
    t, cycles, waited = 0, 0, 0
    for _ in range(rounds):
        start, waited = t, 0
        for i in path:
            c = control(ctl[i])
            due = max([ready[b] for b in range(6) if c["wait"] >> b & 1] + [t])
            waited += due - t
            t = due
            if c["write"] != 7:
                ready[c["write"]] = t + LATENCY.get(decode(ins[i][1])[0], 6)
            if c["read"] != 7:
                ready[c["read"]] = max(ready[c["read"]], t + READ_RELEASE)
            t += max(c["stall"], 1)
        cycles = t - start
    return cycles, sum(max(control(ctl[i])["stall"], 1) for i in path), waited


def decode(txt):
    """(opcode base, predicated or otherwise conditional, branch target or None)."""
    toks = txt.split()
    pred = toks[0].startswith("@")
    if pred:
        toks = toks[1:]
    op = toks[0]
    base = op.split(".")[0]
    target = None
    if base == "BRA":
        m = re.search(r"0x([0-9a-f]+)\s*$", txt)
        target = int(m.group(1), 16) if m else None
        # BRA.DIV, or a predicate operand before the target: conditional too.
        pred = pred or ".DIV" in op or len(toks) > 2
    return base, pred, target


def blocks(ins):
    """Basic blocks as (start index, end index inclusive)."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    starts = {0}
    for i, (_, txt) in enumerate(ins):
        base, _, target = decode(txt)
        if base in ("BRA", "EXIT") and i + 1 < len(ins):
            starts.add(i + 1)
        if target is not None and target in index:
            starts.add(index[target])
    s = sorted(starts)
    return [(b, (s[k + 1] - 1) if k + 1 < len(s) else len(ins) - 1) for k, b in enumerate(s)]


def full_tile_path(ins, lo, hi):
    """Over instructions [lo, hi] (a loop: hi branches back to lo), the path from
    lo to hi with the most tensor-core instructions, then the fewest
    instructions; back edges inside and exits are not taken. Returns the
    path's instruction indices."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    bl = [(b, e) for b, e in blocks(ins) if lo <= b <= hi]
    start_of = {b: k for k, (b, _) in enumerate(bl)}
    best = [None] * len(bl)  # (tensor, -count, predecessor block)
    best[0] = (0, 0, None)
    for k, (b, e) in enumerate(bl):
        if best[k] is None:
            continue
        tensor = sum(decode(ins[i][1])[0] in TENSOR for i in range(b, e + 1))
        here = (best[k][0] + tensor, best[k][1] - (e - b + 1))
        if e == hi:
            return _walk(bl, best, k)
        base, cond, target = decode(ins[e][1])
        succ = []
        if not (base in ("BRA", "EXIT") and not cond):
            succ.append(e + 1)
        if target is not None and target in index and index[target] > e:
            succ.append(index[target])
        for s in succ:
            if s in start_of and s <= hi:
                j = start_of[s]
                cand = (here[0], here[1], k)
                if best[j] is None or cand[:2] > best[j][:2]:
                    best[j] = cand
    return None


def _walk(bl, best, k):
    path, cur = [], k
    while cur is not None:
        b, e = bl[cur]
        path[:0] = range(b, e + 1)
        cur = best[cur][2]
    return path


def _back_edge(ins, i, index):
    base, _, target = decode(ins[i][1])
    return base == "BRA" and target is not None and target <= ins[i][0] and target in index


def classify(ins, idx):
    h = collections.Counter()
    for i in idx:
        base = decode(ins[i][1])[0]
        for name, ops in CLASSES:
            if base in ops:
                h[name] += 1
                break
        else:
            h["integer/other"] += 1
    return h


def _tensor_near(ins, path, k, step, reach=4):
    """Whether a tensor-core instruction lies within `reach` instructions of
    path[k] in direction `step`, with no barrier between: a MUFU so placed
    issues while the tensor pipe works (an exponential among the products),
    not in a run of its own while the tensor pipe idles."""
    for j in range(k + step, k + step * (reach + 1), step):
        if not 0 <= j < len(path):
            return False
        base = decode(ins[path[j]][1])[0]
        if base in TENSOR:
            return True
        if base == "BAR":
            return False
    return False


def tensor_runs(ins, path):
    """(lengths of the runs of consecutive tensor-core instructions along
    the path, how many of them reuse an operand register (.reuse)). Long
    runs mean the products come in blocks of their own, with the softmax's
    instructions in stretches between them: the tensor pipe works and
    idles by turns unless other warps fill the gaps."""
    runs, cur, reuse = [], 0, 0
    for i in path:
        txt = ins[i][1]
        if decode(txt)[0] in TENSOR:
            cur += 1
            reuse += ".reuse" in txt
        elif cur:
            runs.append(cur)
            cur = 0
    if cur:
        runs.append(cur)
    return runs, reuse


def report(name, ins, ctl=None):
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, txt) in enumerate(ins):
        base, _, target = decode(txt)
        if base == "BRA" and target is not None and target <= a and target in index:
            lo = index[target]
            if any(decode(ins[j][1])[0] in TENSOR for j in range(lo, i + 1)):
                loops.append((lo, i))
    print(name)
    total = classify(ins, range(len(ins)))
    print(f"  kernel: {len(ins)} instructions, {total['tensor']} tensor-core")
    if not loops:
        print("  no loop with tensor-core instructions")
    for lo, hi in loops:
        path = full_tile_path(ins, lo, hi)
        if not path:
            continue
        h = classify(ins, path)
        t = h["tensor"] or 1
        detail = ", ".join(f"{k} {v}" for k, v in sorted(h.items(), key=lambda kv: -kv[1]) if k != "tensor")
        # A loop inside this one (a back edge within it) is counted once.
        inner = sum(1 for i in range(lo, hi) if _back_edge(ins, i, index) and index[decode(ins[i][1])[2]] >= lo)
        note = f" (a loop inside counted once: {inner})" if inner else ""
        print(f"  loop {ins[lo][0]:#06x}-{ins[hi][0]:#06x} ({hi - lo + 1} instructions): full-tile iteration "
              f"{len(path)} instructions, {h['tensor']} tensor-core, {len(path) / t:.2f} a tensor-core instruction{note}")
        print(f"    {detail}")
        model = issue_model(ins, ctl, path) if ctl else None
        if model:
            print(f"    one warp alone: {model[0]} cycles an iteration (stall counts {model[1]}, "
                  f"scoreboard waits {model[2]})")
        if h["tensor"]:
            runs, reuse = tensor_runs(ins, path)
            print(f"    tensor-core runs: {sum(runs) / len(runs):.1f} on average, {max(runs)} longest; "
                  f"{reuse} of {h['tensor']} reuse an operand register")
        mufu = [k for k, i in enumerate(path) if decode(ins[i][1])[0] == "MUFU"]
        if mufu and h["tensor"]:
            beside = sum(1 for k in mufu if _tensor_near(ins, path, k, -1) and _tensor_near(ins, path, k, 1))
            print(f"    mufu beside tensor-core instructions: {beside} of {len(mufu)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cubin")
    p.add_argument("pattern", help="regular expression searched in the demangled kernel names")
    p.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump"))
    args = p.parse_args()
    if not args.cuobjdump or not os.path.exists(args.cuobjdump):
        sys.exit("sass_paths: no cuobjdump (--cuobjdump PATH or $CUOBJDUMP): it comes with the full CUDA toolkit")
    funcs, ctls = functions(args.cuobjdump, args.cubin)
    names = list(funcs)
    found = 0
    for mangled, pretty in zip(names, demangle(names)):
        if re.search(args.pattern, pretty):
            found += 1
            report(pretty, funcs[mangled], ctls[mangled])
    if not found:
        sys.exit(f"sass_paths: no kernel of {args.cubin} matches {args.pattern!r} ({len(names)} kernels)")


if __name__ == "__main__":
    main()
