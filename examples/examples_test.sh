#!/bin/bash
# Short runs of the training examples on the real Fashion-MNIST files: each
# must finish and its loss must fall. Skips (passes with a message) when the
# dataset package is not installed.
set -euo pipefail
DATA=/usr/share/datasets/fashion-mnist
if [[ ! -f $DATA/train-images-idx3-ubyte.gz ]]; then
  echo "SKIP: $DATA not found (apt-get install dataset-fashion-mnist)"
  exit 0
fi
dir=examples
out=$("$dir/mlp_fashion" --steps 60 2>&1)
echo "$out"
read -r first last < <(echo "$out" | awk '/^first_loss/ {print $2, $4}')
awk -v f="$first" -v l="$last" 'BEGIN { if (!(l < 0.6 * f)) { print "mlp loss did not fall: " f " -> " l; exit 1 } }'
out=$("$dir/resnet_fashion" --steps 8 --width 8 --batch-size 32 2>&1)
echo "$out"
echo "$out" | grep -q "test accuracy"
out=$("$dir/custom_model" --steps 20 2>&1)
echo "$out"
echo "$out" | grep -q "test accuracy"
echo PASS
