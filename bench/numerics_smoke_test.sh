#!/usr/bin/env bash
# //bench:numerics_cpu --quick runs to the end and prints a row of every
# family with finite errors (a NaN or a missing family fails), so the tool
# that Note [numerics] quotes keeps working.
set -euo pipefail
out=$("$1" --quick)
echo "$out"
for family in "conv2d 3x3" "matmul" "sum (all)" "softmax" "attention causal" "layer_norm" "batch_norm (train)" \
  "AdamW step (fused)" "SGD Nesterov step (fused)" "ResNet-18 (width 16) SGD" "conv2d 3x3 forward + backward, time"; do
  grep -qF "| $family" <<<"$out" || { echo "numerics: no row for '$family'" >&2; exit 1; }
done
if grep -E '\| [^|]*(nan|inf)' <<<"$out" | grep -v "^| family"; then
  echo "numerics: a non-finite error above" >&2
  exit 1
fi
