#!/bin/bash
# //tools:launch --rdzv-backend etcd: the elastic agents meet on a 3-member
# etcd cluster on localhost (distributed/testing/etcd_cluster.sh), two agents
# of 2 //examples:gpt workers each, --nnodes 1:2. No host is special:
#  1. The first host (the agent that started the job, with its workers) is
#     SIGKILLed at a random step, 3 seeds: the other goes on at 2 ranks, the
#     killed host started again joins at a later round (back to 4), and every
#     step's global batch is the uninterrupted run's.
#  2. One etcd member SIGKILLed mid-job: the agents fail over to the others;
#     no round is lost to it and the run ends as the uninterrupted one.
#  3. Two workers on different hosts SIGKILLed at once: one round recovers
#     both (one round after the job's, at 4 ranks), batches as uninterrupted.
#  4. Bad coordination input, each named within the join timeout: endpoints
#     that do not answer; a cluster that lost its quorum (before the job, and
#     2 of 3 members killed mid-job: every agent says so and stops); an
#     --rdzv-id another live job uses with another --nproc-per-node; a stale
#     round a crashed job left (taken over: the new job runs); an agent
#     frozen (SIGSTOP) and woken after the job ended at 2 ranks exits 0.
# Nothing is left running after each. Skips (saying so) without etcd.
set -euo pipefail
gpt=$1
launch=$2
worker=$3
cluster_sh=$4
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for c in "$tmp"/etcd*; do [ -d "$c" ] && "$cluster_sh" stop "$c"; done
  pkill -9 -f -- "--checkpoint-dir $tmp/" 2>/dev/null || true
  [ -n "${ELASTIC_ETCD_TEST_KEEP:-}" ] && mkdir -p "$ELASTIC_ETCD_TEST_KEEP" && cp "$tmp"/*.log "$ELASTIC_ETCD_TEST_KEEP"/
  rm -rf "$tmp"
}
trap cleanup EXIT
test_logs=$tmp test_tail=40
source "$(dirname "$0")/test_lib.sh"  # port, stamp, fail, wait_for, rounds, lines, worker_of, ...

set +e
"$cluster_sh" start "$tmp/etcd" 3 > "$tmp/etcd_start.log" 2>&1
rc=$?
set -e
if [ $rc = 3 ]; then echo "SKIPPED: $(cat "$tmp/etcd_start.log")"; exit 0; fi
[ $rc = 0 ] || fail "the etcd cluster did not start: $(cat "$tmp/etcd_start.log")"
eps=$(cat "$tmp/etcd/endpoints")

export OMP_NUM_THREADS=1
args=(--dim 48 --heads 4 --seq 32 --layers 2 --max-steps 120 --global-batch 8 --sample-len 0 --eval-every 1000
      --save-every 4 --lr 1e-3)
"$launch" --nproc_per_node=4 --master_port=0 -- "$gpt" "${args[@]}" --checkpoint-dir "$tmp/ref" \
  --metrics "$tmp/ref.jsonl" > "$tmp/ref.log" 2>&1 || fail "the uninterrupted run failed"

# agent NAME RUN [launcher flags...]: one agent of 2 workers on the cluster, in the background
# (GPT_EXTRA: more gpt flags).
agent() {
  local name=$1 run=$2
  shift 2
  (set +e; "$launch" --nnodes 1:2 --nproc-per-node 2 --max-restarts 5 --rdzv-backend etcd --rdzv-endpoint "$eps" \
     --rdzv-id "$run" --rdzv-conf last_call_timeout=1,heartbeat_timeout=5 "$@" -- "$gpt" "${args[@]}" ${GPT_EXTRA:-} \
     --checkpoint-dir "$tmp/$run" --metrics "$tmp/$run.jsonl" 2>&1 | stamp > "$tmp/$name.log"
   echo "rc=${PIPESTATUS[0]}" >> "$tmp/$name.log") &
  pids+=($!)
}
# same_batches RUN [T]: every record's global batch is the uninterrupted run's, every step there;
# prints how many records written after time T (0) are of steps redone (by time, not line: a
# restart rewrites the file back to its checkpoint's step).
same_batches() {
  python3 - "$tmp/ref.jsonl" "$tmp/$1.jsonl" "${2:-0}" <<'PY' || fail "$1: the batches differ from the uninterrupted run's"
import json, sys
ref = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
recs = [json.loads(l) for l in open(sys.argv[2])]
assert sorted({r["step"] for r in recs}) == sorted(ref), "steps missing"
assert len(recs) == len(ref), "a step with two lines"  # --metrics keeps one line per step
for r in recs:
    assert r["batch_digest"] == ref[r["step"]]["batch_digest"], r
print(sum(1 for r in recs if r.get("redone") and r["time"] > float(sys.argv[3])))
PY
}
nothing_left() {  # RUN
  sleep 0.3
  local left="" pid args
  # This run's processes only (its etcd's endpoints or its directory in
  # their arguments): another test on the machine may use the same id, as
  # //tools:elastic_test's c10d "frozen" run does.
  for pid in $(pgrep -f -- "--rdzv-id $1 |--checkpoint-dir $tmp/$1( |$)" || true); do
    args=$(ps -o args= -p "$pid" 2>/dev/null) || continue
    case "$args" in *"$eps"* | *"$tmp"*) left+="${left:+,}$pid" ;; esac
  done
  [ -z "$left" ] || fail "$1: processes left behind: $(ps -o pid,args -p "$left")"
}

# ---- 1. the first host killed at a random step (3 seeds), then back ----
for seed in 1 2 3; do
  run=first$seed
  pids=()
  agent a "$run"
  sleep 0.3
  agent b "$run"
  at=$((6 + (RANDOM % 20)))
  r=$(full_round "$tmp/a.log" 4)
  wait_lines "$tmp/$run.jsonl" "$at"
  victim=$(launcher_of "$run" "${pids[0]}")
  [ -n "$victim" ] || fail "no launcher of the first agent"
  t_kill=$(date +%s.%N)
  kill -9 "$victim"
  mv "$tmp/a.log" "$tmp/${run}_a.log"
  wait_round "$r" 2 30 "$tmp/b.log"
  agent a2 "$run"
  wait "${pids[1]}" "${pids[2]}" || true
  for n in b a2; do grep -q "rc=0" "$tmp/$n.log" || fail "$run: agent $n did not succeed"; done
  rounds_after "$r" "$tmp/b.log" | awk '$2 == 2 { s = 1 } s && $2 == 4 { g = 1 } END { exit !g }' ||
    fail "$run: the killed host did not rejoin: rounds $(rounds "$tmp/b.log" | tr '\n' ,)"
  redone=$(same_batches "$run")
  again=$(python3 -c "
import json
print('%.2f' % (min(r['time'] for r in map(json.loads, open('$tmp/$run.jsonl')) if r['time'] > $t_kill + 0.05) - $t_kill))")
  echo "elastic etcd 1.$seed: the first host killed after step $at; the job went on at 2 ranks, grew back to 4," \
    "every batch as uninterrupted ($redone step(s) redone); training again ${again} s after the kill"
  mv "$tmp/b.log" "$tmp/${run}_b.log"
  mv "$tmp/a2.log" "$tmp/${run}_a2.log"
  nothing_left "$run"
done

# ---- 2. an etcd member killed mid-job ----
pids=()
agent a member
sleep 0.3
agent b member
r=$(full_round "$tmp/a.log" 4)
wait_lines "$tmp/member.jsonl" 15
t_member=$(date +%s.%N)
kill -9 "$(cat "$tmp/etcd/m0/pid")"
wait "${pids[@]}" || true
for n in a b; do grep -q "rc=0" "$tmp/$n.log" || fail "member: agent $n did not succeed"; done
[ -z "$(rounds_after "$r" "$tmp/a.log" "$tmp/b.log")" ] ||
  fail "member: a round was lost to the etcd member's death: rounds $(rounds "$tmp/a.log" "$tmp/b.log" | tr '\n' ,)"
redone=$(same_batches member "$t_member")
[ "$redone" = 0 ] || fail "member: $redone steps redone after the member's death"
echo "elastic etcd 2: an etcd member killed at step 15; the agents failed over, no round lost, the run as uninterrupted"
mv "$tmp/a.log" "$tmp/member_a.log"
mv "$tmp/b.log" "$tmp/member_b.log"
nothing_left member
"$cluster_sh" restart "$tmp/etcd" 0

# ---- 3. two workers on different hosts killed at once: one round ----
pids=()
agent a two
sleep 0.3
agent b two
r=$(full_round "$tmp/a.log" 4)
wait_lines "$tmp/two.jsonl" 12
w1=$(worker_of 1 "$tmp/two")
w2=$(worker_of 2 "$tmp/two")
[ -n "$w1" ] && [ -n "$w2" ] || fail "two: no workers of ranks 1 and 2"
kill -9 "$w1" "$w2"
wait "${pids[@]}" || true
for n in a b; do grep -q "rc=0" "$tmp/$n.log" || fail "two: agent $n did not succeed"; done
[ "$(rounds_after "$r" "$tmp/a.log" "$tmp/b.log" | tr '\n' ,)" = "$((r + 1)) 4," ] ||
  fail "two: not one round at 4 ranks after round $r: rounds $(rounds "$tmp/a.log" "$tmp/b.log" | tr '\n' ,)"
redone=$(same_batches two)
echo "elastic etcd 3: ranks 1 and 2 (two hosts) killed at once; one round ($((r + 1)), at 4 ranks) recovered both, every" \
  "batch as uninterrupted ($redone redone)"
mv "$tmp/a.log" "$tmp/two_a.log"
mv "$tmp/b.log" "$tmp/two_b.log"
nothing_left two

# ---- 4. bad coordination input ----
t0=$(date +%s)
out=$("$launch" --nnodes 1:1 --rdzv-backend etcd --rdzv-endpoint 127.0.0.1:1,127.0.0.1:2 --rdzv-id none \
      --rdzv-conf join_timeout=2 -- "$worker" print 2>&1) && fail "dead endpoints were accepted"
grep -q "etcd cluster 127.0.0.1:1,127.0.0.1:2: reaching the cluster failed within 2000 ms: .*connection refused" \
  <<<"$out" || fail "dead endpoints: $out"
[ $(($(date +%s) - t0)) -le 8 ] || fail "dead endpoints took over 8 s"
out=$("$launch" --nnodes 1:1 --rdzv-backend etcd --rdzv-endpoint 127.0.0.1:1,,x -- "$worker" print 2>&1) &&
  fail "a malformed endpoint list was accepted"
grep -q "an empty item" <<<"$out" || fail "malformed endpoints: $out"
out=$("$launch" --nnodes 1:2 --rdzv-endpoint 127.0.0.1:1,127.0.0.1:2 -- "$worker" print 2>&1) && fail "a list for c10d"
grep -q "a list of endpoints needs --rdzv_backend etcd" <<<"$out" || fail "a list for c10d: $out"

# Another live job's id with another worker count: named; the job unharmed.
("$launch" --nnodes 2:2 --nproc-per-node 2 --rdzv-backend etcd --rdzv-endpoint "$eps" --rdzv-id clash \
   --rdzv-conf heartbeat_timeout=5 -- "$worker" print > "$tmp/clash_first.log" 2>&1) &
first=$!
pids+=("$first")
sleep 1
out=$("$launch" --nnodes 2:2 --nproc-per-node 1 --rdzv-backend etcd --rdzv-endpoint "$eps" --rdzv-id clash \
      --rdzv-conf heartbeat_timeout=5,join_timeout=20 -- "$worker" print 2>&1) && fail "a clashing job joined"
grep -q "rendezvous id 'clash' at etcd $eps belongs to another job (nodes 2:2 x 2 workers, program .*); this one is" \
  <<<"$out" || fail "clash: $out"
kill -0 "$first" || fail "clash: the first job died"
kill -9 "$(launcher_of clash "$first")"
wait "$first" || true
# ...whose agent is now dead: its round is stale. A new job with that id
# and another worker count takes it over within the join timeout and runs.
t0=$(date +%s)
out=$("$launch" --nnodes 1:1 --nproc-per-node 1 --rdzv-backend etcd --rdzv-endpoint "$eps" --rdzv-id clash \
      --rdzv-conf heartbeat_timeout=5,join_timeout=20 -- "$worker" print 2>&1) || fail "stale takeover failed: $out"
grep -q "took over the keys a crashed job left (nodes 2:2 x 2 workers" <<<"$out" || fail "no takeover named: $out"
grep -q "out line" <<<"$out" || fail "the new job's worker did not run: $out"
echo "elastic etcd 4: a clashing id named; the stale round of the crashed job taken over in $(($(date +%s) - t0)) s"
# The same command again after a crash (same signature): its stale round is
# moved on by the newcomer, which then runs alone.
("$launch" --nnodes 1:2 --nproc-per-node 1 --rdzv-backend etcd --rdzv-endpoint "$eps" --rdzv-id again \
   --rdzv-conf heartbeat_timeout=3,last_call_timeout=20 -- "$worker" print > "$tmp/again_first.log" 2>&1) &
first=$!
pids+=("$first")
sleep 1
kill -9 "$(launcher_of again "$first")"
wait "$first" || true
out=$(timeout 60 "$launch" --nnodes 1:2 --nproc-per-node 1 --rdzv-backend etcd --rdzv-endpoint "$eps" --rdzv-id again \
      --rdzv-conf heartbeat_timeout=3,join_timeout=20,last_call_timeout=1 -- "$worker" print 2>&1) ||
  fail "the same job after a crash did not run: $out"
grep -q "out line" <<<"$out" || fail "again: no worker ran: $out"
nothing_left clash
nothing_left again

# An agent frozen, then woken after the job ended without it: exits 0.
# A longer run and a short heartbeat timeout: the job must outlive the freeze.
pids=()
GPT_EXTRA="--max-steps 500" agent a frozen --rdzv-conf heartbeat_timeout=3
sleep 0.3
GPT_EXTRA="--max-steps 500" agent b frozen --rdzv-conf heartbeat_timeout=3
full_round "$tmp/a.log" 4 > /dev/null
wait_lines "$tmp/frozen.jsonl" $(($(lines "$tmp/frozen.jsonl") + 5))
fb=$(launcher_of frozen "${pids[1]}")
kill -STOP "$fb"
wait "${pids[0]}" || true
grep -q "rc=0" "$tmp/a.log" || fail "frozen: agent a did not finish alone"
grep -q "heartbeat stopped" "$tmp/a.log" || fail "frozen: a did not see b's heartbeat stop"
kill -CONT "$fb"
wait "${pids[1]}" || true
grep -q "the job finished without this node" "$tmp/b.log" || fail "frozen: b was not told the job ended"
grep -q "rc=0" "$tmp/b.log" || fail "frozen: b did not exit 0"
echo "elastic etcd 4: an agent frozen and woken after the job ended at 2 ranks exits 0, told so"
mv "$tmp/a.log" "$tmp/frozen_a.log"
mv "$tmp/b.log" "$tmp/frozen_b.log"
nothing_left frozen

# A cluster that loses its quorum mid-job: both agents name it and stop.
pids=()
agent a quorum
sleep 0.3
agent b quorum
full_round "$tmp/a.log" 4 > /dev/null
wait_lines "$tmp/quorum.jsonl" $(($(lines "$tmp/quorum.jsonl") + 5))  # steps in the round at 4 ranks
t0=$(date +%s)
kill -9 "$(cat "$tmp/etcd/m1/pid")" "$(cat "$tmp/etcd/m2/pid")"
wait "${pids[@]}" || true
for n in a b; do
  grep -q "rc=1" "$tmp/$n.log" || fail "quorum: agent $n did not exit 1"
  grep -q "lost the rendezvous store at etcd .*lost its quorum" "$tmp/$n.log" || fail "quorum: $n did not name it"
done
[ $(($(date +%s) - t0)) -le 25 ] || fail "quorum: the agents took over 25 s to stop"
nothing_left quorum
# ...and an agent that starts against it: named within seconds, not at the
# end of the join timeout (600 s by default).
t1=$(date +%s)
out=$("$launch" --nnodes 1:1 --rdzv-backend etcd --rdzv-endpoint "$eps" --rdzv-id late -- "$worker" print 2>&1) &&
  fail "a job started without a quorum"
grep -q "lost its quorum" <<<"$out" || fail "no quorum at start: $out"
[ $(($(date +%s) - t1)) -le 40 ] || fail "no quorum at start: named after $(($(date +%s) - t1)) s"
echo "elastic etcd 4: 2 of 3 etcd members killed mid-job: both agents named the lost quorum and stopped in" \
  "$((t1 - t0)) s; a new agent named it in $(($(date +%s) - t1)) s"
echo "PASS"
