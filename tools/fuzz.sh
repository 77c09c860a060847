#!/usr/bin/env bash
# Runs a fuzz target for real: libFuzzer + AddressSanitizer, built with clang
# (bazel --config=fuzz, CPU-only). The corpus grows in a scratch directory
# seeded from the target's testdata/fuzz/<target>/; a crash leaves its input
# as crash-* in the working directory, to be added to the seed corpus once
# fixed. Prints executions and coverage at the end.
#
#   tools/fuzz.sh TARGET [SECONDS] [extra libFuzzer flags]
#   TARGET: //core:safetensors_fuzz //data:idx_fuzz //data:cifar_fuzz
#           //distributed/checkpoint:checkpoint_fuzz //distributed/store:store_fuzz
#   tools/fuzz.sh all 600     # each for 10 minutes, one after another
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(//core:safetensors_fuzz //data:idx_fuzz //data:cifar_fuzz //distributed/checkpoint:checkpoint_fuzz
         //distributed/store:store_fuzz)
target=${1:?usage: tools/fuzz.sh TARGET|all [SECONDS] [libFuzzer flags]}
seconds=${2:-60}
shift $(( $# >= 2 ? 2 : 1 ))
if [ "$target" = all ]; then
  for t in "${targets[@]}"; do "$0" "$t" "$seconds" "$@"; done
  exit 0
fi
pkg=${target#//}; pkg=${pkg%%:*}; name=${target##*:}
bazel build --config=fuzz "//$pkg:${name}_fuzzer" >&2
work=${EMBER_FUZZ_DIR:-/tmp/ember_fuzz}/$name
mkdir -p "$work/corpus"
echo "fuzz: $target for $seconds s; corpus $work/corpus (seeds: $pkg/testdata/fuzz/$name)" >&2
log=$work/log
# -rss_limit_mb: the store target keeps a server and sockets; 2 GB is ample.
"bazel-bin/$pkg/${name}_fuzzer" -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=2048 \
  -artifact_prefix="$work/" "$@" "$work/corpus" "$pkg/testdata/fuzz/$name" 2>&1 | tee "$log" | grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|ERROR|SUMMARY|crash-" >&2 || true
execs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$log" | grep -oE "[0-9]+$" || echo "?")
cov=$(grep -E "^#[0-9]+[[:space:]]+DONE" "$log" | grep -oE "cov: [0-9]+ ft: [0-9]+" | tail -1 || true)
if grep -q "ERROR: \|deadly signal\|invariant broken" "$log"; then
  echo "fuzz: $target FOUND A CRASH after $execs executions (see $log and $work/crash-*)"
  exit 1
fi
echo "fuzz: $target $seconds s, $execs executions, no crash, $cov, corpus $(ls "$work/corpus" | wc -l) files"
