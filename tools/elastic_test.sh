#!/bin/bash
# //tools:launch's elastic agents with //examples:gpt on one host: two agents
# of 2 workers each ("hosts" on localhost), --nnodes 1:2, meeting at one
# rendezvous endpoint.
#  1. A worker is SIGKILLed right after step 4's checkpoint: a new round at
#     4 ranks resumes it, and the run ends as the uninterrupted one (the same
#     steps, batches, losses, gradient norms and validation loss).
#  2. One whole agent is SIGKILLed (its workers die with it): the other goes
#     on alone at 2 ranks; started again, the agent is let in at the next
#     round and the job grows back to 4. Every step's global batch is the
#     uninterrupted run's (nothing skipped; a step is redone only after a
#     round change, from the last checkpoint), the validation loss is within
#     1e-3 of it, and the time from the kill to training again is reported.
#  Also //examples:resnet_ddp: a worker killed after epoch 1's checkpoint,
#     the next round resumes at epoch 1 and finishes.
#  3. Bad cases: MIN more nodes than ever come (named, nothing started); a
#     second job on the same rendezvous id (refused, the first unharmed);
#     restarts exhausted (the last failure named on every node); another
#     model's checkpoints in the directory (refused, then the mismatch named,
#     not a byte changed). No process is left behind.
set -euo pipefail
gpt=$1
launch=$2
worker=$3
resnet=$4
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  # ELASTIC_TEST_KEEP=DIR keeps the logs (docs/elastic.md's timeline comes from them).
  [ -n "${ELASTIC_TEST_KEEP:-}" ] && mkdir -p "$ELASTIC_TEST_KEEP" && cp "$tmp"/*.log "$tmp"/*.jsonl "$ELASTIC_TEST_KEEP"/
  rm -rf "$tmp"
}
trap cleanup EXIT
test_logs=$tmp test_tail=40
source "$(dirname "$0")/test_lib.sh"  # port, stamp, fail, wait_for, launcher_of, full_round, ...

# 120 steps: long enough that the scale scenario's lone round is still
# running when the restarted agent comes (a loaded CI machine included).
args=(--dim 48 --heads 4 --seq 32 --layers 2 --max-steps 120 --global-batch 8 --sample-len 0 --eval-every 1000
      --save-every 4 --lr 1e-3)
"$launch" --nproc_per_node=4 --master_port=0 -- "$gpt" "${args[@]}" --checkpoint-dir "$tmp/ref" \
  --metrics "$tmp/ref.jsonl" > "$tmp/ref.log" 2>&1 || fail "the uninterrupted run failed"

# agent NAME RDZV_PORT RUN [extra launcher flags...]: one agent of 2 workers, in the background.
# LAST_CALL (s, 1 unless set): how long a round waits for a node past the first; a case whose
# checks need round 0 at 4 ranks sets it long (a round of both nodes closes at once anyway),
# since the second agent can start past a 1 s last call on a loaded machine.
agent() {
  local name=$1 rport=$2 run=$3
  shift 3
  (set +e; "$launch" --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint 127.0.0.1:"$rport" --rdzv-id "$run" \
     --rdzv-conf "last_call_timeout=${LAST_CALL:-1},heartbeat_timeout=5" "$@" -- "$gpt" "${args[@]}" --checkpoint-dir "$tmp/$run" \
     --metrics "$tmp/$run.jsonl" 2>&1 | stamp > "$tmp/$name.log"; echo "rc=${PIPESTATUS[0]}" >> "$tmp/$name.log") &
  pids+=($!)
}

# ---- 1. a worker killed after step 4's checkpoint: a new round at 4 ranks ----
p1=$(port)
LAST_CALL=15 EMBER_FAULT_CHECKPOINT=renamed:step_4 agent a1 "$p1" kill_worker
sleep 0.3
LAST_CALL=15 agent b1 "$p1" kill_worker
wait "${pids[@]}" || true
for n in a1 b1; do grep -q "rc=0" "$tmp/$n.log" || fail "agent $n did not succeed"; done
grep -q "rendezvous round 1: world size 4" "$tmp/a1.log" || fail "no round 1 at 4 ranks"
grep -q "was killed by signal 9" "$tmp/a1.log" "$tmp/b1.log" || fail "no worker was killed"
grep -q "resumed from $tmp/kill_worker/step_4" "$tmp/a1.log" "$tmp/b1.log" || fail "no resume from step_4"
# One crash is one restart, though the other node's workers fail with it.
[ "$(cat "$tmp/a1.log" "$tmp/b1.log" | grep -c "after the failure (restart")" = 1 ] || fail "one crash, several restarts"
python3 - "$tmp/ref.jsonl" "$tmp/kill_worker.jsonl" "$tmp/ref.log" "$tmp/a1.log" "$tmp/b1.log" <<'PY' || fail "metrics differ"
import json, re, sys
ref = [json.loads(l) for l in open(sys.argv[1])]
run = {}
for l in open(sys.argv[2]):
    r = json.loads(l)
    run[r["step"]] = r  # the resumed round's record of a step wins
assert sorted(run) == [r["step"] for r in ref], (sorted(run), len(ref))
for x in ref:
    y = run[x["step"]]
    assert (x["batch_digest"], x["loss"], x["grad_norm"]) == (y["batch_digest"], y["loss"], y["grad_norm"]), (x, y)
val = lambda text: re.findall(r"validation loss ([0-9.]+)", text)[-1]
ref_val = val(open(sys.argv[3]).read())
got = val(open(sys.argv[4]).read() + open(sys.argv[5]).read())
assert ref_val == got, (ref_val, got)
print(f"elastic 1: a worker killed after step 4, round 1 at 4 ranks, {len(ref)} steps as uninterrupted, "
      f"validation {got}")
PY

# ---- 2. an agent killed (scale down to 2), then started again (back to 4) ----
pids=()
p2=$(port)
agent a2 "$p2" scale
sleep 0.3
agent b2 "$p2" scale
r=$(full_round "$tmp/a2.log" 4)
wait_for "$tmp/scale.jsonl" '"step":9,' 60
# The killed agent is the one not serving the rendezvous store; the other
# goes on.
names=(a2 b2)
s=$(serving_index "$tmp/a2.log" "$tmp/b2.log")
keep=${names[s]} kill=${names[1 - s]} keep_shell=${pids[s]} kill_shell=${pids[1 - s]}
victim=$(launcher_of scale "$kill_shell")
[ -n "$victim" ] || fail "no launcher process for agent $kill"
t_kill=$(date +%s.%N)
kill -9 "$victim"
echo "$t_kill killed agent $kill (SIGKILL to its launcher, pid $victim)" > "$tmp/kill.log"
wait_round "$r" 2 30 "$tmp/$keep.log"
agent b3 "$p2" scale
wait "$keep_shell" "${pids[2]}" || true
grep -q "rc=0" "$tmp/$keep.log" || fail "agent $keep did not succeed"
grep -q "rc=0" "$tmp/b3.log" || fail "agent b3 did not succeed"
rounds_after "$r" "$tmp/$keep.log" | awk '$2 == 2 { s = 1 } s && $2 == 4 { g = 1 } END { exit !g }' ||
  fail "the job did not grow back to 4"
python3 - "$tmp/ref.jsonl" "$tmp/scale.jsonl" "$tmp/ref.log" "$tmp/$keep.log" "$tmp/b3.log" "$t_kill" <<'PY' || fail "scale metrics"
import json, re, sys
ref = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
recs = [json.loads(l) for l in open(sys.argv[2])]
steps = sorted({r["step"] for r in recs})
assert steps == sorted(ref), ("steps", steps)
for r in recs:  # every record, redone steps too, saw the uninterrupted run's global batch
    assert r["batch_digest"] == ref[r["step"]]["batch_digest"], r
assert len(recs) == len(steps), "a step with two lines"  # --metrics keeps the run's line of a step redone
redone = sum(1 for r in recs if r.get("redone"))
assert redone <= 2 * 4, ("more steps redone than two save intervals", redone)
val = lambda text: float(re.findall(r"validation loss ([0-9.]+)", text)[-1])
a = open(sys.argv[4]).read()
got, want = val(a + open(sys.argv[5]).read()), val(open(sys.argv[3]).read())
assert abs(got - want) <= 1e-3 * want, (got, want)
rounds = re.findall(r"^([0-9.]+) launch: rendezvous round (\d+): world size (\d+)", a, re.M)
t_kill = float(sys.argv[6])
# Training again: the first step finished (metrics' wall clock) in the first
# round that started after the kill.
after = [float(t) for t, r, w in rounds if float(t) > t_kill]
resumed = sorted(r["time"] for r in recs if after and r["time"] > after[0])
recover = resumed[0] - t_kill if resumed else float("nan")
print(f"elastic 2: rounds {[(int(r), int(w)) for t, r, w in rounds]}; all {len(steps)} steps' global batches "
      f"as uninterrupted, {redone} redone after round changes; validation {got:.5f} vs {want:.5f}; "
      f"from the agent's kill to training again {recover:.1f} s")
assert recover <= 15, recover
PY

# ---- an agent frozen (SIGSTOP) past the heartbeat timeout, woken after the
# job finished without it: it exits 0 saying so, and the store it lost is
# named as the serving agent's, not "rank 0". The stop lands inside one of
# its store calls (the hardest case: the call's reply, then the store's
# loss, come after the wake-up): the serving agent is stopped first for
# 1.2 s, well under the heartbeat timeout (3 s: a loaded machine's late
# wake-ups must not make that stop look like a lost agent), so that the
# other's checks (every 0.5 s) block on it, and that one is stopped while
# they do ----
pids=()
pf=$(port)
for n in f1 f2; do
  (set +e; "$launch" --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint 127.0.0.1:"$pf" --rdzv-id frozen \
     --rdzv-conf last_call_timeout=1,heartbeat_timeout=3 -- "$gpt" "${args[@]}" --max-steps 300 \
     --checkpoint-dir "$tmp/frozen" --metrics "$tmp/frozen.jsonl" > "$tmp/$n.log" 2>&1; echo "rc=$?" >> "$tmp/$n.log") &
  pids+=($!)
  sleep 0.3
done
wait_for "$tmp/frozen.jsonl" '"step":10,' 60
server=$(serving_index "$tmp/f1.log" "$tmp/f2.log")
victim=$((1 - server))
spid=$(launcher_of frozen "${pids[$server]}")
vpid=$(launcher_of frozen "${pids[$victim]}")
[ -n "$spid" ] && [ -n "$vpid" ] || fail "frozen: no launchers of the two agents"
kill -STOP "$spid"
sleep 1.2
kill -STOP "$vpid"
kill -CONT "$spid"
wait "${pids[$server]}" || true
slog=$tmp/f$((server + 1)).log vlog=$tmp/f$((victim + 1)).log
grep -q "rc=0" "$slog" || fail "frozen: the serving agent did not finish alone"
kill -CONT "$vpid"
wait "${pids[$victim]}" || true
grep -q "rc=0" "$vlog" || fail "frozen: the woken agent did not exit 0"
grep -q "this agent was stopped for [0-9]* s .*the job finished or went on without this node" "$vlog" ||
  fail "frozen: the woken agent did not say why it ends"
grep -q "did the agent serving the rendezvous store on 127.0.0.1" "$vlog" || fail "frozen: the store not named"
! grep "^launch:" "$vlog" | grep -q "usually rank 0" || fail "frozen: the agent's store called rank 0's"
echo "elastic frozen: an agent stopped (inside a store call) past the heartbeat timeout and woken after the job ended exits 0, saying so"

# ---- //examples:resnet_ddp under the agents: a worker killed after epoch 1's
# checkpoint; the next round resumes at epoch 1 and finishes epoch 2 ----
pids=()
p5=$(port)
for n in r1 r2; do
  (set +e; EMBER_FAULT_CHECKPOINT=renamed:1 "$launch" --nnodes 1:2 --nproc-per-node 1 --max-restarts 1 \
     --rdzv-endpoint 127.0.0.1:"$p5" --rdzv-id resnet --rdzv-conf last_call_timeout=15 -- "$resnet" --data synthetic \
     --epochs 2 --max-steps 2 --checkpoint-dir "$tmp/resnet" > "$tmp/$n.log" 2>&1; echo "rc=$?" >> "$tmp/$n.log") &
  pids+=($!)
  sleep 0.2
done
wait "${pids[@]}" || true
for n in r1 r2; do grep -q "rc=0" "$tmp/$n.log" || fail "resnet agent $n"; done
grep -q "rendezvous round 1: world size 2" "$tmp/r1.log" || fail "resnet: no round 1"
grep -q "resumed from $tmp/resnet/epoch_1" "$tmp/r1.log" "$tmp/r2.log" || fail "resnet: no resume from epoch 1"
grep -q "saved checkpoint $tmp/resnet/epoch_2" "$tmp/r1.log" "$tmp/r2.log" || fail "resnet: epoch 2 not saved"
echo "elastic resnet_ddp: a worker killed after epoch 1's checkpoint, round 1 resumed at epoch 1, finished epoch 2"

# ---- 3. bad cases ----
for bad in "--nnodes 3:2 --rdzv-endpoint 127.0.0.1:1" "--nnodes 1:2" "--nnodes 2 --node_rank 0 --rdzv-endpoint 127.0.0.1:1" \
           "--nnodes 1:2 --rdzv-endpoint 127.0.0.1:1 --rdzv-conf bogus=1" "--nnodes 1:2 --rdzv-endpoint nowhere" \
           "--rdzv-id x" "--nnodes 1:2 --rdzv-endpoint 127.0.0.1:1 --master_port 5" "--live-recovery" \
           "--nnodes 1:2 --rdzv-endpoint 127.0.0.1:1 --live-recovery=1"; do
  # shellcheck disable=SC2086
  out=$("$launch" $bad -- "$worker" print 2>&1) && fail "launch $bad was accepted"
  grep -q "^launch: .*\(MAX is less than MIN\|need[s]* --rdzv_endpoint\|do[es]* not go with --rdzv_endpoint\|unknown key 'bogus'\|expected HOST:PORT\|takes no value\)" \
    <<<"$out" || fail "launch $bad: $out"
done
out=$("$launch" --nnodes 2:2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:"$(port)" --rdzv-id lonely \
      --rdzv-conf join_timeout=2 -- "$worker" print 2>&1) && fail "a round without enough nodes started"
grep -q "rendezvous round 0: 1 of at least 2 nodes joined within 2 s" <<<"$out" || fail "MIN: $out"
grep -q "out line" <<<"$out" && fail "a worker ran without its round"
p3=$(port)
("$launch" --nnodes 1:1 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:"$p3" --rdzv-id shared -- "$worker" sleep \
   "$tmp" > "$tmp/first.log" 2>&1) &
first=$!
pids+=("$first")
wait_for "$tmp/first.log" "rendezvous round 0: world size 1" 20
out=$("$launch" --nnodes 1:1 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:"$p3" --rdzv-id shared -- "$worker" print \
      2>&1) && fail "a second job joined another job's rendezvous"
grep -q "rendezvous id 'shared' at 127.0.0.1:$p3 belongs to another job" <<<"$out" || fail "reused id: $out"
kill -0 "$first" || fail "the first job died"
kill -TERM "$(launcher_of shared "$first")"
wait "$first" || true
p4=$(port)
for n in x y; do
  (set +e; "$launch" --nnodes 2:2 --nproc-per-node 1 --max-restarts 2 --rdzv-endpoint 127.0.0.1:"$p4" --rdzv-id broken \
     --rdzv-conf last_call_timeout=1 -- "$worker" fail 0 7 "$tmp" > "$tmp/broken_$n.log" 2>&1
   echo "rc=$?" >> "$tmp/broken_$n.log") &
  pids+=($!)
  sleep 0.2
done
wait "${pids[@]: -2}" || true
grep -q "giving up after 2 restarts" "$tmp"/broken_*.log || fail "no giving up"
grep -q "rc=7" "$tmp"/broken_*.log || fail "the failing node's status is not the worker's"
grep -q "the job gave up on another node: rank 0 (local rank 0, pid [0-9]*) exited with code 7" "$tmp"/broken_*.log ||
  fail "the other node does not name the failure"
[ "$(grep -c "rendezvous round [0-9]*: world size 2" "$tmp/broken_x.log")" = 3 ] || fail "not 3 rounds"
# Another model's checkpoints in --checkpoint-dir (the scale run's, at 48
# dims; this one has 32): round 0, a fresh start, refuses to write over them;
# the restart's resume names the mismatch; the restarts run out; not a byte
# of them changed.
before=$(cd "$tmp/scale" && find . -type f -exec md5sum {} + | sort)
other=(--dim 32 --heads 4 --seq 32 --layers 2 --max-steps 40 --global-batch 8 --sample-len 0 --save-every 4)
out=$("$launch" --nnodes 1:1 --nproc-per-node 2 --max-restarts 1 --rdzv-endpoint 127.0.0.1:"$(port)" --rdzv-id other \
      -- "$gpt" "${other[@]}" --checkpoint-dir "$tmp/scale" 2>&1) && fail "another model's checkpoints were taken"
grep -q "already holds checkpoints of a run (newest: $tmp/scale/step_120)" <<<"$out" || fail "no refusal: $out"
grep -q "is \[144\] float32 in the checkpoint, \[96\] float32 in the model" <<<"$out" || fail "no mismatch named: $out"
grep -q "giving up after 1 restart" <<<"$out" || fail "no giving up: $out"
[ "$before" = "$(cd "$tmp/scale" && find . -type f -exec md5sum {} + | sort)" ] || fail "the checkpoints changed"
sleep 0.5
left=$(pgrep -f "$tmp" || true)
[ -z "$left" ] || fail "processes left behind: $left"
echo "elastic 3: MIN never reached, a reused id, restarts exhausted, another model's checkpoints: named; nothing" \
  "written over, nothing left running"
