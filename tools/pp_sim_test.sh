#!/bin/bash
# //tools:pp_sim as a user runs it: the issue's closed forms in its
# "bubble fraction X" line (P = 4, M = 8: 3/11 for 1F1B, 3/19 interleaved
# with V = 2, 3/27 ZB-H1 with equal F, B, W), 1F1B's live micro-batches per
# stage, the timeline's rows, and errors for bad flags.
set -euo pipefail
sim=$1
out=$("$sim" --schedule 1f1b --stages 4 --microbatches 8)
grep -q "^bubble fraction 0.272727$" <<<"$out" || { echo "$out"; exit 1; }
grep -q "^peak live micro-batches per stage: 0:4 1:3 2:2 3:1$" <<<"$out" || { echo "$out"; exit 1; }
[[ $(grep -c "^rank [0-3] |" <<<"$out") == 4 ]] || { echo "$out"; exit 1; }
grep -q "^rank 0 | F0 F1 F2 F3 " <<<"$out" || { echo "$out"; exit 1; }
out=$("$sim" --schedule interleaved --stages 4 --virtual 2 --microbatches 8)
grep -q "^bubble fraction 0.157895$" <<<"$out" || { echo "$out"; exit 1; }
out=$("$sim" --schedule zb-h1 --stages 4 --microbatches 8 --tf 1 --tb 1 --tw 1)
grep -q "^bubble fraction 0.111111$" <<<"$out" || { echo "$out"; exit 1; }
out=$("$sim" --schedule gpipe --stages 4 --microbatches 8 --comm 0.5)
grep -q "^bubble fraction " <<<"$out" || { echo "$out"; exit 1; }
if out=$("$sim" --schedule interleaved --stages 4 --virtual 2 --microbatches 6 2>&1); then echo "accepted M=6"; exit 1; fi
grep -q "multiple of the pp size" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$sim" --schedule 1f1b --stages 0 --microbatches 8 2>&1); then echo "accepted --stages 0"; exit 1; fi
grep -q "stages wants a positive whole number" <<<"$out" || { echo "$out"; exit 1; }
echo "pp_sim: ok"
