#!/bin/bash
# Non-finite values in //examples:gpt on 2 ranks, planted by --inject-nan
# in rank 1's token embeddings at step 3: --detect-anomaly names the module
# (wte), the rank and the step and stops the job; --nan-rerun calls a NaN
# that comes back on the re-run "persistent (data or model)" and stops,
# and one planted only on the first try "transient (hardware or race)" and
# trains on to the end.
set -u
gpt=$1
tmp=${TEST_TMPDIR:-$(mktemp -d)}
base=(--nproc 2 --dim 32 --heads 4 --seq 16 --max-steps 4 --global-batch 8 --sample-len 0 --eval-every 100 --lr 1e-3)
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
# run NAME EXPECTED_RC ARGS...: output in $tmp/NAME.out
run() {
  local name=$1 want=$2
  shift 2
  timeout 300 "$gpt" "${base[@]}" --checkpoint-dir "$tmp/$name" "$@" >"$tmp/$name.out" 2>&1
  local rc=$?
  if { [ "$want" = 0 ] && [ "$rc" -ne 0 ]; } || { [ "$want" != 0 ] && [ "$rc" -eq 0 ]; }; then
    fail "$name: exit status $rc"
    cat "$tmp/$name.out"
  fi
}
expect() {
  grep -qF -- "$2" "$tmp/$1.out" || {
    fail "$1: no '$2'"
    cat "$tmp/$1.out"
  }
}
found="rank 1, step 3: the forward output of module 'wte' holds 2048 NaN and 0 Inf of 2048 values"

run detect 1 --detect-anomaly --inject-nan 1:3
expect detect "step 3: the gradient norm is not finite; the loss is not finite on rank 1; $found; stopping (--detect-anomaly)"

run persistent 1 --detect-anomaly --nan-rerun --inject-nan 1:3
expect persistent "step 3: the gradient norm is not finite; the loss is not finite on rank 1; $found (and so on the first try: the step re-run on the same batch reproduced it): persistent (data or model); stopping (--nan-rerun)"

run transient 0 --detect-anomaly --nan-rerun --inject-nan 1:3:once --metrics "$tmp/transient.jsonl"
expect transient "step 3: the gradient norm is not finite; the loss is not finite on rank 1; $found; gone when the step was re-run on the same batch: transient (hardware or race)"
# The run went on with finite losses to the end.
python3 - "$tmp/transient.jsonl" <<'PY' || fail "transient: the metrics"
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert [d["step"] for d in lines] == [1, 2, 3, 4], lines
assert all(math.isfinite(d["loss"]) and math.isfinite(d["grad_norm"]) for d in lines), lines
PY

# --nan-rerun alone names the rank from its loss; bad flags are named.
run rerun_only 1 --nan-rerun --inject-nan 0:2
expect rerun_only "step 2: the gradient norm is not finite; the loss is not finite on rank 0 (and so on the first try"
run bad_flag 1 --inject-nan 1
expect bad_flag "--inject-nan 1: give RANK:STEP or RANK:STEP:once"
run bad_amp 1 --nan-rerun --amp fp16
expect bad_amp "--nan-rerun: with --amp fp16"

[ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }
echo "all anomaly checks passed"
