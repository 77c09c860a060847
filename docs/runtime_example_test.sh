#!/bin/bash
# docs/distributed.md's program: two local workers; rank 0 prints the sum.
set -uo pipefail
out=$(MASTER_PORT=0 timeout 60 "$1" 2>&1) || { echo "FAIL: exit $?: $out"; exit 1; }
grep -q "sum of ranks: 1" <<<"$out" || { echo "FAIL: no 'sum of ranks: 1' in: $out"; exit 1; }
echo PASS
