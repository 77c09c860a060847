#!/bin/bash
# Short runs of the training examples on the real Fashion-MNIST files: each
# must finish and its loss must fall. Skips those (passes with a message)
# when the dataset package is not installed. resnet_ddp runs first, on
# synthetic data: 2 workers, a few steps, a checkpoint, then --resume.
set -euo pipefail
dir=examples
ckpt="${TEST_TMPDIR:-$(mktemp -d)}/resnet_ddp_ckpt"
rm -rf "$ckpt"
ddp=("$dir/resnet_ddp" --nproc 2 --data synthetic --batch-size 16 --max-steps 4 --eval-size 200 --workers 0
     --checkpoint-dir "$ckpt")
out=$("${ddp[@]}" --epochs 1 2>&1)
echo "$out"
grep -q "epoch 1/1: train loss .*test accuracy" <<<"$out"
[[ -f $ckpt/epoch_1/model.safetensors ]] || { echo "resnet_ddp wrote no checkpoint in $ckpt"; exit 1; }
out=$("${ddp[@]}" --epochs 2 --resume 2>&1)
echo "$out"
grep -q "resumed from $ckpt/epoch_1: 1 epoch(s), 4 step(s) done" <<<"$out"
grep -q "epoch 2/2: train loss .*test accuracy" <<<"$out"
if out=$("$dir/resnet_ddp" --batch-size 0 2>&1); then echo "resnet_ddp accepted --batch-size 0"; exit 1; fi
grep -q "batch-size must be >= 1" <<<"$out"

DATA=/usr/share/datasets/fashion-mnist
if [[ ! -f $DATA/train-images-idx3-ubyte.gz ]]; then
  echo "SKIP: $DATA not found (apt-get install dataset-fashion-mnist)"
  exit 0
fi
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
