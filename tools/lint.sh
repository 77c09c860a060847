#!/usr/bin/env bash
# The checks .ci/run makes before building (also by hand: tools/lint.sh):
#   * format: clang-format (the repository's .clang-format) on the C++ lines
#     changed since the commit in .ci/format-since, so new code is formatted
#     and old code is not churned; prints the diff that would fix it.
#   * line budget: no source file (C++, CUDA, Python, shell, Starlark) over
#     1,000 lines; split a file by concern before it gets there.
#   * GPU tests: every test whose sources ask cuda_is_available() is one
#     that tools/gpu_check.sh runs on a GPU (tools/gpu_tests.py --check).
#   * mutants: every mutant of tools/cuda_mutants.py still applies (its
#     original text once in its file; cuda_mutants.py --check).
# Exit 1 naming what failed.
set -uo pipefail
cd "$(dirname "$0")/.."
rc=0
since=$(cat .ci/format-since)
binary=$(command -v clang-format-14 || command -v clang-format || true)
gcf=$(command -v git-clang-format-14 || command -v git-clang-format || true)
if [ -z "$binary" ] || [ -z "$gcf" ]; then
  echo "lint: clang-format / git-clang-format not found (tools/setup.sh installs them)"
  rc=1
elif ! git cat-file -e "$since^{commit}" 2>/dev/null; then
  echo "lint: the format baseline $since is not in this clone's history (a shallow clone?); format not checked"
else
  out=$("$gcf" --binary "$binary" --diff "$since" --extensions cc,h,cu,cuh 2>&1)
  case "$out" in
    *"no modified files to format"* | *"did not modify any files"*) echo "lint: format ok (lines changed since ${since:0:10})" ;;
    *)
      echo "$out"
      echo "lint: the lines above are not formatted; run: git clang-format --binary $binary $since"
      rc=1
      ;;
  esac
fi
over=$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' '*.py' '*.sh' '*.bzl' | xargs wc -l | awk '$2 != "total" && $1 > 1000')
if [ -n "$over" ]; then
  echo "$over"
  echo "lint: the files above are over the 1,000-line budget"
  rc=1
else
  echo "lint: every source file within 1,000 lines"
fi
python3 tools/gpu_tests.py --check || rc=1
python3 tools/cuda_mutants.py --check || rc=1
exit "$rc"
