#!/bin/bash
# //tools:ckpt from the shell on a real 2-rank FULL_SHARD checkpoint (made by
# sharded_checkpoint_test, kept with EMBER_SHARDED_TEST_DIR): inspect lists
# tensors and files (and, on a tensor-parallel checkpoint, each rank's box),
# verify passes, a flipped byte makes verify exit 1
# naming the file and the tensor, a missing index is exit 1, consolidate
# writes model.safetensors + optimizer.safetensors, a usage error is exit 2.
set -uo pipefail
ckpt=$1 maker=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

EMBER_SHARDED_TEST_DIR="$work" "$maker" --gtest_filter=ShardedCheckpoint.FullShardOnTwoRanksLoadsAnywhere \
  >"$work/maker.log" 2>&1 || { cat "$work/maker.log"; fail "making the checkpoint"; }
dir="$work/ckpt_0"
[ -f "$dir/index.json" ] || fail "no checkpoint at $dir"

out=$("$ckpt" inspect "$dir") || fail "inspect exited $?"
grep -q "version 2, saved by 2 rank(s), layout fsdp:full_shard" <<<"$out" || fail "inspect header: $out"
grep -q "rank-00001.safetensors" <<<"$out" || fail "inspect files: $out"
grep -qE "^l1\.fc\.weight +\[13,9\] +float" <<<"$out" || fail "inspect tensor line: $out"
grep -q "optim.state.l1.fc.weight.exp_avg" <<<"$out" || fail "inspect optimizer state: $out"

# Checkpoint v2's boxes: w [6,8] saved in 2-D boxes over a 2x2 mesh.
EMBER_SHARDED_TEST_DIR="$work" "$maker" --gtest_filter=ShardedCheckpoint.BoxShardedTensorsLoadInEveryLayout \
  >"$work/maker2.log" 2>&1 || { cat "$work/maker2.log"; fail "making the box checkpoint"; }
out=$("$ckpt" inspect "$work/boxes") || fail "inspect boxes exited $?"
grep -qE "^w +\[6,8\] +float.* 4: r0:\[0:3,0:4\] r1:\[0:3,4:8\] r2:\[3:6,0:4\] r3:\[3:6,4:8\]" <<<"$out" ||
  fail "inspect should show w's four boxes: $out"
grep -qE "^l1\.fc\.weight" <<<"$out" && fail "the box checkpoint is another directory"
out=$("$ckpt" inspect "$dir") || fail "inspect exited $?"
grep -qE "^l1\.fc\.weight .* r0:\[0:[0-9]+,0:9\]" <<<"$out" || fail "inspect should show FSDP's row runs: $out"

out=$("$ckpt" verify "$dir") || fail "verify of a good checkpoint exited $?: $out"
grep -q "^ok: " <<<"$out" || fail "verify output: $out"

"$ckpt" consolidate "$dir" "$work/flat" >/dev/null || fail "consolidate exited $?"
for f in model.safetensors optimizer.safetensors trainer.json; do
  [ -s "$work/flat/$f" ] || fail "consolidate wrote no $f"
done

# One byte flipped in the middle of rank 1's data section.
f="$dir/rank-00001.safetensors"
size=$(stat -c %s "$f")
pos=$((size - 20))
byte=$(od -An -tu1 -j "$pos" -N1 "$f" | tr -d ' ')
printf "$(printf '\\%03o' $(((byte + 1) % 256)))" | dd of="$f" bs=1 seek="$pos" conv=notrunc status=none
err=$("$ckpt" verify "$dir" 2>&1)
rc=$?
[ "$rc" = 1 ] || fail "verify of a corrupted checkpoint exited $rc: $err"
grep -q "rank-00001.safetensors: checksum mismatch in tensor '" <<<"$err" || fail "verify message: $err"

rm "$dir/index.json"
"$ckpt" verify "$dir" >/dev/null 2>&1
[ $? = 1 ] || fail "verify without an index should exit 1"
"$ckpt" frobnicate >/dev/null 2>&1
[ $? = 2 ] || fail "a usage error should exit 2"
echo PASS
