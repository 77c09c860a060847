#!/bin/bash
# Helpers the multi-process shell tests share (elastic_test, elastic_etcd_test,
# live_recovery_test, elastic_netns_test) and the fault benchmarks
# (bench/live_recovery_soak.sh, bench/rdzv_recovery_bench.sh): sourced after
# the test sets test_logs (the directory whose *.log files a failure prints)
# and, optionally, test_tail (lines of each).

# A free TCP port on localhost.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Lines stamped with seconds since the epoch, for the recovery times.
stamp() { python3 -u -c 'import sys, time
for line in sys.stdin: sys.stdout.write("%.3f %s" % (time.time(), line)); sys.stdout.flush()'; }

# The failure, then the tail of every log: on stderr, so that a failure in a
# command substitution (x=$(wait_for ...)) is seen, not captured and lost.
fail() {
  {
    echo "FAIL: $*"
    for f in "$test_logs"/*.log; do echo "== $f"; tail -"${test_tail:-30}" "$f"; done
  } >&2
  exit 1
}

# wait_for FILE PATTERN SECONDS: until the pattern is in the file, or fail.
wait_for() {
  for _ in $(seq 1 $(($3 * 10))); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  fail "no '$2' in $1 within $3 s"
}

# rounds LOG...: "ROUND WORLD" for each rendezvous round the agents' logs name,
# once each, in order.
rounds() {
  cat "$@" 2>/dev/null | sed -n 's/.* rendezvous round \([0-9]*\): world size \([0-9]*\) .*/\1 \2/p' |
    sort -n -k1,1 -u
}
# full_round LOG WORLD: the number of the latest round in LOG at WORLD ranks,
# waiting for one (60 s). It is not always round 0: an agent started after the
# first one's last call (a loaded machine) joins in round 1. Faults are judged
# by the rounds after the one the job ran in when they came (rounds_after).
full_round() {
  wait_for "$1" "rendezvous round [0-9]*: world size $2 " 60
  rounds "$1" | awk -v w="$2" '$2 == w { n = $1 } END { print n }'
}
# rounds_after N LOG...: the rounds numbered above N, as rounds prints them.
rounds_after() {
  local n=$1
  shift
  rounds "$@" | awk -v n="$n" '$1 > n'
}
# wait_round N WORLD SECONDS LOG: until LOG names a round above N at WORLD ranks, or fail.
wait_round() {
  for _ in $(seq 1 $(($3 * 10))); do
    rounds_after "$1" "$4" | awk -v w="$2" '$2 == w { f = 1 } END { exit !f }' && return 0
    sleep 0.1
  done
  fail "no rendezvous round after round $1 at world size $2 in $4 within $3 s"
}

# Lines in FILE (0 while it does not exist).
lines() { [ -f "$1" ] && wc -l < "$1" || echo 0; }

# wait_lines FILE N: until FILE (a --metrics file) has N lines, or fail (60 s).
wait_lines() {
  for _ in $(seq 1 1200); do [ "$(lines "$1")" -ge "$2" ] && return 0; sleep 0.05; done
  fail "$1 never reached $2 lines"
}

# worker_of RANK CKPT_DIR: the pid of the worker of RANK in the job writing
# to CKPT_DIR (its environment says); nothing if there is none.
worker_of() {
  local p
  for p in $(pgrep -f -- "--checkpoint-dir $2( |$)" || true); do
    [ "$(ps -o comm= -p "$p" 2>/dev/null)" = launch ] && continue
    tr '\0' '\n' < /proc/"$p"/environ 2>/dev/null | grep -qx "RANK=$1" && { echo "$p"; return 0; }
  done
}

# serving_index LOG0 LOG1: which of two agents (0 or 1, by their logs)
# serves the rendezvous store: the first started, unless a loaded machine
# let the second bind the port first. A test that kills or stops "the other
# agent" must not pick the server: the job would end with it.
serving_index() { if grep -q "serving the rendezvous store" "$2"; then echo 1; else echo 0; fi; }

# launcher_of RUN SHELL_PID: the launcher process of the agent of rendezvous
# id RUN started in the background subshell SHELL_PID: that subshell itself
# (bash execs a lone command) or its child. (No pipeline into head: its
# early exit would fail the pipeline under pipefail.)
launcher_of() {
  local p
  for p in $(pgrep -f -- "--rdzv-id $1 " || true); do
    if [ "$(ps -o comm= -p "$p" 2>/dev/null)" = launch ] &&
       { [ "$p" = "$2" ] || [ "$(ps -o ppid= -p "$p" 2>/dev/null | tr -d ' ')" = "$2" ]; }; then
      echo "$p"
      return 0
    fi
  done
}
