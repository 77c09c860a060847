#!/usr/bin/env python3
"""Every CUDA kernel launched by some emulated test: the check .ci/run makes
after `bazel test //...`, so that a kernel added without a test that runs it
under the emulation fails CI rather than reaching a GPU untried.

The kernels are the `__global__` functions defined in the tree's .cu and
.cuh files (not under third_party/, whose kernels test the emulator, and
not in *_test.cu files, which launch their own). The launches are what the
emulated test processes recorded at exit (third_party/cuda_emu/cuda_emu.cc
writes emu_launches.<pid>.txt into the test's undeclared outputs, which
bazel zips into bazel-testlogs/<target>/test.outputs/outputs.zip, cached
results included): a line per kernel launched, tab-separated: count,
launching file, <object>+<offset> locating the emulated kernel's
instantiation, launch name. A launch's name is its kernel expression as written before
<<< (`norm_rows_forward_kernel<T, C, VEC, true>`, `cuda::k<T>`): its last
identifier before the template arguments names the kernel; its file tells
two kernels of one name apart (reduce_rows_kernel in reduce.cu and in
batch_norm.cu), a kernel defined in a header counting for the files that
launch it.

    tools/emu_coverage.py                 the tree here, bazel info's testlogs
    tools/emu_coverage.py --root R --testlogs T [--tests FILE]
    tools/emu_coverage.py --list          also each kernel's tests and launches
    tools/emu_coverage.py --instances     also the instantiations no test ran

--instances (a report, not CI's check) reads the emulated objects that the
records name with nm: every instantiation of a kernel compiled there
(dtype, vector width, variant), and which ones ran. Objects are looked up
where the record says, else under bazel-bin by their path after /bin/.

Exit 1, naming each kernel no test launched (its file and line) and the
number of launch records read, when one is missing; exit 2 when there is no
launch record at all (the tests did not run, or ran elsewhere).
"""
import argparse
import collections
import functools
import os
import re
import subprocess
import sys
import zipfile

# The converter's own reading of .cu code: comments and literals blanked
# (mask), line numbers (line_of). No __pycache__ beside it in the tree.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "third_party", "cuda_emu"))
from cu2emu import line_of, mask  # noqa: E402

SKIP_DIRS = {".git", "third_party", ".gpu", ".gpudata", "node_modules"}
RECORD = re.compile(r"(^|/)emu_launches\.\d+\.txt$")
TOKEN = re.compile(r"\s*([A-Za-z_]\w*|::|\(|<|\*|&)")


def skip_parens(code, i):
    """The index past the parenthesised group starting at code[i] == '('."""
    depth = 0
    for j in range(i, len(code)):
        if code[j] == "(":
            depth += 1
        elif code[j] == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


def kernels_in(code):
    """(name, offset) of each __global__ function declared in code: the
    identifier before the first '(' after the return type, past any
    __launch_bounds__(...) or attribute; None where a token it does not
    know ([[, an expression) comes first."""
    found = []
    for m in re.finditer(r"\b__global__\b", code):
        i = m.end()
        name = None
        while i < len(code):
            t = TOKEN.match(code, i)
            if not t:
                break
            tok, i = t.group(1), t.end()
            if tok == "(":
                break
            if tok in ("__launch_bounds__", "__attribute__", "alignas"):
                j = code.index("(", i)
                i = skip_parens(code, j)
                continue
            if tok == "<":  # a templated return type
                depth = 1
                while depth and i < len(code):
                    depth += {"<": 1, ">": -1}.get(code[i], 0)
                    i += 1
                continue
            if re.fullmatch(r"[A-Za-z_]\w*", tok):
                name = tok
        found.append((name if tok == "(" else None, m.start()))
    return found


def defined_kernels(root, unread):
    """[(name, path, line)] of the tree's kernels, path relative to root;
    'path:line' of each __global__ whose name it cannot read into unread."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("bazel-") and not x.startswith("."))
        for f in sorted(files):
            if not f.endswith((".cu", ".cuh")) or f.endswith("_test.cu"):
                continue
            path = os.path.join(d, f)
            rel = os.path.relpath(path, root)
            code = mask(open(path, encoding="utf-8", errors="replace").read())
            seen = set()
            for name, off in kernels_in(code):
                if name is None:
                    unread.append(f"{rel}:{line_of(code, off)}")
                elif name not in seen:  # a declaration and its definition
                    seen.add(name)
                    out.append((name, rel, line_of(code, off)))
    return out


def covered(defs, launched):
    """{(name, path): launches} for each definition: a launch from file F of
    kernel K runs F's own K when F defines one, else it counts for every
    header (.cuh) that defines a K (which F includes is not read); a record
    without its file ('-') counts for every K."""
    in_file = {(n, p) for n, p, _ in defs}
    count = collections.Counter()
    for (f, k), n in launched.items():
        if f != "-" and (k, f) in in_file:
            count[(k, f)] += n
            continue
        for name, path, _ in defs:
            if name == k and (f == "-" or path.endswith(".cuh")):
                count[(name, path)] += n
    return count


def kernel_of(name):
    """The kernel a launch or an instantiation names: `a::b<T, 4>` -> b."""
    return name.split("<", 1)[0].strip().rsplit("::", 1)[-1]


def records(testlogs, only=None):
    """Yields (test, text) for each launch record under testlogs: in the
    zipped undeclared outputs, or unzipped (--nozip_undeclared_test_outputs);
    with `only` (package/name paths), those tests' alone, so that the logs of
    a test since deleted, or not built this time, do not count."""
    for d, dirs, files in os.walk(testlogs, followlinks=True):
        dirs.sort()
        test = re.split(r"/test\.outputs|/test_attempts", os.path.relpath(d, testlogs))[0]
        test = re.sub(r"/(shard_\d+_of_\d+)?(_?run_\d+_of_\d+)?$", "", test)
        if only is not None and test not in only:
            continue
        zipped = "outputs.zip" in files  # (bazel leaves the files it zipped beside the zip)
        for f in sorted(files):
            path = os.path.join(d, f)
            if f == "outputs.zip":
                try:
                    with zipfile.ZipFile(path) as z:
                        for n in z.namelist():
                            if RECORD.search(n):
                                yield test, z.read(n).decode("utf-8", "replace")
                except zipfile.BadZipFile:
                    print(f"emu_coverage: {path} is not a zip file; skipped", file=sys.stderr)
            elif RECORD.search(f) and not zipped:
                yield test, open(path, encoding="utf-8", errors="replace").read()


def strip_params(sym):
    """A demangled function's name without its parameter list (the last
    top-level parentheses) and return type."""
    depth = 0
    for i in range(len(sym) - 1, -1, -1):
        if sym[i] == ")":
            depth += 1
        elif sym[i] == "(":
            depth -= 1
            if depth == 0:
                sym = sym[:i]
                break
    return sym[5:] if sym.startswith("void ") else sym


@functools.lru_cache(maxsize=None)
def symbols(obj):
    """{offset: demangled name without parameters} of obj's defined functions."""
    out = subprocess.run(["nm", "-C", "--defined-only", obj], check=True, capture_output=True, text=True).stdout
    syms = {}
    for line in out.splitlines():
        p = line.split(" ", 2)
        if len(p) == 3 and p[1] in "tTwW":
            syms[int(p[0], 16)] = strip_params(p[2])
    return syms


def local_object(path, bazel_bin):
    """The object a record names, here: its own path, else the part after
    /bin/ under bazel-bin (a result cached from another output base)."""
    if os.path.exists(path):
        return path
    if "/bin/" in path and bazel_bin:
        p = os.path.join(bazel_bin, path.split("/bin/", 1)[1])
        if os.path.exists(p):
            return p
    return None


def nested(inst):
    """Whether a function is defined inside another (a lambda's operator()
    in a kernel: "k<T>(...)::{lambda(long)#1}::operator()")."""
    return ")::" in inst.replace("(anonymous namespace)::", "") or "{lambda" in inst


def instance_report(defs, placed, bazel_bin):
    """Prints, kernel by kernel, the instantiations compiled in the objects
    that the records name and those that no record launched. placed:
    {(object, offset): launches}."""
    names = {n for n, _, _ in defs}
    compiled, ran, missing_objects = set(), set(), set()
    for obj in sorted({o for o, _ in placed}):
        local = local_object(obj, bazel_bin)
        if not local:
            missing_objects.add(obj)
            continue
        syms = symbols(local)
        # (A lambda or local class inside a kernel is named after it: "k<T>(...)::{lambda...}".)
        compiled |= {s for s in syms.values() if kernel_of(s) in names and not nested(s)}
        ran |= {syms[off] for o, off in placed if o == obj and off in syms}
    by_kernel = collections.defaultdict(list)
    for inst in compiled:
        by_kernel[kernel_of(inst)].append(inst)
    print(f"emu_coverage: {len(ran & compiled)} of {len(compiled)} kernel instantiations ran under the emulation")
    for k in sorted(by_kernel):
        insts = sorted(by_kernel[k])
        idle = [i for i in insts if i not in ran]
        print(f"  {k}: {len(insts) - len(idle)} of {len(insts)}")
        for i in idle:
            print(f"    not run: {i.replace('(anonymous namespace)', '{anon}')}")
    for obj in sorted(missing_objects):
        print(f"  (not found here, not read: {obj})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=".", help="the source tree (default .)")
    ap.add_argument("--testlogs", help="bazel-testlogs of the run (default: bazel info bazel-testlogs in --root)")
    ap.add_argument("--bazel-bin", help="bazel-bin, for --instances (default: beside --testlogs)")
    ap.add_argument("--tests", help="a file of test labels (//pkg:name, a line each): read only their records")
    ap.add_argument("--list", action="store_true", help="print each kernel with its tests and launches")
    ap.add_argument("--instances", action="store_true", help="report the instantiations no test ran")
    a = ap.parse_args()
    testlogs = a.testlogs
    if not testlogs:
        testlogs = subprocess.run(["bazel", "info", "bazel-testlogs"], cwd=a.root, check=True, capture_output=True,
                                  text=True).stdout.strip()
    unread = []
    defs = defined_kernels(a.root, unread)
    if unread:
        print("emu_coverage: cannot read the kernel's name after __global__ at " + ", ".join(unread) +
              " (write `__global__ void [__launch_bounds__(...)] name(`)")
        return 1
    launched = collections.Counter()  # (launching file, kernel) -> launches
    placed = collections.Counter()  # (object, offset) -> launches
    tests = collections.defaultdict(set)  # kernel -> tests that launched it
    n_records = 0
    only = None
    if a.tests:
        only = {l.strip().lstrip("/").replace(":", "/") for l in open(a.tests) if l.strip().startswith("//")}
    for test, text in records(testlogs, only):
        n_records += 1
        for line in text.splitlines():
            parts = line.split("\t", 3)
            if len(parts) != 4 or not parts[0].isdigit():
                continue
            count, file, where, name = int(parts[0]), parts[1], parts[2], parts[3]
            k = kernel_of(name)
            launched[(file, k)] += count
            tests[k].add(test)
            obj, plus, off = where.rpartition("+")
            if plus and obj != "-":
                placed[(obj, int(off, 16))] += count
    if n_records == 0:
        print(f"emu_coverage: no launch record (emu_launches.<pid>.txt) under {testlogs}: "
              "run the emulated tests first (bazel test //...)")
        return 2
    count = covered(defs, launched)
    if a.list:
        for name, path, line in defs:
            print(f"{name}  {path}:{line}  {count[(name, path)]} launches  {', '.join(sorted(tests[name])) or '-'}")
    if a.instances:
        instance_report(defs, placed, a.bazel_bin or os.path.join(os.path.dirname(os.path.realpath(testlogs)), "bin"))
    missing = [(name, path, line) for name, path, line in defs if count[(name, path)] == 0]
    if missing:
        print(f"emu_coverage: {len(missing)} of {len(defs)} CUDA kernels launched by no emulated test "
              f"({n_records} launch records read under {testlogs}):")
        for name, path, line in missing:
            print(f"  {name} ({path}:{line})")
        print("  (a kernel launched through a variable is recorded under the variable's name: launch it by name)")
        return 1
    n_tests = len({t for name, _, _ in defs for t in tests[name]})
    print(f"emu_coverage: all {len(defs)} CUDA kernels launched under the emulation "
          f"({sum(count.values())} launches by {n_tests} tests, {n_records} launch records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
