#!/bin/bash
# A refactoring's check that //examples:gpt is unchanged: runs two builds of
# it (before and after) on the same flags, one mesh per line of stdin, and
# compares every --metrics field but the timings (loss, grad_norm, lr,
# batch_digest, memory by part), the validation, memory, mesh, pipeline and
# sample lines, and the checkpoints' tensor files byte for byte.
#
#   tools/gpt_same_runs.sh /tmp/old/gpt bazel-bin/examples/gpt <<< $'--nproc 2\n--nproc 4 --dp-shard 2 --tp 2'
set -uo pipefail
old=$1 new=$2; shift 2
out=$(mktemp -d /tmp/gpt_same.XXXXXX)
common=(--dim 32 --seq 16 --batch-size 4 --max-steps 6 --eval-every 3 --sample-len 20 --data synthetic --overwrite)
i=0; fail=0
while IFS= read -r mesh; do
  [[ -z $mesh ]] && continue
  i=$((i+1))
  for w in old new; do
    bin=$old; [[ $w == new ]] && bin=$new
    $bin $mesh "${common[@]}" --checkpoint-dir $out/$w$i --metrics $out/$w$i.jsonl > $out/$w$i.log 2>&1 || { echo "FAIL run $w $i: $mesh"; tail -5 $out/$w$i.log; }
  done
  python3 - $out/old$i.jsonl $out/new$i.jsonl <<'PY' || fail=1
import json,sys
a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]
keys=[k for k in a[0] if k not in ("time","step_s","tokens_per_s")]
assert len(a)==len(b)==6, (len(a),len(b))
for x,y in zip(a,b):
    for k in keys: assert x[k]==y[k], (k,x[k],y[k])
PY
  strip() { grep -E "validation loss|^\[rank 0\]: [a-z ]*$|memory peak|memory plan|mesh |sample|pipeline stage|activation" "$1" | sed -E 's/[0-9]+(\.[0-9]+)? ms//g'; }
  if ! diff <(strip $out/old$i.log) <(strip $out/new$i.log) >/dev/null; then echo "log differs $i: $mesh"; diff <(strip $out/old$i.log) <(strip $out/new$i.log) | head -10; fail=1; fi
  for f in $(cd $out/old$i && find . -name '*.safetensors' | sort); do
    cmp -s $out/old$i/$f $out/new$i/$f || { echo "checkpoint $f differs $i: $mesh"; fail=1; }
  done
  n=$(cd $out/old$i && find . -name '*.safetensors' | wc -l)
  echo "mesh $i ($mesh): $n checkpoint files compared, metrics compared"
done
exit $fail
