#!/usr/bin/env bash
# live_recovery_bench.sh: the same fault with and without live recovery.
# Two elastic agents of 2 //examples:gpt workers on localhost (an HSDP mesh,
# dp_replicate=2 x dp_shard=2, a checkpoint every 10 steps); rank 0 is
# SIGKILLed after step 22. With --live-recovery its agent replaces it in
# place and it takes its state from its replica; without, the agents start
# a new round and every worker reloads the newest checkpoint. Prints, per
# run, the time from the kill to the first step finished after it and the
# steps redone; ROUNDS rounds (default 3), the two modes interleaved.
#
#   bazel build -c opt //examples:gpt //tools:launch && bash bench/live_recovery_bench.sh [ROUNDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
gpt=$root/bazel-bin/examples/gpt
launch=$root/bazel-bin/tools/launch
rounds=${1:-3}
tmp=$(mktemp -d)
trap 'pkill -9 -f -- "--checkpoint-dir $tmp/" 2>/dev/null || true; rm -rf "$tmp"' EXIT
args=(--dim 48 --heads 4 --seq 32 --layers 2 --max-steps 60 --global-batch 8 --sample-len 0 --eval-every 1000
      --save-every 10 --lr 1e-3 --dp-replicate 2 --dp-shard -1)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
for round in $(seq 1 "$rounds"); do
  for mode in live disk; do
    d=$tmp/$mode$round
    mkdir -p "$d"
    p=$(port)
    extra=()
    [ "$mode" = live ] && extra=(--live-recovery)
    pids=()
    for n in a b; do
      ("$launch" --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint 127.0.0.1:"$p" --rdzv-id "$mode$round" \
         --rdzv-conf last_call_timeout=1,heartbeat_timeout=5 "${extra[@]}" -- "$gpt" "${args[@]}" \
         --checkpoint-dir "$d/ck" --metrics "$d/m.jsonl" > "$d/$n.log" 2>&1 || true) &
      pids+=($!)
      sleep 0.3
    done
    for _ in $(seq 1 1200); do [ "$(cat "$d/m.jsonl" 2>/dev/null | wc -l)" -ge 22 ] && break; sleep 0.05; done
    t=""
    for w in $(pgrep -f -- "--checkpoint-dir $d/ck" || true); do
      [ "$(ps -o comm= -p "$w")" = launch ] && continue
      if tr '\0' '\n' < /proc/"$w"/environ | grep -qx RANK=0; then t=$(date +%s.%3N); kill -9 "$w"; fi
    done
    wait "${pids[@]}" 2>/dev/null || true
    python3 - "$d/m.jsonl" "$t" "$mode" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
t = float(sys.argv[2])
first = min((r for r in recs if "time" in r and r["time"] > t), key=lambda r: r["time"])
redone = len(recs) - len({r["step"] for r in recs})
print(f"{sys.argv[3]}: training again {first['time'] - t:.2f} s after the kill, {redone} step(s) redone")
PY
  done
done
