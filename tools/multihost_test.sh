#!/bin/bash
# Several hosts for real: two network namespaces ("nodes") joined by a veth
# pair, each running the multi-node recipe of docs/ddp.md (extracted
# from it, between the multinode-recipe markers) with two ranks. Cases:
#   train     the job finishes on both nodes (exit 0);
#   cut-link  the link goes down mid-run: both nodes fail, naming the
#             timeout, within the timeout plus the launcher's grace;
#   kill-node node 1's processes are killed mid-run: node 0's ranks fail
#             within seconds, naming the lost ranks;
# and after each case nothing is left running in either namespace.
# Needs root (ip netns); elsewhere it says so and exits 0 (skipped).
#
#   tools/multihost_test.sh docs/ddp.md bazel-bin/tools/launch bazel-bin/examples/resnet_ddp
set -uo pipefail
readme=$1 launch=$(realpath "$2") resnet=$(realpath "$3")

source "$(dirname "$0")/netns_pair.sh"
netns_require_root multihost_test
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/ember_multihost.XXXXXX")
cleanup() {
  netns_pair_cleanup
  rm -rf "$work"
}
trap cleanup EXIT
netns_pair ember_n emb 77 || { echo "multihost_test: network setup failed"; exit 1; }

# The recipe, as docs/ddp.md gives it, with our binaries.
recipe=$(sed -n '/<!-- multinode-recipe/,/<!-- end multinode-recipe/p' "$readme" | sed '1,2d;$d' | sed '$d')
[ -n "$recipe" ] || { echo "multihost_test: no multinode-recipe block in $readme"; exit 1; }
recipe=${recipe//bazel-bin\/tools\/launch/$launch}
recipe=${recipe//bazel-bin\/examples\/resnet_ddp/$resnet}
echo "recipe run on each node:"
echo "$recipe"

failures=0
fail() { echo "FAIL [$case]: $*"; failures=$((failures + 1)); }

# start NODE_RANK NS IFACE: runs the recipe in the background; $! is its shell.
start() {
  local node=$1 ns=$2 iface=$3
  ip netns exec "$ns" env NODE_RANK="$node" MASTER_ADDR="$addr0" IFACE="$iface" TOKEN="$token" \
    CKPT="$work/$case/ckpt" TRAIN_FLAGS="$train_flags" EMBER_DIST_TIMEOUT_SEC="$timeout_s" \
    bash -c "$recipe" >"$work/$case/node$node.log" 2>&1 &
}

left_running() { echo "$(ip netns pids "$ns0") $(ip netns pids "$ns1")" | xargs; }

run_case() {
  case=$1
  mkdir -p "$work/$case"
  token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  start 0 "$ns0" "$if0"; p0=$!
  start 1 "$ns1" "$if1"; p1=$!
}

wait_both() {  # wait_both LIMIT_S: sets rc0 rc1 and took (seconds since $t_fault)
  local limit=$1
  local t_end=$(( $(date +%s%N) + limit * 1000000000 ))
  while kill -0 "$p0" 2>/dev/null || kill -0 "$p1" 2>/dev/null; do
    if [ "$(date +%s%N)" -gt "$t_end" ]; then fail "still running ${limit} s after the fault"; break; fi
    sleep 0.05
  done
  wait "$p0"; rc0=$?
  wait "$p1"; rc1=$?
  took=$(( ($(date +%s%N) - t_fault) / 1000000 ))
}

check_clean() {
  sleep 0.3
  local left; left=$(left_running)
  [ -z "$left" ] || { fail "processes left running: $left"; kill -9 $left 2>/dev/null; }
}

# ---- train: the recipe works ----
timeout_s=60
train_flags="--data synthetic --batch-size 8 --max-steps 4 --eval-size 32 --workers 0 --epochs 1"
run_case train
t_fault=$(date +%s%N)
wait_both 120
[ "$rc0" = 0 ] && [ "$rc1" = 0 ] || fail "exit codes $rc0/$rc1: $(tail -5 "$work/train/node0.log" "$work/train/node1.log")"
grep -q "epoch 1/1: train loss" "$work/train/node0.log" || fail "node 0 did not train: $(tail -5 "$work/train/node0.log")"
grep -q "4 rank(s) on the CPU" "$work/train/node0.log" || fail "not 4 ranks over 2 nodes"
check_clean
echo "train: exit $rc0/$rc1 in $((took / 1000)) s"

long_flags="--data synthetic --batch-size 8 --max-steps 400 --eval-size 32 --workers 0 --epochs 1"

# ---- cut-link: the nodes stop hearing each other mid-run ----
timeout_s=5
train_flags=$long_flags
run_case cut-link
sleep 4  # rendezvous done, training under way
grep -q "step" "$work/cut-link/node0.log" || echo "(cut-link: no progress line yet; cutting anyway)"
t_fault=$(date +%s%N)
ip -n "$ns1" link set "$if1" down
wait_both 40
[ "$rc0" != 0 ] && [ "$rc1" != 0 ] || fail "exit codes $rc0/$rc1 after the link was cut"
for n in 0 1; do
  grep -q "timed out\|did not reach\|no reply from the store" "$work/cut-link/node$n.log" ||
    fail "node $n names no timeout: $(tail -5 "$work/cut-link/node$n.log")"
done
check_clean
echo "cut-link: both nodes exited ($rc0/$rc1) $((took / 1000)).$(( (took % 1000) / 100 )) s after the cut (timeout ${timeout_s} s)"
ip -n "$ns1" link set "$if1" up

# ---- kill-node: node 1's processes die at once (the kernel closes their sockets) ----
timeout_s=60
train_flags=$long_flags
run_case kill-node
sleep 4
t_fault=$(date +%s%N)
kill -9 $(ip netns pids "$ns1") 2>/dev/null
wait_both 20
[ "$rc0" != 0 ] || fail "node 0 exited 0 after node 1 died"
grep -q "left the job without saying goodbye" "$work/kill-node/node0.log" ||
  fail "node 0 does not name the lost ranks: $(tail -8 "$work/kill-node/node0.log")"
[ "$took" -lt 10000 ] || fail "node 0 took $took ms to fail (timeout 60 s)"
check_clean
echo "kill-node: node 0 exited $rc0 $((took / 1000)).$(( (took % 1000) / 100 )) s after node 1 was killed (timeout ${timeout_s} s)"
grep -m1 "left the job" "$work/kill-node/node0.log"

if [ "$failures" -gt 0 ]; then
  for f in "$work"/*/node*.log; do echo "==== $f"; tail -20 "$f"; done
  echo "multihost_test: $failures failure(s)"
  exit 1
fi
echo "multihost_test: all cases passed"
