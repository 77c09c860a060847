#!/bin/bash
# //tools:launch --max-restarts with //examples:gpt: rank 0 is killed
# (SIGKILL) right after step 4's checkpoint is committed; every worker
# starts again, resumes from step 4 by itself and the run ends as the
# uninterrupted one: the same 6 steps' batches, losses and gradient norms,
# the same validation loss. Without --max-restarts the kill ends the job.
# //examples:resnet_ddp resumes by itself after a restart too.
set -euo pipefail
gpt=$1
launch=$2
resnet=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
args=(--dim 32 --heads 4 --seq 16 --layers 2 --max-steps 6 --global-batch 8 --sample-len 0 --eval-every 100
      --save-every 2 --lr 1e-3)
"$launch" --nproc_per_node=2 --master_port=0 -- "$gpt" "${args[@]}" --checkpoint-dir "$tmp/ref" \
  --metrics "$tmp/ref.jsonl" > "$tmp/ref.log" 2>&1 || { cat "$tmp/ref.log"; exit 1; }
if EMBER_FAULT_CHECKPOINT=renamed:step_4 "$launch" --nproc_per_node=2 --master_port=0 -- "$gpt" "${args[@]}" \
     --checkpoint-dir "$tmp/once" > "$tmp/once.log" 2>&1; then
  cat "$tmp/once.log"; echo "the killed run succeeded without restarts"; exit 1
fi
grep -q "rank 0 (local rank 0, pid [0-9]*) was killed by signal 9" "$tmp/once.log" || { cat "$tmp/once.log"; exit 1; }
out=$(EMBER_FAULT_CHECKPOINT=renamed:step_4 "$launch" --nproc_per_node=2 --master_port=0 --max-restarts=1 -- "$gpt" \
      "${args[@]}" --checkpoint-dir "$tmp/run" --metrics "$tmp/run.jsonl" 2>&1) || { echo "$out"; exit 1; }
echo "$out"
grep -q "launch: restarting the workers (restart 1 of 1)" <<<"$out" || { echo "no restart line"; exit 1; }
grep -q "resumed from $tmp/run/step_4" <<<"$out" || { echo "no resume from step 4"; exit 1; }
python3 - "$tmp/ref.jsonl" "$tmp/run.jsonl" "$(grep 'step 6: validation loss' "$tmp/ref.log")" \
  "$(grep 'step 6: validation loss' <<<"$out")" <<'PY'
import json, sys
ref = [json.loads(l) for l in open(sys.argv[1])]
run = [json.loads(l) for l in open(sys.argv[2])]
steps = {r["step"]: r for r in run}  # the first start's steps, then the restart's from 5
assert sorted(steps) == [r["step"] for r in ref] == list(range(1, 7)), (sorted(steps), len(run))
for x in ref:
    y = steps[x["step"]]
    assert (x["batch_digest"], x["loss"], x["grad_norm"]) == (y["batch_digest"], y["loss"], y["grad_norm"]), (x, y)
assert sys.argv[3].split("validation loss")[1] == sys.argv[4].split("validation loss")[1], sys.argv[3:]
# One line per step; the restart's lines marked.
assert [(r["step"], r.get("restart", 0)) for r in run] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1)], run
print("restart: killed after step 4's checkpoint, restarted, resumed at step 4, ended as the uninterrupted run")
PY
# Killed in the middle of the first save (step 2's pieces written, nothing
# committed): the restart starts from step 0. --metrics holds one line per
# step, the restart's, marked (the killed attempt's steps 1-2 as redone),
# and the killed save's step_2.tmp-PID directory is removed by the next
# successful save (its owner is provably dead).
out=$(EMBER_FAULT_CHECKPOINT=sharded_rank_written:step_2 EMBER_FAULT_ONCE="$tmp/fired" "$launch" --nproc_per_node=2 \
      --master_port=0 --max-restarts=1 -- "$gpt" "${args[@]}" --checkpoint-dir "$tmp/early" \
      --metrics "$tmp/early.jsonl" 2>&1) || { echo "$out"; exit 1; }
grep -q "launch: restarting the workers (restart 1 of 1)" <<<"$out" || { echo "$out"; echo "no restart"; exit 1; }
[ -f "$tmp/fired" ] || { echo "the fault did not fire"; exit 1; }
left=$(cd "$tmp/early" && ls -d ./*.tmp-* 2>/dev/null || true)
[ -z "$left" ] || { echo "a killed save's directory was left behind: $left"; exit 1; }
python3 - "$tmp/ref.jsonl" "$tmp/early.jsonl" <<'PY'
import json, sys
ref = [json.loads(l) for l in open(sys.argv[1])]
run = [json.loads(l) for l in open(sys.argv[2])]
assert [r["step"] for r in run] == list(range(1, 7)), ("one line per step", [r["step"] for r in run])
assert all(r.get("restart") == 1 for r in run), run
assert [r["step"] for r in run if r.get("redone")] == [1, 2], run
for x, y in zip(ref, run):
    assert (x["batch_digest"], x["loss"]) == (y["batch_digest"], y["loss"]), (x, y)
print("restart before the first checkpoint: one line per step (steps 1-2 marked redone), the killed save's "
      "directory removed, the run as uninterrupted")
PY
# //examples:resnet_ddp likewise: killed after epoch 1's checkpoint, it
# comes back at epoch 1 and finishes epoch 2.
out=$(EMBER_FAULT_CHECKPOINT=renamed:1 "$launch" --nproc_per_node=2 --master_port=0 --max-restarts=1 -- "$resnet" \
      --data synthetic --epochs 2 --max-steps 2 --checkpoint-dir "$tmp/resnet" 2>&1) || { echo "$out"; exit 1; }
grep -q "launch: restarting the workers (restart 1 of 1)" <<<"$out" || { echo "$out"; exit 1; }
grep -q "resumed from $tmp/resnet/epoch_1" <<<"$out" || { echo "$out"; exit 1; }
grep -q "saved checkpoint $tmp/resnet/epoch_2" <<<"$out" || { echo "$out"; exit 1; }
