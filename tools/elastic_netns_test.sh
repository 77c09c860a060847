#!/bin/bash
# The elastic agents across two network namespaces ("hosts") joined by a
# veth pair (tools/netns_pair.sh), //examples:gpt on 2 workers each,
# --nnodes 1:2, the rendezvous store served by host 0's agent:
#   the link to host 1 is cut mid-run (no RST: its peers just stop
#   answering): host 0's agent sees host 1's heartbeat stop, stops its own
#   workers at once (they sit in a collective whose timeout is 60 s) and goes
#   on alone at 2 ranks from the last checkpoint; host 1's agent loses the
#   store and exits naming it; nothing is left running there. The link comes
#   back, host 1's agent is started again and the job grows back to 4 ranks.
#   The run ends at --max-steps with every step's global batch the
#   uninterrupted run's, and the time from the cut to training again is
#   reported (heartbeat timeout 3 s + last call 1 s + the checkpoint load).
# Needs root (ip netns); elsewhere it says so and exits 0 (skipped).
#
#   tools/elastic_netns_test.sh bazel-bin/tools/launch bazel-bin/examples/gpt
set -uo pipefail
launch=$(realpath "$1") gpt=$(realpath "$2")

source "$(dirname "$0")/netns_pair.sh"
netns_require_root elastic_netns_test
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/ember_elastic_netns.XXXXXX")
cleanup() {
  netns_pair_cleanup
  [ -n "${ELASTIC_TEST_KEEP:-}" ] && mkdir -p "$ELASTIC_TEST_KEEP" && cp "$work"/*.log "$ELASTIC_TEST_KEEP"/
  rm -rf "$work"
}
trap cleanup EXIT
netns_pair ember_e eme 78 || { echo "elastic_netns_test: network setup failed"; exit 1; }
test_logs=$work test_tail=25
source "$(dirname "$0")/test_lib.sh"  # stamp, fail, wait_for

token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
args=(--dim 48 --heads 4 --seq 32 --layers 2 --max-steps 300 --global-batch 8 --sample-len 0 --eval-every 100000
      --save-every 10 --lr 1e-3 --checkpoint-dir "$work/ckpt" --metrics "$work/run.jsonl")
# agent HOST NAME: host 0 or 1's agent, in its namespace, in the background ($! its shell).
agent() {
  local host=$1 name=$2 ns iface addr
  if [ "$host" = 0 ]; then ns=$ns0 iface=$if0 addr=$addr0; else ns=$ns1 iface=$if1 addr=$addr1; fi
  (ip netns exec "$ns" env EMBER_STORE_TOKEN="$token" GLOO_SOCKET_IFNAME="$iface" EMBER_DIST_TIMEOUT_SEC=60 \
     "$launch" --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint "$addr0:29400" --rdzv-id netjob \
     --local-addr "$addr" --rdzv-conf last_call_timeout=1,heartbeat_timeout=3 -- "$gpt" "${args[@]}" 2>&1 |
     stamp > "$work/$name.log"
   echo "rc=${PIPESTATUS[0]}" >> "$work/$name.log") &
}

agent 0 host0; p0=$!
sleep 0.5
agent 1 host1; p1=$!
wait_for "$work/run.jsonl" '"step":25,' 120
# Both hosts in one round first (on a loaded machine host 1 may miss round
# 0's last call and join at round 1), then ten more steps.
wait_for "$work/host0.log" "world size 4" 60
n=$(wc -l < "$work/run.jsonl")
for _ in $(seq 1 600); do [ "$(wc -l < "$work/run.jsonl")" -ge $((n + 10)) ] && break; sleep 0.1; done
twos=$(grep -c "world size 2" "$work/host0.log" || true)
t_cut=$(date +%s.%N)
ip -n "$ns1" link set "$if1" down
wait_for "$work/host1.log" "rc=" 30
grep -q "rc=0" "$work/host1.log" && fail "host 1 exited 0 with its link cut"
grep -q "lost the rendezvous store at $addr0:29400" "$work/host1.log" || fail "host 1 does not name the lost store"
[ -z "$(ip netns pids "$ns1")" ] || fail "processes left in host 1's namespace: $(ip netns pids "$ns1")"
for _ in $(seq 1 300); do [ "$(grep -c "world size 2" "$work/host0.log")" -gt "$twos" ] && break; sleep 0.1; done
[ "$(grep -c "world size 2" "$work/host0.log")" -gt "$twos" ] || fail "host 0 started no round at 2 ranks after the cut"
grep -q "heartbeat stopped" "$work/host0.log" || fail "host 0 did not stop on the heartbeat"
ip -n "$ns1" link set "$if1" up
agent 1 host1b; p1b=$!
wait "$p0" "$p1b"
grep -q "rc=0" "$work/host0.log" || fail "host 0 did not finish"
grep -q "rc=0" "$work/host1b.log" || fail "host 1 (started again) did not finish"
[ "$(grep "rendezvous round [0-9]*: world size" "$work/host0.log" | tail -1 | grep -c "world size 4")" = 1 ] ||
  fail "the job did not grow back to 4"
python3 - "$work/run.jsonl" "$work/host0.log" "$t_cut" <<'PY' || fail "metrics"
import json, re, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
steps = sorted({r["step"] for r in recs})
assert steps == list(range(1, 301)), ("steps", steps[:3], steps[-3:], len(steps))
# The same step has the same global batch whichever round and world size ran it.
digest = {}
for r in recs:
    assert digest.setdefault(r["step"], r["batch_digest"]) == r["batch_digest"], r
log = open(sys.argv[2]).read()
rounds = re.findall(r"^([0-9.]+) launch: rendezvous round (\d+): world size (\d+)", log, re.M)
t_cut = float(sys.argv[3])
after = [float(t) for t, r, w in rounds if float(t) > t_cut]
resumed = sorted(r["time"] for r in recs if after and r["time"] > after[0])
stop = [(t, why) for t, why in re.findall(r"^([0-9.]+) launch: stopped the workers of round \d+: (.*)", log, re.M)
        if float(t) > t_cut]
print(f"elastic_netns: rounds {[(int(r), int(w)) for t, r, w in rounds]}; host 0 stopped its workers "
      f"{float(stop[0][0]) - t_cut:.1f} s after the cut ({stop[0][1]}); training again after "
      f"{resumed[0] - t_cut:.1f} s; {sum(1 for r in recs if r.get('redone'))} steps redone; all 300 steps' global batches agree")
assert resumed[0] - t_cut <= 15, resumed[0] - t_cut
PY
[ $? = 0 ] || exit 1
sleep 0.3
[ -z "$(ip netns pids "$ns0") $(ip netns pids "$ns1")" ] || [ "$(echo "$(ip netns pids "$ns0") $(ip netns pids "$ns1")" | xargs)" = "" ] ||
  fail "processes left running"
echo "elastic_netns_test: passed"
