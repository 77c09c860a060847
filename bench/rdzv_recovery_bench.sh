#!/usr/bin/env bash
# rdzv_recovery_bench.sh: the time from a kill to training again, with the
# elastic agents meeting over the TCP store (--rdzv-backend c10d, the first
# agent serves it) and over a 3-member etcd cluster on localhost
# (--rdzv-backend etcd). Two agents of 2 //examples:gpt workers each
# (--nnodes 1:2, last_call_timeout=1, heartbeat_timeout=5, a checkpoint every
# 5 steps). Faults, each in every round, the backends interleaved:
#   worker  a worker of the second agent SIGKILLed (a new round, from disk)
#   live    the same with --live-recovery --dp-replicate 2 (replaced in place)
#   host    the second agent SIGKILLed with its workers (the job goes on at 2)
#   first   the first agent SIGKILLed with its workers: etcd only (under c10d
#           it serves the store, and the job ends with it)
# Prints one line per run and the medians; ROUNDS (default 3).
#
#   bazel build -c opt //examples:gpt //tools:launch && bash bench/rdzv_recovery_bench.sh [ROUNDS]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
gpt=$root/bazel-bin/examples/gpt
launch=$root/bazel-bin/tools/launch
rounds=${1:-3}
tmp=$(mktemp -d)
trap 'pkill -9 -f -- "--checkpoint-dir $tmp/" 2>/dev/null; bash "$root/distributed/testing/etcd_cluster.sh" stop "$tmp/etcd"; rm -rf "$tmp"' EXIT
bash "$root/distributed/testing/etcd_cluster.sh" start "$tmp/etcd" 3 || exit 1
eps=$(cat "$tmp/etcd/endpoints")
export OMP_NUM_THREADS=1
source "$root/tools/test_lib.sh"  # port, lines, worker_of

run() {  # BACKEND FAULT ROUND: prints the seconds from the kill to training again
  local backend=$1 fault=$2 r=$3 d=$tmp/$1_$2_$3 endpoint extra=() gargs=() pids=()
  mkdir -p "$d"
  if [ "$backend" = etcd ]; then endpoint=$eps; else endpoint=127.0.0.1:$(port); fi
  [ "$fault" = live ] && extra=(--live-recovery) && gargs=(--dp-replicate 2 --dp-shard -1)
  for n in a b; do
    "$launch" --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend "$backend" --rdzv-endpoint "$endpoint" \
      --rdzv-id "bench$r$fault" --rdzv-conf last_call_timeout=1,heartbeat_timeout=5 "${extra[@]}" -- "$gpt" \
      --dim 48 --heads 4 --seq 32 --layers 2 --max-steps 100 --global-batch 8 --sample-len 0 --eval-every 1000 \
      --save-every 5 --lr 1e-3 "${gargs[@]}" --checkpoint-dir "$d/ck" --metrics "$d/m.jsonl" > "$d/$n.log" 2>&1 &
    pids+=($!)
    sleep 0.3
  done
  for _ in $(seq 1 600); do [ "$(lines "$d/m.jsonl")" -ge 22 ] && break; sleep 0.05; done
  local victim=""
  case $fault in
    worker | live) victim=$(worker_of 2 "$d/ck") ;;
    host) victim=${pids[1]} ;;
    first) victim=${pids[0]} ;;
  esac
  local t_kill
  t_kill=$(date +%s.%N)
  kill -9 "$victim"
  wait "${pids[@]}" 2>/dev/null
  python3 -c "
import json
t = [json.loads(l).get('time', 0) for l in open('$d/m.jsonl')]  # a line a live recovery wrote late has none
print('%.2f' % (min(x for x in t if x > $t_kill) - $t_kill))" 2>/dev/null || echo nan
}

declare -A got
for r in $(seq 1 "$rounds"); do
  for fault in worker live host first; do
    for backend in c10d etcd; do
      [ "$fault" = first ] && [ "$backend" = c10d ] && continue
      s=$(run "$backend" "$fault" "$r")
      echo "round $r: $fault killed, $backend: training again after $s s"
      got[$backend.$fault]+="$s "
    done
  done
done
median() { printf '%s\n' $1 | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo "median seconds from the kill to training again (c10d / etcd):"
for fault in worker live host first; do
  c=n/a
  [ -n "${got[c10d.$fault]:-}" ] && c=$(median "${got[c10d.$fault]}")
  echo "  $fault: $c / $(median "${got[etcd.$fault]}")  (runs: c10d ${got[c10d.$fault]:-none}; etcd ${got[etcd.$fault]})"
done
