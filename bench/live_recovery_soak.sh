#!/usr/bin/env bash
# live_recovery_soak.sh: many randomized kills under live recovery, counting
# stalls and restart rounds.
# Each run: two elastic agents of 2 //examples:gpt workers on localhost with
# --live-recovery; a random rank is SIGKILLed at a random moment (after a
# random step, plus a random fraction of a step). A run passes when the job
# ends well, no rendezvous round after round 0 was started, every step is in
# the metrics once, and training went on within STALL_S (default 10) seconds
# of the kill; a run past that is a stall, and its logs are kept.
#
#   bazel build -c opt //examples:gpt //tools:launch && bash bench/live_recovery_soak.sh [RUNS] [MESH]
#
# MESH: replica (default; HSDP dp_replicate=2 x dp_shard=2: the kill is
# recovered in place) or noreplica (tp=2 x dp_shard=2, live_recovery_test's
# case 3: every rank names the missing replica and round 1 resumes from disk;
# there a restart round is expected and a stall is one past STALL_S + the
# round). KEEP=DIR keeps the logs of every failed run (default /tmp/ember_soak),
# of every run with KEEP_ALL=1. PAIRS=1 kills two workers at once, one on each
# host, each with a live replica (ranks 1 and 2, or 0 and 3): both replaced in
# one generation.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
gpt=$root/bazel-bin/examples/gpt
launch=$root/bazel-bin/tools/launch
runs=${1:-50}
mesh=${2:-replica}
stall_s=${STALL_S:-10}
keep=${KEEP:-/tmp/ember_soak}
tmp=$(mktemp -d)
trap 'pkill -9 -f -- "--checkpoint-dir $tmp/" 2>/dev/null || true; rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1
steps=80
args=(--dim 48 --heads 4 --seq 32 --layers 2 --max-steps $steps --global-batch 8 --sample-len 0 --eval-every 1000
      --save-every 10 --lr 1e-3 --dp-shard -1)
case "$mesh" in
  replica) args+=(--dp-replicate 2) ;;
  noreplica) args+=(--tp 2) ;;
  *) echo "live_recovery_soak: MESH is replica or noreplica, not '$mesh'" >&2; exit 2 ;;
esac
source "$root/tools/test_lib.sh"  # port, stamp, lines, worker_of, full_round, rounds_after

stalls=0 rounds=0 bad=0
times=()
for run in $(seq 1 "$runs"); do
  d=$tmp/r$run
  mkdir -p "$d"
  p=$(port)
  pids=()
  for n in a b; do
    (set +e; "$launch" --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint 127.0.0.1:"$p" \
       --rdzv-id "soak$run" --rdzv-conf last_call_timeout=1,heartbeat_timeout=5 --live-recovery -- "$gpt" "${args[@]}" \
       --checkpoint-dir "$d/ckpt" --metrics "$d/m.jsonl" 2>&1 | stamp > "$d/$n.log"
     echo "rc=${PIPESTATUS[0]}" >> "$d/$n.log") &
    pids+=($!)
    sleep 0.3
  done
  at=$((3 + RANDOM % 55))  # not near the end: a kill after the last step is not a recovery
  rank=$((RANDOM % 4))
  # The round the job runs in at 4 ranks (-1 if none came: every round then counts).
  r0=$(test_logs=$d full_round "$d/a.log" 4) || r0=-1
  for _ in $(seq 1 1200); do [ "$(lines "$d/m.jsonl")" -ge "$at" ] && break; sleep 0.05; done
  frac="0.$((RANDOM % 10))$((RANDOM % 10))"
  sleep "$frac"
  w=$(worker_of "$rank" "$d/ckpt")
  if [ -n "${PAIRS:-}" ]; then
    # Two workers on the two hosts at once, each with a live replica
    # (dp_replicate=2 x dp_shard=2: rank r's replica is r+2 mod 4): 1 and 2, or 0 and 3.
    other=$((3 - rank))
    w="$w $(worker_of "$other" "$d/ckpt")"
    rank="$rank and $other"
  fi
  if [ -z "${w// /}" ]; then echo "run $run: no worker of rank $rank after step $at; skipped"; wait "${pids[@]}"; continue; fi
  before=$(lines "$d/m.jsonl")
  t_kill=$(date +%s.%N)
  # shellcheck disable=SC2086
  kill -9 $w
  # Training again: a metrics line past the ones there at the kill.
  again=""
  limit=$stall_s
  [ "$mesh" = noreplica ] && limit=$((stall_s + 5))
  for _ in $(seq 1 $((limit * 50))); do
    if [ "$(lines "$d/m.jsonl")" -gt "$before" ] || grep -q "^rc=" "$d/a.log" 2>/dev/null; then
      again=$(python3 -c "import time; print('%.2f' % (time.time() - $t_kill))")
      break
    fi
    sleep 0.02
  done
  verdict=ok
  if [ -z "$again" ]; then
    verdict=STALL
    stalls=$((stalls + 1))
    # The survivors' stacks, to name where they block (gdb if present).
    for q in $(pgrep -f -- "--checkpoint-dir $d/ckpt" || true); do
      [ "$(ps -o comm= -p "$q" 2>/dev/null)" = launch ] && continue
      echo "== pid $q $(tr '\0' '\n' < /proc/"$q"/environ 2>/dev/null | grep -E '^(RANK|EMBER_RESTART_COUNT)=' | tr '\n' ' ')"
      command -v gdb > /dev/null && timeout 20 gdb -p "$q" -batch -ex 'thread apply all bt' 2>/dev/null | grep -E '^#|^Thread'
    done > "$d/stacks.txt"
    pkill -9 -f -- "--checkpoint-dir $d/ckpt" 2>/dev/null
  fi
  wait "${pids[@]}"
  for n in a b; do grep -q "rc=0" "$d/$n.log" || { [ "$verdict" = ok ] && verdict="agent $n failed"; }; done
  if [ -n "$(rounds_after "$r0" "$d/a.log" "$d/b.log")" ]; then
    rounds=$((rounds + 1))
    [ "$mesh" = replica ] && [ "$verdict" = ok ] && verdict="restart round"
  fi
  if [ "$verdict" = ok ] && ! python3 -c "
import json, sys
steps = sorted({json.loads(l)['step'] for l in open('$d/m.jsonl')})
sys.exit(steps != list(range(1, $steps + 1)))"; then verdict="steps missing"; fi
  echo "run $run: rank $rank killed after step $at (+$frac s): ${again:-no step} s to training again; $verdict"
  if [ "$verdict" != ok ] || [ -n "${KEEP_ALL:-}" ]; then
    [ "$verdict" = STALL ] || [ "$verdict" = ok ] || bad=$((bad + 1))
    mkdir -p "$keep/run$run"
    cp "$d"/*.log "$d"/stacks.txt "$keep/run$run/" 2>/dev/null
  fi
  [ "$verdict" = ok ] && times+=("$again")
  rm -rf "$d"
done
median=$(printf '%s\n' "${times[@]:-}" | sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "-"}')
echo "live_recovery_soak ($mesh): $runs runs, $stalls stalls, $rounds restart rounds, $bad other failures;" \
  "median time from the kill to training again ${median} s (logs of failed runs in $keep)"
[ "$stalls" -eq 0 ] && [ "$bad" -eq 0 ] && { [ "$mesh" = noreplica ] || [ "$rounds" -eq 0 ]; }
