#!/bin/bash
# Checks the gpt example's shell tests share (sourced): a run's --metrics
# lines against a reference's (the same batches, losses within 1e-5 and
# gradient norms within 1e-4 relative), two runs' losses bit for bit, and
# two validation-loss lines within a relative tolerance.

like_reference() {  # REF FROM FILE...
  python3 - "$@" <<'PY'
import json, sys
ref = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
for f in sys.argv[3:]:
    got = [json.loads(l) for l in open(f)]
    assert len(got) == len(ref) > 0, (f, len(got), len(ref))
    for x, y in zip(ref, got):
        assert x["batch_digest"] == y["batch_digest"], (f, x, y)
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (f, x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * x["grad_norm"], (f, x, y)
PY
}
same_losses() {  # A B WHAT: the two runs' losses equal, step for step, bit for bit
  python3 - "$@" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
assert len(a) == len(b) > 0, (len(a), len(b))
for x, y in zip(a, b):
    assert x["loss"] == y["loss"], (sys.argv[3] + " changed a loss", x, y)
print(sys.argv[3] + ": the same losses", [round(y["loss"], 5) for y in b])
PY
}
same_validation() {  # LINE LINE TOL
  python3 - "$@" <<'PY'
import re, sys
v = [float(re.search(r"validation loss ([0-9.]+)", s).group(1)) for s in sys.argv[1:3]]
assert abs(v[0] - v[1]) <= float(sys.argv[3]) * v[0], v
print("validation losses", v[0], v[1])
PY
}
