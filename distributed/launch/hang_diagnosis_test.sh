#!/bin/bash
# Jobs that hang, run under //tools:launch (hang_test_worker_main.cc): the
# launcher's teardown asks the survivors for their flight recorder dumps,
# names a frozen rank, and prints fr_trace's verdict; //tools:fr_trace on
# the same dumps says the same with exit status 1. Each case fails without
# the flight recorder: the launcher alone names only the first rank that
# timed out.
set -u
launch=$1 worker=$2 fr_trace=$3
tmp=${TEST_TMPDIR:-$(mktemp -d)}
failures=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# run NAME NPROC: the job's output in $tmp/NAME.out, its dumps in $tmp/NAME.
run() {
  local name=$1 n=$2
  rm -rf "$tmp/$name"
  # Collectives time out after 4 s; the rendezvous may take longer on a
  # loaded machine.
  EMBER_FR_DUMP_DIR="$tmp/$name" EMBER_DIST_TIMEOUT_SEC=4 EMBER_RDZV_TIMEOUT_SEC=60 \
    timeout 120 "$launch" --nproc_per_node="$n" -- "$worker" "$name" >"$tmp/$name.out" 2>&1
  local rc=$?
  [ "$rc" -ne 0 ] || fail "$name: the job exited 0"
  [ "$rc" -ne 124 ] || fail "$name: the launcher itself hung"
  "$fr_trace" "$tmp/$name" >"$tmp/$name.trace" 2>&1
  local trc=$?
  [ "$trc" -eq 1 ] || fail "$name: fr_trace exited $trc, not 1"
}

# expect NAME FILE TEXT: FILE ("out": the launcher's, "trace": fr_trace's) has TEXT.
expect() {
  local name=$1 which=$2 text=$3
  if ! grep -qF -- "$text" "$tmp/$name.$which"; then
    fail "$name: $which lacks: $text"
    echo "---- $name.$which ----"
    cat "$tmp/$name.$which"
    echo "----"
  fi
}

# (a) rank 2 of 4 skips one all-reduce of its dp_shard group.
run skip_allreduce 4
line="collective 5 (allreduce, group dp_shard [0,2]) joined by ranks 0; missing: 2"
expect skip_allreduce out "launch: fr_trace: $line"
expect skip_allreduce trace "$line"
# The barrier ranks 0 and 2 never reached: rank 0 is named as waiting in the
# all-reduce, not as a suspect.
expect skip_allreduce trace "missing: 0,2 (rank 0 waits in collective 5 (allreduce) of group dp_shard [0,2])"
expect skip_allreduce trace "suspect rank(s): 2"
# The cause before its consequence.
cause=$(grep -n "collective 5 (allreduce, group dp_shard" "$tmp/skip_allreduce.trace" | head -1 | cut -d: -f1)
effect=$(grep -n "collective 3 (barrier, group default" "$tmp/skip_allreduce.trace" | head -1 | cut -d: -f1)
[ -n "$cause" ] && [ -n "$effect" ] && [ "$cause" -lt "$effect" ] || fail "skip_allreduce: the barrier's line comes before the all-reduce's"

# (b) rank 1 calls an all-gather with another size.
run allgather_size 4
line="collective 2 (allgather_into_tensor, group default [0,1,2,3]) mismatched sizes or dtypes: ranks 0,2,3 allgather_into_tensor input [4] float32 output [16] float32; rank 1 allgather_into_tensor input [8] float32 output [32] float32"
expect allgather_size trace "$line"
expect allgather_size out "launch: fr_trace: $line"
expect allgather_size trace "suspect rank(s): 1"

# (c) a pipeline's stage 0 never sends micro-batch 2.
run pp_no_send 2
expect pp_no_send trace "p2p recv by rank 1 from rank 0 (group default [0,1]"
expect pp_no_send trace "never matched: rank 0 posted 0 send(s) with that tag to rank 1; sender 0, receiver 1"
expect pp_no_send out "launch: fr_trace: p2p recv by rank 1 from rank 0"

# (f) rank 1 frozen by SIGSTOP: the others time out; the launcher names rank 1.
run freeze 4
expect freeze out "launch: rank 1 (local rank 1, pid"
expect freeze out "is frozen: stopped by a signal (SIGSTOP) or a debugger"
expect freeze out "launch: the job's likely cause: frozen rank(s) 1"
expect freeze trace "no dump from rank 1 "
expect freeze trace "collective 3 (allreduce, group default [0,1,2,3]) joined by ranks 0,2,3; missing: 1 (no dump from 1)"
# No worker is left behind, stopped or not.
sleep 0.5
if pgrep -f "hang_test_worker freeze" >/dev/null; then fail "freeze: a worker outlived the launcher"; fi

# SIGUSR1 to the launcher: every worker dumps, the job goes on and ends well.
rm -rf "$tmp/healthy"
EMBER_FR_DUMP_DIR="$tmp/healthy" "$launch" --nproc_per_node=2 -- "$worker" healthy >"$tmp/healthy.out" 2>&1 &
pid=$!
# Once both workers are past init_process_group (their SIGUSR1 handler is in).
for _ in $(seq 300); do
  [ "$(grep -c "healthy: rank [01] ready" "$tmp/healthy.out")" -eq 2 ] && break
  sleep 0.1
done
kill -USR1 "$pid"
wait "$pid"
rc=$?
[ "$rc" -eq 0 ] || fail "healthy: the job exited $rc after SIGUSR1"
expect healthy out "launch: received SIGUSR1: the workers dump their flight recorders to $tmp/healthy"
for r in 0 1; do
  grep -qF '"reason": "SIGUSR1"' "$tmp/healthy/ember_fr_rank$r.json" 2>/dev/null || fail "healthy: no SIGUSR1 dump of rank $r"
done
"$fr_trace" "$tmp/healthy" >"$tmp/healthy.trace" 2>&1
[ $? -eq 0 ] || fail "healthy: fr_trace found a problem in a healthy job"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all hang diagnosis checks passed"
