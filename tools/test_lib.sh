#!/bin/bash
# Helpers the multi-process shell tests share (elastic_test, live_recovery_test,
# elastic_netns_test): sourced after the test sets test_logs (the directory
# whose *.log files a failure prints) and, optionally, test_tail (lines of each).

# A free TCP port on localhost.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Lines stamped with seconds since the epoch, for the recovery times.
stamp() { python3 -u -c 'import sys, time
for line in sys.stdin: sys.stdout.write("%.3f %s" % (time.time(), line)); sys.stdout.flush()'; }

# The failure, then the tail of every log.
fail() {
  echo "FAIL: $*"
  for f in "$test_logs"/*.log; do echo "== $f"; tail -"${test_tail:-30}" "$f"; done
  exit 1
}

# wait_for FILE PATTERN SECONDS: until the pattern is in the file, or fail.
wait_for() {
  for _ in $(seq 1 $(($3 * 10))); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  fail "no '$2' in $1 within $3 s"
}
