#!/bin/bash
# tools/gpu_check.sh without a GPU: a made-up tree with two GPU tests and a
# stand-in .gpu/run.sh. The tests step runs the tests tools/gpu_tests.py
# reads off the BUILD files (not a plain test), a summary line a binary
# with its counts and failures, and NONE RAN beside a binary in which no
# test passed; --targets lists them with the tools' binaries; --targets
# figures the figures' five; --within cuts every limit to what is left of
# its seconds; a missing bundle stops the run with a named error rather than
# a page of failed steps.
set -euo pipefail
check=$(realpath "$1")
tests_py=$(realpath "$2")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "gpu_check_test: $*"; exit 1; }
mkdir -p "$tmp/repo/tools" "$tmp/repo/core" "$tmp/repo/.gpu" "$tmp/bin"
cp "$check" "$tmp/repo/tools/gpu_check.sh"
cp "$tests_py" "$tmp/repo/tools/gpu_tests.py"
cat >"$tmp/repo/core/BUILD" <<'B'
ember_test(name = "good_test", backends = ["cpu", "cuda_emu"])
ember_test(name = "skips_test", tags = ["gpu"])
ember_test(name = "cpu_only_test")
B
cat >"$tmp/repo/.gpu/run.sh" <<'R'
#!/bin/bash
[ "$1" = "--unpack" ] && exit 0
echo "$1" >>"$(dirname "$0")/ran"
case $1 in
good_test) printf '[       OK ] A.B (1 ms)\n[       OK ] A.C (1 ms)\n[  FAILED  ] A.D (2 ms)\n[  FAILED  ] A.D (2 ms)\n'; exit 1 ;;
skips_test) printf '[  SKIPPED ] A.E (0 ms)\n' ;;
*) echo "no binary '$1'" >&2; exit 2 ;;
esac
R
# No nvidia-smi on this machine: a stand-in, first on PATH.
printf '#!/bin/sh\necho "Stand-in GPU, 0, 1 MiB, 1 MHz"\n' >"$tmp/bin/nvidia-smi"
chmod +x "$tmp/bin/nvidia-smi" "$tmp/repo/.gpu/run.sh"
export PATH="$tmp/bin:$PATH" OUT="$tmp/out"
mkdir -p "$OUT"
bash "$tmp/repo/tools/gpu_check.sh" tests >"$tmp/log" 2>&1 || fail "the tests step failed: $(cat "$tmp/log")"
[ "$(tr '\n' ' ' <"$tmp/repo/.gpu/ran")" = "good_test skips_test " ] || fail "ran: $(cat "$tmp/repo/.gpu/ran")"
sum=$(cat "$OUT/summary.txt")
grep -qx 'good_test rc=1 2 ok 0 skipped A.D (2 ms) ' <<<"$sum" || fail "good_test's line: $sum"
grep -qx 'skips_test rc=0 0 ok 1 skipped NONE RAN ' <<<"$sum" || fail "skips_test's line: $sum"
[ -s "$OUT/logs.tgz" ] || fail "no logs.tgz"
targets=$(bash "$tmp/repo/tools/gpu_check.sh" --targets)
grep -q '^//core:good_test //core:skips_test //bench:numerics_cpu ' <<<"$targets" || fail "--targets: $targets"
grep -q cpu_only <<<"$targets" && fail "--targets took a test without GPU paths: $targets"
[ "$(bash "$tmp/repo/tools/gpu_check.sh" --targets figures | wc -w)" = 5 ] || fail "--targets figures"
# --within: the limits cut to what is left (25 s, less 20 for the
# summaries): a binary that would run 60 s is stopped after about 5.
echo 'ember_test(name = "slow_test", tags = ["gpu"])' >>"$tmp/repo/core/BUILD"
sed -i 's/^\*) echo/slow_test) sleep 60 ;;\n*) echo/' "$tmp/repo/.gpu/run.sh"
start=$SECONDS
bash "$tmp/repo/tools/gpu_check.sh" --within 25 tests >"$tmp/log" 2>&1 || fail "--within: $(cat "$tmp/log")"
[ $((SECONDS - start)) -lt 20 ] || fail "--within 25 ran $((SECONDS - start)) s"
grep -q '^slow_test rc=124 0 ok' "$OUT/summary.txt" || fail "slow_test's line: $(cat "$OUT/summary.txt")"
if bash "$tmp/repo/tools/gpu_check.sh" --within soon tests >"$tmp/log" 2>&1; then fail "--within soon accepted"; fi
grep -q "expects whole seconds, got 'soon'" "$tmp/log" || fail "--within soon: $(cat "$tmp/log")"
rm "$tmp/repo/.gpu/run.sh"
if bash "$tmp/repo/tools/gpu_check.sh" tests >"$tmp/log" 2>&1; then fail "ran without a bundle"; fi
grep -q 'gpu_check: no bundle in' "$tmp/log" || fail "the missing bundle not named: $(cat "$tmp/log")"
echo "gpu_check: ok"
