#!/usr/bin/env bash
# gpu_check.sh: every CUDA test, GPU benchmark and GPU example run, in one call
# on the lent GPU machine (a lease is short and each call pays a start-up).
#
# Here, once per change:
#   tools/gpu_bundle.sh $(tools/gpu_check.sh --targets)
#   tools/gpu_check.sh --data        # Fashion-MNIST and fortunes into .gpudata/
# Then the device tool's run with carry [".gpu", ".gpudata"] and command
#   bash tools/gpu_check.sh [--within SECONDS] [tests] [sanitize] [bench] [attention] [examples]   (none: all)
# (attention: the fused attention test and bench/attention_compare.py; bundle
# //core:attention_cuda_test //bench:attention_cuda_bench for it.)
# A lease of 15 device minutes does not hold all of them (the tests alone
# take minutes, memcheck up to 15). Its must-have figures come from two
# calls instead (docs/gpu.md, "A lease's figures"):
#   bash tools/gpu_check.sh figures          gates, then attention and the GPT beside PyTorch
#   bash tools/gpu_check.sh resnet_figures   ResNet-50 beside PyTorch, every configuration
# from a bundle of their binaries alone (--targets figures; --data figures),
# and, where the lease has time left after figures (about 2 minutes):
#   bash tools/gpu_check.sh attention_profile   ncu on our attention and PyTorch's
#   bash tools/gpu_check.sh gpt_breakdown       the GPT step's ops, ours beside PyTorch's
# It prints one line per step (rc, failed test names) and leaves every log in
# $OUT/logs.tgz. Steps keep going after a failure: one call shows everything.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)

# The tests: every one with CUDA paths, read off the BUILD files
# (tools/gpu_tests.py: the "cuda_emu" backend, or the "cuda" or "gpu" tag),
# here for the bundle and there for the runs (the tree travels, Bazel does not).
# --targets figures: what the figures and resnet_figures steps run, alone (a
# smaller bundle, built sooner, where a lease is for the figures).
if [ "${1:-}" = "--targets" ] && [ "${2:-}" = "figures" ]; then
  echo //core:attention_cuda_test //core:linear_epilogue_test //bench:attention_cuda_bench //bench:gpu_step \
    //examples:gpt_fsdp
  exit 0
fi
if [ "${1:-}" = "--targets" ]; then
  tests=$(python3 "$here/tools/gpu_tests.py") || exit 1
  echo $tests //bench:numerics_cpu //bench:gpu_step //bench:ops_cuda_bench //bench:train_bench \
    //bench:attention_cuda_bench //examples:resnet_ddp //examples:gpt_fsdp //tools:ckpt
  exit 0
fi
TESTS=$(python3 "$here/tools/gpu_tests.py" --names) || exit 1
# --data figures: fortunes alone (the GPT's corpus; ResNet-50's step runs on
# made-up batches), 3 MB of the 64 MiB a call carries instead of 33.
if [ "${1:-}" = "--data" ]; then
  rm -rf "$here/.gpudata"
  mkdir -p "$here/.gpudata/fortunes"
  if [ "${2:-}" != "figures" ]; then
    mkdir -p "$here/.gpudata/fashion"
    cp /usr/share/datasets/fashion-mnist/*.gz "$here/.gpudata/fashion/"
  fi
  cp -r /usr/share/games/fortunes/. "$here/.gpudata/fortunes/"
  "$here/tools/exclude_locally.sh" /.gpudata/
  du -sh "$here/.gpudata"
  exit 0
fi

# --within SECONDS (before the steps): every time limit below is cut to what
# is left of SECONDS, less 20 for the summaries and the logs' archive, so the
# call ends with its files written before the device tool's timeout_s (set
# it a little above) or the lease's last minutes: a cut benchmark part still
# writes the JSON of the rounds it finished, and a step with no time left
# says so (rc=124) rather than the call being killed with nothing back.
within=0
if [ "${1:-}" = "--within" ]; then
  case ${2:-} in '' | *[!0-9]*) echo "gpu_check: --within expects whole seconds, got '${2:-}'" >&2; exit 2 ;; esac
  within=$2
  shift 2
fi
limit() {
  local left=$((within - SECONDS - 20))
  if [ "$within" = 0 ]; then echo "$1"; elif [ "$left" -lt 1 ]; then echo 1; else echo $(($1 < left ? $1 : left)); fi
}
steps="${*:-tests sanitize bench attention examples}"
logs=/tmp/gpu_check_logs
rm -rf "$logs" && mkdir -p "$logs"
run() { bash "$here/.gpu/run.sh" "$@"; }
summary() { echo "$*" | tee -a "$logs/summary.txt"; }
finish() {
  if [ -n "${OUT:-}" ]; then tar -C "$logs" -czf "$OUT/logs.tgz" . && cp "$logs/summary.txt" "$OUT/"; fi
}
trap finish EXIT
# gtest LABEL SECONDS BINARY [ARGS]: one test binary, its log as LABEL.log,
# a summary line with its counts and the failed tests' names; "NONE RAN"
# where no test passed (a filter that matches nothing, a binary that
# skipped everything): a gate that checked nothing says so.
gtest() {
  local label=$1 secs=$2 log="$logs/$1.log"
  shift 2
  timeout "$(limit "$secs")" bash "$here/.gpu/run.sh" "$@" >"$log" 2>&1
  local rc=$? ok
  ok=$(grep -c '^\[       OK \]' "$log")
  summary "$label rc=$rc $ok ok $(grep -c '^\[  SKIPPED \]' "$log") skipped$([ "$ok" = 0 ] && echo ' NONE RAN')" \
    "$(grep '^\[  FAILED  \]' "$log" | sort -u | sed 's/\[  FAILED  \] //' | tr '\n' ' ')"
}
# compare_attention SECONDS [--lean]: bench/attention_compare.py, 3 rounds,
# gpu_attention.json into $OUT and its rows to the summary.
compare_attention() {
  timeout "$(limit "$1")" python3 "$here/bench/attention_compare.py" --ours "bash $here/.gpu/run.sh attention_cuda_bench" \
    --rounds 3 "${@:2}" --out "${OUT:-$logs}/gpu_attention.json" >"$logs/attention_compare.log" 2>&1
  summary "attention_compare ${*:2} rc=$?"
  grep -E '^(round|ours|\{)' "$logs/attention_compare.log" | tee -a "$logs/summary.txt"
}
# perf_part PART JSON SECONDS: bench/gpu_perf.sh --lean's PART, 3 interleaved
# rounds, within SECONDS; JSON (which it writes) goes to $OUT and its rows to
# the summary. Cut short, the rounds that finished still make the JSON (its
# rows say how many rounds they hold).
perf_part() {
  local dir=/tmp/gpu_check_perf_$1  # not gpu_perf.sh's own scratch (/tmp/gpu_perf_gpt)
  timeout "$(limit "$3")" bash "$here/bench/gpu_perf.sh" --lean --rounds 3 --out "$dir" "$1" >"$logs/gpu_perf_$1.log" 2>&1
  local rc=$?
  [ $rc = 124 ] && python3 "$here/bench/gpu_perf_summary.py" "$dir" >>"$logs/gpu_perf_$1.log" 2>&1
  summary "gpu_perf --lean $1 rc=$rc"
  cp "$dir/$2" "${OUT:-$logs}/" 2>/dev/null
  tar -C "$dir" -cf "$logs/gpu_perf_$1.tar" logs raw.txt meta.txt 2>/dev/null
  # A breakdown's rows are long: their top 8 ops a side (the JSON has 25).
  python3 -c 'import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if "ours_top_ops" in r:
        r = dict(r, **{k: [(o["name"], o["self_ms"]) for o in r[k][:8]] for k in ("ours_top_ops", "torch_top_ops")})
        r.pop("ours_idle_before", None)
    print(json.dumps(r))' "${OUT:-$logs}/$2" 2>&1 | tee -a "$logs/summary.txt"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$logs/gpu.txt"
[ -f "$here/.gpu/run.sh" ] || { echo "gpu_check: no bundle in $here/.gpu: tools/gpu_bundle.sh, then carry [\".gpu\"]"; exit 1; }
run --unpack || exit 1 # unpack the bundle once, outside any timing

for s in $steps; do
  case $s in
  tests)
    for t in $TESTS; do gtest "$t" 180 "$t"; done
    ;;
  sanitize)
    # memcheck catches out-of-bounds and misaligned device accesses the
    # emulator's bounds checks cannot see (real addresses, real warps).
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
    for t in ops_cuda_test ops_nn_cuda_test attention_cuda_test optim_cuda_test; do
      timeout "$(limit 900)" "$cs" --tool memcheck --error-exitcode 7 bash "$here/.gpu/run.sh" "$t" >"$logs/memcheck_$t.log" 2>&1
      summary "memcheck $t rc=$? $(grep -m1 'ERROR SUMMARY' "$logs/memcheck_$t.log")"
    done
    # racecheck: shared-memory hazards between a block's threads, which the
    # emulation's copies (done at once) and its ordered threads cannot show:
    # the fused attention's cp.async stages and their barriers.
    timeout "$(limit 900)" "$cs" --tool racecheck --racecheck-report hazard --error-exitcode 7 bash "$here/.gpu/run.sh" \
      attention_cuda_test --gtest_filter='*Flash*:-*RowOffsets*' >"$logs/racecheck_attention.log" 2>&1
    summary "racecheck attention_cuda_test rc=$? $(grep -m1 'RACECHECK SUMMARY\|ERROR SUMMARY' "$logs/racecheck_attention.log")"
    ;;
  bench)
    timeout "$(limit 600)" bash "$here/.gpu/run.sh" ops_cuda_bench --benchmark_format=console >"$logs/ops_cuda_bench.log" 2>&1
    summary "ops_cuda_bench rc=$?"
    timeout "$(limit 300)" bash "$here/.gpu/run.sh" train_bench --benchmark_filter=Cuda --benchmark_repetitions=3 \
      --benchmark_report_aggregates_only=true >"$logs/train_bench.log" 2>&1
    summary "train_bench (cuda) rc=$?"
    cat "$logs/ops_cuda_bench.log" "$logs/train_bench.log" | grep -E '^BM_' | grep -v -E '_(stddev|cv|mean) ' |
      tee -a "$logs/summary.txt"
    # PyTorch on the same GPU, the same step (the machine's python3 has torch);
    # bench/gpu_perf.sh is the full comparison (rounds, breakdown, kernels).
    timeout "$(limit 300)" python3 "$here/bench/resnet50_cuda_peer.py" --configs fp32,tf32 >"$logs/resnet50_peer.log" 2>&1
    summary "resnet50_cuda_peer rc=$?"
    grep '^torch' "$logs/resnet50_peer.log" | tee -a "$logs/summary.txt"
    # The numerical contract on the real cuDNN and cuBLAS (docs/design.md,
    # Note [numerics], has the emulation's figures; numerics_cpu runs the
    # CUDA rows whenever a GPU is present).
    timeout "$(limit 300)" bash "$here/.gpu/run.sh" numerics_cpu >"$logs/numerics.log" 2>&1
    summary "numerics rc=$?"
    grep -E '^\| (conv2d|matmul|attention)' "$logs/numerics.log" | grep CUDA | tee -a "$logs/summary.txt"
    ;;
  examples)
    d="$here/.gpudata"
    timeout "$(limit 240)" bash "$here/.gpu/run.sh" resnet_ddp --data "$d/fashion" --epochs 1 --checkpoint-dir /tmp/rn \
      >"$logs/resnet_ddp.log" 2>&1
    summary "resnet_ddp fp32 rc=$? $(grep -iE 'epoch|accuracy' "$logs/resnet_ddp.log" | tail -2 | tr '\n' ' ')"
    timeout "$(limit 120)" bash "$here/.gpu/run.sh" resnet_ddp --data "$d/fashion" --epochs 1 --max-steps 300 --amp bf16 --checkpoint-dir /tmp/rn16 \
      >"$logs/resnet_ddp_bf16.log" 2>&1
    summary "resnet_ddp bf16 rc=$? $(grep -iE 'epoch|accuracy' "$logs/resnet_ddp_bf16.log" | tail -2 | tr '\n' ' ')"
    timeout "$(limit 120)" bash "$here/.gpu/run.sh" resnet_ddp --data "$d/fashion" --epochs 1 --max-steps 300 --amp fp16 --checkpoint-dir /tmp/rnh \
      >"$logs/resnet_ddp_fp16.log" 2>&1
    summary "resnet_ddp fp16 rc=$? $(grep -iE 'epoch|accuracy' "$logs/resnet_ddp_fp16.log" | tail -2 | tr '\n' ' ')"
    timeout "$(limit 180)" bash "$here/.gpu/run.sh" gpt_fsdp --data "$d/fortunes" --checkpoint-dir /tmp/gpt >"$logs/gpt_fsdp.log" 2>&1
    summary "gpt_fsdp rc=$? $(grep -iE 'val|step' "$logs/gpt_fsdp.log" | tail -2 | tr '\n' ' ')"
    # Sharded checkpoints over NCCL: resume both examples from what they saved.
    timeout "$(limit 120)" bash "$here/.gpu/run.sh" gpt_fsdp --data "$d/fortunes" --checkpoint-dir /tmp/gpt --max-steps 1100 \
      --resume >"$logs/gpt_fsdp_resume.log" 2>&1
    summary "gpt_fsdp resume rc=$? $(grep -E 'resumed from|done in' "$logs/gpt_fsdp_resume.log" | tr '\n' ' ')"
    bash "$here/.gpu/run.sh" ckpt verify /tmp/gpt/step_1100 >"$logs/ckpt_verify.log" 2>&1
    summary "ckpt verify rc=$? $(cat "$logs/ckpt_verify.log")"
    timeout "$(limit 120)" bash "$here/.gpu/run.sh" resnet_ddp --data "$d/fashion" --epochs 2 --checkpoint-dir /tmp/rn \
      --resume >"$logs/resnet_ddp_resume.log" 2>&1
    summary "resnet_ddp resume rc=$? $(grep -E 'resumed from|epoch 2/2:' "$logs/resnet_ddp_resume.log" | tr '\n' ' ')"
    timeout "$(limit 180)" bash "$here/.gpu/run.sh" gpt_fsdp --data "$d/fortunes" --amp bf16 --checkpoint-dir /tmp/gpt16 \
      >"$logs/gpt_fsdp_bf16.log" 2>&1
    summary "gpt_fsdp bf16 rc=$? $(grep -iE 'val|step' "$logs/gpt_fsdp_bf16.log" | tail -2 | tr '\n' ' ')"
    timeout "$(limit 120)" bash "$here/.gpu/run.sh" resnet_ddp --nproc 1 --data "$d/fashion" --epochs 1 --max-steps 300 \
      --amp bf16 --cuda-graph 1 --checkpoint-dir /tmp/rng >"$logs/resnet_ddp_graph.log" 2>&1
    summary "resnet_ddp --cuda-graph 1 rc=$? $(grep -E 'cuda graph:|epoch 1/1' "$logs/resnet_ddp_graph.log" | tr '\n' ' ')"
    # The step as one CUDA graph beside the same run eager: the losses agree
    # up to the rounding of the learning rate (float32 on the device) and of
    # the norm's sums; the graph's line gives the host's share of a step.
    for g in 0 1; do
      timeout "$(limit 180)" bash "$here/.gpu/run.sh" gpt_fsdp --nproc 1 --data "$d/fortunes" --amp bf16 --max-steps 100 \
        --eval-every 1000 --sample-len 0 --cuda-graph $g --checkpoint-dir /tmp/gptg$g >"$logs/gpt_graph$g.log" 2>&1
      summary "gpt_fsdp --cuda-graph $g rc=$? $(grep -E 'cuda graph:|validation loss' "$logs/gpt_graph$g.log" | tail -2 | tr '\n' ' ')"
    done
    # The blocks' linears in float8 (cuBLASLt's float8 matmuls on the real
    # library): its validation loss beside the bf16 run's above.
    timeout "$(limit 180)" bash "$here/.gpu/run.sh" gpt_fsdp --nproc 1 --data "$d/fortunes" --amp bf16 --max-steps 100 \
      --eval-every 1000 --sample-len 0 --float8 1 --checkpoint-dir /tmp/gptf8 >"$logs/gpt_float8.log" 2>&1
    summary "gpt_fsdp --float8 1 rc=$? $(grep -E 'float8|validation loss' "$logs/gpt_float8.log" | tail -2 | tr '\n' ' ')"
    ;;
  attention)
    # The fused attention kernels on the real GPU: the CPU comparison, then
    # TFLOP/s beside PyTorch's SDPA flash backend (gpu_attention.json in $OUT).
    gtest attention_test 180 attention_cuda_test
    compare_attention 420
    ;;
  figures)
    # Gates first (a figure of a kernel that computes wrong values is no
    # figure): the fused attention's and the GEMM epilogues' tests. Then
    # the lean measurements, each with its own time limit so that one
    # running long leaves the others measured: attention beside SDPA's
    # flash backend (gpu_attention.json) and the GPT beside PyTorch's FSDP2
    # (gpu_gpt.json, 3 interleaved rounds each); their JSON files land in
    # $OUT beside logs.tgz. The limits add up to 565 s, inside a 600 s call
    # with the bundle's unpacking.
    gtest attention_test 75 attention_cuda_test
    gtest linear_epilogue_test 40 linear_epilogue_test
    grep '^\[epilogues\]' "$logs/linear_epilogue_test.log" | sort -u | head -5 | tee -a "$logs/summary.txt"
    compare_attention 150 --lean
    perf_part gpt gpu_gpt.json 300
    ;;
  attention_profile)
    # Where the fused attention's cycles go beside FlashAttention-2's (what
    # TFLOP/s alone cannot say): Nsight Compute on one forward + backward
    # step of ours and of PyTorch's SDPA flash backend, head dim 64 causal,
    # 128 causal and 128 (bench/attention_profile.py). The summary lines
    # hold issue slots, warps, stall reasons and tensor-pipe use side by
    # side; gpu_attention_profile.json (with the most stalled SASS) lands in
    # $OUT, ncu's CSV pages in logs.tgz.
    timeout "$(limit 240)" python3 "$here/bench/attention_profile.py" --ours "bash $here/.gpu/run.sh attention_cuda_bench" \
      --dir "$logs/attention_profile" --json "${OUT:-$logs}/gpu_attention_profile.json" \
      >"$logs/attention_profile.log" 2>&1
    summary "attention_profile rc=$?"
    grep -E '^(==|  [a-z])' "$logs/attention_profile.log" | tee -a "$logs/summary.txt"
    ;;
  gpt_breakdown)
    # Where the 352 M GPT's step goes, ours beside PyTorch's FSDP2 step,
    # float32 and bf16 (gpu_perf.sh gpt_breakdown): top ops by GPU self time
    # a step, our GPU's idle time; gpu_gpt_breakdown.json in $OUT.
    perf_part gpt_breakdown gpu_gpt_breakdown.json 240
    ;;
  resnet_figures)
    # ResNet-50's six configurations, ours eager beside PyTorch eager, 3
    # interleaved rounds (gpu_perf.sh --lean speed): gpu_resnet50.json in $OUT.
    perf_part speed gpu_resnet50.json 420
    ;;
  *) summary "unknown step $s" ;;
  esac
done
