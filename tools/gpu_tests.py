#!/usr/bin/env python3
"""The test binaries a GPU machine runs (tools/gpu_check.sh), read off the
BUILD files so that a test added, renamed or moved is run there without a
list to keep by hand (a hand-kept list lost the fused attention's tests when
they moved to a target of their own: the GPU gate ran a filter that matched
nothing).

An ember_test runs on the GPU machine when
  * it has the "cuda_emu" backend: its plain build runs the same CUDA paths
    on the real GPU that its _emu_test twin runs under the emulation;
  * it is tagged "cuda": it needs a GPU (not built in the CPU-only
    configuration);
  * it is tagged "gpu": it has CUDA paths that run where a GPU is present
    and skip elsewhere, with no emulated twin (tensor_test, the docs'
    snippets).

    tools/gpu_tests.py            the labels (//core:ops_cuda_test ...), for gpu_bundle.sh
    tools/gpu_tests.py --names    the binaries' names, for gpu_check.sh on the GPU machine
    tools/gpu_tests.py --check    exit 1 naming every ember_test whose sources ask
                                  cuda_is_available() but which none of the three takes
                                  (tools/lint.sh runs it)

--root DIR reads another tree (the test's fixtures). BUILD files are
Starlark, which Python's parser reads; a value that is not a literal (a
glob) is left unknown, and such a test's sources are not checked.
"""
import argparse
import ast
import os
import sys

SKIP_DIRS = {".git", ".gpu", ".gpudata", "node_modules"}


def build_files(root):
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("bazel-") and not x.startswith("."))
        for f in ("BUILD", "BUILD.bazel"):
            if f in files:
                yield os.path.join(d, f)


def literal(node, default):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return default


def ember_tests(root):
    """(label, name, sources or None, backends, tags) of every ember_test call."""
    for path in build_files(root):
        pkg = os.path.relpath(os.path.dirname(path), root)
        pkg = "" if pkg == "." else pkg.replace(os.sep, "/")
        try:
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
        except SyntaxError as e:
            sys.exit(f"gpu_tests: cannot read {path}: {e}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ember_test"):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            name = literal(kw["name"], None) if "name" in kw else None
            if not isinstance(name, str):
                sys.exit(f"gpu_tests: {path}:{node.lineno}: an ember_test without a literal name")
            srcs = literal(kw["srcs"], None) if "srcs" in kw else [name + ".cc"]
            backends = literal(kw["backends"], []) if "backends" in kw else ["cpu"]
            tags = literal(kw["tags"], []) if "tags" in kw else []
            sources = [os.path.join(os.path.dirname(path), s) for s in srcs] if isinstance(srcs, list) else None
            yield f"//{pkg}:{name}", name, sources, backends, tags


def runs_on_gpu(backends, tags):
    return "cuda_emu" in backends or "cuda" in tags or "gpu" in tags


def asks_for_gpu(sources):
    for s in sources or []:
        if os.path.isfile(s) and "cuda_is_available()" in open(s, encoding="utf-8", errors="replace").read():
            return True
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--names", action="store_true", help="binary names instead of labels")
    ap.add_argument("--check", action="store_true", help="fail on tests with GPU paths the GPU machine would not run")
    args = ap.parse_args()
    root = os.path.normpath(args.root)
    tests = list(ember_tests(root))
    if args.check:
        missed = [label for label, _, srcs, be, tags in tests if not runs_on_gpu(be, tags) and asks_for_gpu(srcs)]
        for label in missed:
            print(f"gpu_tests: {label} asks cuda_is_available() but tools/gpu_check.sh would not run it: "
                  'give it the "cuda_emu" backend or the "gpu" tag')
        print(f"gpu_tests: {sum(runs_on_gpu(b, t) for _, _, _, b, t in tests)} of {len(tests)} tests run on a GPU"
              + ("" if missed else "; every test with GPU paths among them"))
        return 1 if missed else 0
    picked = [(label, name) for label, name, _, be, tags in tests if runs_on_gpu(be, tags)]
    if not picked:
        sys.exit(f"gpu_tests: no GPU tests under {root}")
    names = [name for _, name in picked]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:  # the bundle keeps binaries by name
        sys.exit(f"gpu_tests: test names in more than one package: {' '.join(dup)}")
    print("\n".join(name if args.names else label for label, name in picked))
    return 0


if __name__ == "__main__":
    sys.exit(main())
