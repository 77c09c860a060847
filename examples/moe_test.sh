#!/bin/bash
# Mixture of experts in //examples:gpt (--moe-experts, --ep): a LLaMA of 4
# blocks, MoE in blocks 0 and 2 (4 experts, top 2, z-loss on), 6 steps.
#   - expert parallelism ep 2 folded over dp_shard 2, ep 2 over dp_shard 4
#     (the experts FSDP-sharded over the 2 ranks holding them), ep 2 x
#     dp_replicate 2 (HSDP; the experts' replicas averaged), ep 2 x tp 2
#     (sequence parallel) and pp 2 x ep 2 each equal one process step for step (the
#     same batches, losses within 1e-5, gradient norms within 1e-4; the
#     pipeline's reference accumulates the same 4 micro-batches) and end
#     with the same parameters (the consolidated checkpoints, rel 3e-5);
#   - pp 2 x ep 2 with MoE in the first stage only (the second all dense);
#   - ep 2 under full activation checkpointing equals one process too;
#   - a checkpoint chain ep 4 -> ep 2 -> one process continues as the
#     uninterrupted run (stacked expert weights resharded by their boxes);
#   - a capacity factor of E / k equals the dropless run; a factor of 1
#     drops choices (alone and with ep 2), the metrics saying how many;
#     float8 experts on padded groups track the float32 run;
#   - the --metrics lines carry the expert load and the balance loss;
#   - bad layouts are named errors.
set -euo pipefail
dir=examples
ckpt=tools/ckpt
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
source "$dir/gpt_checks.sh"  # like_reference, same_validation

# The final parameters of two checkpoints, consolidated, equal within 3e-5
# of each tensor's largest value: six AdamW steps turn the last bits that
# tensor parallelism's other summation order leaves in a gradient into
# 1.2e-5 of a dense weight's largest value on one CPU (1e-5 failed there);
# a layout that mixed up shards is off by whole values.
same_params() {  # CKPT CKPT
  "$ckpt" consolidate "$1" "$tmp/cons_a" > /dev/null
  "$ckpt" consolidate "$2" "$tmp/cons_b" > /dev/null
  python3 - "$tmp/cons_a/model.safetensors" "$tmp/cons_b/model.safetensors" <<'PY'
import json, struct, sys, array
def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    out = {}
    for k, v in head.items():
        if k == "__metadata__": continue
        assert v["dtype"] == "F32", (k, v["dtype"])
        a, b = v["data_offsets"]
        out[k] = (v["shape"], array.array("f", raw[8 + n + a:8 + n + b]))
    return out
x, y = load(sys.argv[1]), load(sys.argv[2])
assert x.keys() == y.keys(), (sorted(x.keys() ^ y.keys()))
for k in x:
    assert x[k][0] == y[k][0], (k, x[k][0], y[k][0])
    scale = max(max(abs(v) for v in x[k][1]), 1e-6)
    worst = max(abs(p - q) for p, q in zip(x[k][1], y[k][1]))
    assert worst <= 3e-5 * scale, (k, worst, scale)
assert any(".mlp.experts.w1" in k for k in x), "no stacked expert weights"
print("same parameters:", len(x), "tensors")
PY
  rm -rf "$tmp/cons_a" "$tmp/cons_b"
}

base=(--arch llama --dim 32 --heads 4 --seq 16 --layers 4 --moe-experts 4 --moe-top-k 2 --moe-z-coef 0.001
      --global-batch 8 --max-steps 6 --save-every 2 --sample-len 0 --eval-every 100 --lr 1e-3)
moe=("${base[@]}" --moe-every 2)
"$dir/gpt" --nproc 1 "${moe[@]}" --checkpoint-dir "$tmp/r1" --metrics "$tmp/r1.jsonl" > "$tmp/r1.log" 2>&1 ||
  { cat "$tmp/r1.log"; exit 1; }

# The metrics: 8 sequences x 16 tokens x top 2 over 4 experts = 64 per expert
# on average, every step; the balance loss near k = 2 (its uniform value).
python3 - "$tmp/r1.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert len(lines) == 6
for j in lines:
    assert j["expert_tokens_mean"] == 64.0, j
    assert j["expert_tokens_min"] <= 64.0 <= j["expert_tokens_max"], j
    assert 1.9 < j["moe_aux_loss"] < 2.5, j
print("expert load:", [(j["expert_tokens_min"], j["expert_tokens_max"]) for j in lines])
PY

# A capacity: factor 2 = E / k leaves every expert room for every choice
# (C = the tokens), so the run is the dropless one loss for loss (padded
# batched GEMMs instead of grouped ones); factor 1 drops choices, named in
# the metrics, with ep 2 too (even splits, each rank dropping its own).
"$dir/gpt" --nproc 1 "${moe[@]}" --moe-capacity-factor 2 --checkpoint-dir "$tmp/cf2" --metrics "$tmp/cf2.jsonl" \
  > "$tmp/cf2.log" 2>&1 || { cat "$tmp/cf2.log"; exit 1; }
"$dir/gpt" --nproc 2 --dp-shard 2 --ep 2 "${moe[@]}" --moe-capacity-factor 1 --checkpoint-dir "$tmp/cf1" \
  --metrics "$tmp/cf1.jsonl" > "$tmp/cf1.log" 2>&1 || { cat "$tmp/cf1.log"; exit 1; }
python3 - "$tmp/r1.jsonl" "$tmp/cf2.jsonl" "$tmp/cf1.jsonl" <<'PY'
import json, sys
r1, cf2, cf1 = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert len(r1) == len(cf2) == len(cf1) == 6
for a, b in zip(r1, cf2):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    assert b["moe_dropped_frac"] == 0.0, b
    assert "moe_dropped_frac" not in a, a
for j in cf1:
    assert 0.0 < j["moe_dropped_frac"] < 0.5, j
print("capacity 2 = dropless; capacity 1 dropped:", [round(j["moe_dropped_frac"], 3) for j in cf1])
PY

# Float8 experts (padded groups, expert by expert through float8_linear):
# the run at capacity 2 in float8 tracks the float32 one (within 5 %) and
# says which layers it converted.
"$dir/gpt" --nproc 1 "${moe[@]}" --moe-capacity-factor 2 --float8 1 --checkpoint-dir "$tmp/cf2f8" \
  --metrics "$tmp/cf2f8.jsonl" > "$tmp/cf2f8.log" 2>&1 || { cat "$tmp/cf2f8.log"; exit 1; }
grep -q "float8: .*, 2 MoE layers' experts on padded groups" "$tmp/cf2f8.log" ||
  { cat "$tmp/cf2f8.log"; echo "no float8 experts line"; exit 1; }
python3 - "$tmp/cf2.jsonl" "$tmp/cf2f8.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 0.05 * x["loss"], (x["loss"], y["loss"])
assert any(x["loss"] != y["loss"] for x, y in zip(a, b)), "float8 changed nothing"
print("float8 experts track float32:", [(round(x["loss"], 4), round(y["loss"], 4)) for x, y in zip(a, b)])
PY

out=$("$dir/gpt" --nproc 2 --dp-shard 2 --ep 2 "${moe[@]}" --checkpoint-dir "$tmp/e2" --metrics "$tmp/e2.jsonl" 2>&1) ||
  { echo "$out"; exit 1; }
grep -q "mesh dp_shard=2 ep=2$" <<<"$out" || { echo "$out"; echo "no ep mesh line"; exit 1; }
out=$("$dir/gpt" --nproc 4 --dp-shard 2 --tp 2 --ep 2 "${moe[@]}" --checkpoint-dir "$tmp/e2t2" \
      --metrics "$tmp/e2t2.jsonl" 2>&1) || { echo "$out"; exit 1; }
grep -q "mesh dp_shard=2 tp=2 ep=2$" <<<"$out" || { echo "$out"; echo "no ep x tp mesh line"; exit 1; }
# ep 2 under full activation checkpointing: the blocks' recompute runs the
# dispatch's exchanges again.
out=$("$dir/gpt" --nproc 2 --dp-shard 2 --ep 2 --ac full "${moe[@]}" --checkpoint-dir "$tmp/e2ac" \
      --metrics "$tmp/e2ac.jsonl" 2>&1) || { echo "$out"; exit 1; }
like_reference "$tmp/r1.jsonl" 0 "$tmp/e2ac.jsonl"
# ep 2 over dp_shard 4: FSDP shards each rank's experts over the 2 ranks
# holding the same ones (dp_shard_mod_ep).
out=$("$dir/gpt" --nproc 4 --dp-shard 4 --ep 2 "${moe[@]}" --checkpoint-dir "$tmp/e2d4" --metrics "$tmp/e2d4.jsonl" 2>&1) ||
  { echo "$out"; exit 1; }
# HSDP: ep 2 over dp_shard 2, replicated over dp_replicate 2 (the experts'
# gradients averaged over the replicas).
out=$("$dir/gpt" --nproc 4 --dp-replicate 2 --dp-shard 2 --ep 2 "${moe[@]}" --checkpoint-dir "$tmp/e2r2" \
      --metrics "$tmp/e2r2.jsonl" 2>&1) || { echo "$out"; exit 1; }
grep -q "mesh dp_replicate=2 dp_shard=2 ep=2$" <<<"$out" || { echo "$out"; echo "no HSDP x ep mesh line"; exit 1; }
like_reference "$tmp/r1.jsonl" 0 "$tmp/e2.jsonl" "$tmp/e2t2.jsonl" "$tmp/e2d4.jsonl" "$tmp/e2r2.jsonl"
same_params "$tmp/r1/step_6" "$tmp/e2/step_6"
same_params "$tmp/r1/step_6" "$tmp/e2t2/step_6"
same_params "$tmp/r1/step_6" "$tmp/e2d4/step_6"
same_params "$tmp/r1/step_6" "$tmp/e2r2/step_6"

# The pipeline's reference: one process accumulating the same 4 micro-batches.
"$dir/gpt" --nproc 1 "${moe[@]}" --microbatches 4 --checkpoint-dir "$tmp/p1" --metrics "$tmp/p1.jsonl" > "$tmp/p1.log" 2>&1 ||
  { cat "$tmp/p1.log"; exit 1; }
out=$("$dir/gpt" --nproc 4 --pp 2 --dp-shard 2 --ep 2 --microbatches 4 "${moe[@]}" --checkpoint-dir "$tmp/p2e2" \
      --metrics "$tmp/p2e2.jsonl" 2>&1) || { echo "$out"; exit 1; }
grep -q "mesh pp=2 dp_shard=2 ep=2$" <<<"$out" || { echo "$out"; echo "no pp x ep mesh line"; exit 1; }
like_reference "$tmp/p1.jsonl" 0 "$tmp/p2e2.jsonl"
same_params "$tmp/p1/step_6" "$tmp/p2e2/step_6"
# MoE in block 0 only: the second stage holds dense blocks alone.
sparse=("${base[@]}" --moe-every 4 --microbatches 4)
"$dir/gpt" --nproc 1 "${sparse[@]}" --checkpoint-dir "$tmp/s1" --metrics "$tmp/s1.jsonl" > /dev/null 2>&1
out=$("$dir/gpt" --nproc 4 --pp 2 --dp-shard 2 --ep 2 "${sparse[@]}" --checkpoint-dir "$tmp/s2" \
      --metrics "$tmp/s2.jsonl" 2>&1) || { echo "$out"; exit 1; }
like_reference "$tmp/s1.jsonl" 0 "$tmp/s2.jsonl"

# ep 4 -> ep 2 (over dp_shard 4) -> one process: each resumes the previous
# one's checkpoint.
"$dir/gpt" --nproc 4 --dp-shard 4 --ep 4 "${moe[@]}" --checkpoint-dir "$tmp/c4" --metrics "$tmp/c4.jsonl" > /dev/null 2>&1
mkdir -p "$tmp/c2" && cp -r "$tmp/c4/step_2" "$tmp/c2/"
# The middle run: ep 2 over dp_shard 4, its experts FSDP-sharded as well.
out=$("$dir/gpt" --nproc 4 --dp-shard 4 --ep 2 "${moe[@]}" --resume --checkpoint-dir "$tmp/c2" \
      --metrics "$tmp/c2.jsonl" 2>&1) || { echo "$out"; exit 1; }
grep -q "resumed from $tmp/c2/step_2" <<<"$out" || { echo "$out"; echo "no ep 4 -> 2 resume"; exit 1; }
mkdir -p "$tmp/c1" && cp -r "$tmp/c2/step_4" "$tmp/c1/"
out=$("$dir/gpt" --nproc 1 "${moe[@]}" --resume --checkpoint-dir "$tmp/c1" --metrics "$tmp/c1.jsonl" 2>&1) ||
  { echo "$out"; exit 1; }
grep -q "saved by 4 ranks (.*), loading on 1 rank" <<<"$out" || { echo "$out"; echo "no ep 2 -> 1 resume"; exit 1; }
like_reference "$tmp/r1.jsonl" 0 "$tmp/c4.jsonl"
like_reference "$tmp/r1.jsonl" 2 "$tmp/c2.jsonl"
like_reference "$tmp/r1.jsonl" 4 "$tmp/c1.jsonl"
same_params "$tmp/r1/step_6" "$tmp/c1/step_6"
# One stacked tensor per layer, each ep rank's file holding its expert.
inspect=$("$ckpt" inspect "$tmp/c4/step_2")
grep -q "^h.0.mlp.experts.w1  *\[4,256,32\] .* r0:\[0:1,0:256,0:32\] r1:\[1:2," <<<"$inspect" ||
  { grep experts <<<"$inspect"; echo "no stacked [E, ...] expert tensor"; exit 1; }

# Named errors, from the flags and from the layout.
expect_error() {  # MESSAGE ARGS...
  local msg=$1
  shift
  if out=$("$dir/gpt" "$@" --checkpoint-dir "$tmp/err" --overwrite 2>&1); then
    echo "expected an error: $*"
    exit 1
  fi
  grep -qF -- "$msg" <<<"$out" || { echo "$out"; echo "expected: $msg"; exit 1; }
}
expect_error "--ep 3 does not divide --moe-experts 4" --nproc 3 --ep 3 "${moe[@]}"
expect_error "--ep 2 splits experts; give --moe-experts" --nproc 2 --ep 2 --max-steps 1
expect_error "--moe-top-k 5 exceeds --moe-experts 4" "${moe[@]}" --moe-top-k 5
expect_error "--moe-capacity-factor goes with --moe-experts" --moe-capacity-factor 1 --max-steps 1
expect_error "--float8 1 with dropless --moe-experts" "${moe[@]}" --float8 1
expect_error "--ep 2 does not divide --moe-experts 3" --nproc 2 --dp-shard 2 --ep 2 --moe-experts 3 --max-steps 1
expect_error "activation checkpointing 'full' with ep=2 (dp_replicate=1 x dp_shard x cp = 4) is not built" \
  --nproc 4 --dp-shard 4 --ep 2 --ac full "${moe[@]}"
echo "moe_test: ok"
