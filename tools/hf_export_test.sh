#!/bin/bash
# Hugging Face directories through the example and //tools:ckpt, without
# transformers (tools/hf_compare.py is the check against it): a LLaMA and a
# GPT-2 trained on meshes (FSDP; pp 2 x tp 2) and exported with `ckpt
# export-hf` give the logits of their checkpoints bit for bit; `gpt
# --init-from-hf` of an export trains on dp_shard 2 x tp 2 and on one
# process alike and starts where the export left off; and the named errors:
# a tp that does not divide the kv heads (both numbers), another
# vocabulary size (both numbers), a flag that disagrees with config.json,
# --seq past its positions, a config.json ember cannot represent, a
# checkpoint that recorded no model options, an OUT_DIR that is not empty.
set -uo pipefail
ckpt=$1 gpt=$2
work="${TEST_TMPDIR:-$(mktemp -d)}/hf_export"
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
expect_error() {  # expect_error "message" command...: exits non-zero, says message
  local want=$1 out
  shift
  if out=$("$@" 2>&1); then fail "succeeded: $* ($out)"; fi
  grep -qF -- "$want" <<<"$out" || fail "no '$want' in: $out"
}
common=(--data synthetic --seq 16 --global-batch 8 --sample-len 0 --eval-every 100)
llama=(--arch llama --kv-heads 2 --ffn 40 --dim 32 --heads 4 --layers 2)

# Train, export, and the export's logits are the checkpoint's.
"$gpt" "${common[@]}" "${llama[@]}" --nproc 2 --max-steps 3 --checkpoint-dir "$work/a" --metrics "$work/a.jsonl" \
  >"$work/a.log" 2>&1 ||
  { cat "$work/a.log"; fail "llama run"; }
"$gpt" "${common[@]}" --pp 2 --tp 2 --nproc 4 --dim 32 --heads 4 --layers 4 --max-steps 2 \
  --checkpoint-dir "$work/g" >"$work/g.log" 2>&1 || { cat "$work/g.log"; fail "gpt2 pp x tp run"; }
for run in a/step_3 g/step_2; do
  out=$("$ckpt" export-hf "$work/$run" "$work/hf-${run%%/*}") || fail "export-hf $run: $out"
  echo "$out"
  for f in config.json model.safetensors; do [[ -f $work/hf-${run%%/*}/$f ]] || fail "export of $run has no $f"; done
  "$ckpt" logits "$work/$run" 1,5,2,7/3,3,0,9 "$work/l1" >/dev/null || fail "logits of $run"
  "$ckpt" logits "$work/hf-${run%%/*}" 1,5,2,7/3,3,0,9 "$work/l2" >/dev/null || fail "logits of its export"
  cmp -s "$work/l1" "$work/l2" || fail "the export of $run gives other logits than the checkpoint"
done
grep -q '"model_type": "llama"' "$work/hf-a/config.json" || fail "llama config: $(cat "$work/hf-a/config.json")"
grep -q '"num_key_value_heads": 2' "$work/hf-a/config.json" || fail "kv heads in config.json"
grep -q '"model_type": "gpt2"' "$work/hf-g/config.json" || fail "gpt2 config: $(cat "$work/hf-g/config.json")"

# --init-from-hf the LLaMA export: 2 steps on dp_shard 2 x tp 2 and on one
# process give the same losses; on step 0's batch (every run's first is the
# same) the loss is the trained model's, below the random init's.
"$gpt" "${common[@]}" --init-from-hf "$work/hf-a" --nproc 4 --dp-shard 2 --tp 2 --max-steps 2 \
  --checkpoint-dir "$work/b4" --metrics "$work/b4.jsonl" >"$work/b4.log" 2>&1 || { cat "$work/b4.log"; fail "init 4"; }
grep -q "initialised from $work/hf-a (llama, " "$work/b4.log" || fail "no 'initialised from' line: $(cat "$work/b4.log")"
"$gpt" "${common[@]}" --init-from-hf "$work/hf-a" --nproc 1 --max-steps 2 \
  --checkpoint-dir "$work/b1" --metrics "$work/b1.jsonl" >"$work/b1.log" 2>&1 || { cat "$work/b1.log"; fail "init 1"; }
python3 - "$work/b1.jsonl" "$work/b4.jsonl" "$work/a.jsonl" <<'PY' || fail "--init-from-hf runs disagree"
import json, sys
one, four, fresh = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:4])
print("losses: one process", one, "dp_shard 2 x tp 2", four, "; the exported run's from its random init", fresh)
assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(one, four)), "one process and the mesh differ"
assert one[0] < fresh[0] - 0.05, "step 0's batch: the loaded model is no better than a random one"
PY

# The named errors, each before anything trains.
expect_error "--tp 4 does not divide the 2 key/value heads of --init-from-hf $work/hf-a: config.json" \
  "$gpt" "${common[@]}" --init-from-hf "$work/hf-a" --nproc 4 --tp 4
expect_error "the model's 2 key/value heads (config.json) do not split over --tp 4" \
  "$gpt" "${common[@]}" --init-from-hf "$work/hf-a" --nproc 4 --dp-shard 1 --tp -1 --checkpoint-dir "$work/x1"
printf 'abcdefghijklmnopqrstuvwxy\n%%\nabc\n' >"$work/text25"
expect_error "config.json's vocab_size 24 and the run's vocabulary of 26 tokens" \
  "$gpt" --data "$work/text25" --seq 2 --init-from-hf "$work/hf-a" --nproc 1 --checkpoint-dir "$work/x2"
expect_error "--dim 64 disagrees with --init-from-hf $work/hf-a: config.json's hidden_size 32 (leave --dim out)" \
  "$gpt" "${common[@]}" --init-from-hf "$work/hf-a" --dim 64
expect_error "--seq 32 is longer than --init-from-hf $work/hf-a: config.json's max_position_embeddings 16" \
  "$gpt" --data synthetic --seq 32 --init-from-hf "$work/hf-a"
cp -r "$work/hf-a" "$work/hf-rope"
sed -i 's/"rope_scaling": null/"rope_scaling": {"rope_type": "linear", "factor": 2.0}/' "$work/hf-rope/config.json"
expect_error "$work/hf-rope/config.json: rope_scaling rope_type 'linear' is not supported" \
  "$gpt" "${common[@]}" --init-from-hf "$work/hf-rope"
cp -r "$work/a/step_3" "$work/old"
python3 -c "
import json, sys; p = sys.argv[1]; j = json.load(open(p)); del j['extra']['model']; json.dump(j, open(p, 'w'))" \
  "$work/old/trainer.json"
expect_error "trainer.json: the run recorded no model options" "$ckpt" export-hf "$work/old" "$work/x3"
[[ ! -e $work/x3 ]] || fail "a failed export left $work/x3"
expect_error "exists and is not an empty directory" "$ckpt" export-hf "$work/a/step_3" "$work/hf-a"
echo "PASS"
