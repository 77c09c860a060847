#!/usr/bin/env bash
# gpu_check.sh: every CUDA test, GPU benchmark and GPU example run, in one call
# on the lent GPU machine (a lease is short and each call pays a start-up).
#
# Here, once per change:
#   tools/gpu_bundle.sh $(tools/gpu_check.sh --targets)
#   tools/gpu_check.sh --data        # Fashion-MNIST and fortunes into .gpudata/
# Then the device tool's run with carry [".gpu", ".gpudata"] and command
#   bash tools/gpu_check.sh [tests] [sanitize] [bench] [attention] [examples]   (none: all)
# (attention: the fused attention test and bench/attention_compare.py; bundle
# //core:ops_nn_cuda_test //bench:attention_cuda_bench for it.)
# It prints one line per step (rc, failed test names) and leaves every log in
# $OUT/logs.tgz. Steps keep going after a failure: one call shows everything.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)

TESTS="tensor_test ops_cuda_test ops_nn_cuda_test kernels_drawn_test kernels_drawn_nn_test optim_cuda_test
grad_scaler_test autocast_test loader_test safetensors_test process_group_test process_group_nccl_test
cuda_graph_test cuda_graph_step_test graphed_step_test gpt_graph_test ddp_graph_test float8_test linear_epilogue_test"
if [ "${1:-}" = "--targets" ]; then
  echo //core:tensor_test //core:ops_cuda_test //core:ops_nn_cuda_test //core:kernels_drawn_test \
    //core:kernels_drawn_nn_test //bench:numerics_cpu //optim:optim_cuda_test //bench:gpu_step \
    //optim:grad_scaler_test //nn:autocast_test //data:loader_test //core:safetensors_test \
    //distributed/comm:process_group_test //distributed/comm:process_group_nccl_test //bench:ops_cuda_bench \
    //bench:train_bench //bench:attention_cuda_bench //examples:resnet_ddp //examples:gpt_fsdp //tools:ckpt \
    //core:cuda_graph_test //optim:cuda_graph_step_test //optim:graphed_step_test \
    //distributed/parallel/recipes:gpt_graph_test //distributed/parallel:ddp_graph_test //core:float8_test \
    //core:linear_epilogue_test
  exit 0
fi
if [ "${1:-}" = "--data" ]; then
  mkdir -p "$here/.gpudata/fashion" "$here/.gpudata/fortunes"
  cp /usr/share/datasets/fashion-mnist/*.gz "$here/.gpudata/fashion/"
  cp -r /usr/share/games/fortunes/. "$here/.gpudata/fortunes/"
  grep -qx '/.gpudata/' "$here/.git/info/exclude" || echo '/.gpudata/' >>"$here/.git/info/exclude"
  du -sh "$here/.gpudata"
  exit 0
fi

steps="${*:-tests sanitize bench attention examples}"
logs=/tmp/gpu_check_logs
rm -rf "$logs" && mkdir -p "$logs"
run() { bash "$here/.gpu/run.sh" "$@"; }
summary() { echo "$*" | tee -a "$logs/summary.txt"; }
finish() {
  if [ -n "${OUT:-}" ]; then tar -C "$logs" -czf "$OUT/logs.tgz" . && cp "$logs/summary.txt" "$OUT/"; fi
}
trap finish EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$logs/gpu.txt"
run tensor_test --gtest_list_tests >/dev/null 2>&1 # unpack the bundle once, outside any timing

for s in $steps; do
  case $s in
  tests)
    for t in $TESTS; do
      timeout 180 bash "$here/.gpu/run.sh" "$t" >"$logs/$t.log" 2>&1
      rc=$?
      summary "$t rc=$rc $(grep -c '^\[       OK \]' "$logs/$t.log") ok $(grep -c '^\[  SKIPPED \]' "$logs/$t.log") skipped" \
        "$(grep '^\[  FAILED  \]' "$logs/$t.log" | sort -u | sed 's/\[  FAILED  \] //' | tr '\n' ' ')"
    done
    ;;
  sanitize)
    # memcheck catches out-of-bounds and misaligned device accesses the
    # emulator's bounds checks cannot see (real addresses, real warps).
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
    for t in ops_cuda_test ops_nn_cuda_test optim_cuda_test; do
      timeout 900 "$cs" --tool memcheck --error-exitcode 7 bash "$here/.gpu/run.sh" "$t" >"$logs/memcheck_$t.log" 2>&1
      summary "memcheck $t rc=$? $(grep -m1 'ERROR SUMMARY' "$logs/memcheck_$t.log")"
    done
    ;;
  bench)
    timeout 600 bash "$here/.gpu/run.sh" ops_cuda_bench --benchmark_format=console >"$logs/ops_cuda_bench.log" 2>&1
    summary "ops_cuda_bench rc=$?"
    timeout 300 bash "$here/.gpu/run.sh" train_bench --benchmark_filter=Cuda --benchmark_repetitions=3 \
      --benchmark_report_aggregates_only=true >"$logs/train_bench.log" 2>&1
    summary "train_bench (cuda) rc=$?"
    cat "$logs/ops_cuda_bench.log" "$logs/train_bench.log" | grep -E '^BM_' | grep -v -E '_(stddev|cv|mean) ' |
      tee -a "$logs/summary.txt"
    # PyTorch on the same GPU, the same step (the machine's python3 has torch);
    # bench/gpu_perf.sh is the full comparison (rounds, breakdown, kernels).
    timeout 300 python3 "$here/bench/resnet50_cuda_peer.py" --configs fp32,tf32 >"$logs/resnet50_peer.log" 2>&1
    summary "resnet50_cuda_peer rc=$?"
    grep '^torch' "$logs/resnet50_peer.log" | tee -a "$logs/summary.txt"
    # The numerical contract on the real cuDNN and cuBLAS (docs/design.md,
    # Note [numerics], has the emulation's figures; numerics_cpu runs the
    # CUDA rows whenever a GPU is present).
    timeout 300 bash "$here/.gpu/run.sh" numerics_cpu >"$logs/numerics.log" 2>&1
    summary "numerics rc=$?"
    grep -E '^\| (conv2d|matmul|attention)' "$logs/numerics.log" | grep CUDA | tee -a "$logs/summary.txt"
    ;;
  examples)
    d="$here/.gpudata"
    timeout 240 bash "$here/.gpu/run.sh" resnet_ddp --data "$d/fashion" --epochs 1 --checkpoint-dir /tmp/rn \
      >"$logs/resnet_ddp.log" 2>&1
    summary "resnet_ddp fp32 rc=$? $(grep -iE 'epoch|accuracy' "$logs/resnet_ddp.log" | tail -2 | tr '\n' ' ')"
    timeout 120 bash "$here/.gpu/run.sh" resnet_ddp --data "$d/fashion" --epochs 1 --max-steps 300 --amp bf16 --checkpoint-dir /tmp/rn16 \
      >"$logs/resnet_ddp_bf16.log" 2>&1
    summary "resnet_ddp bf16 rc=$? $(grep -iE 'epoch|accuracy' "$logs/resnet_ddp_bf16.log" | tail -2 | tr '\n' ' ')"
    timeout 120 bash "$here/.gpu/run.sh" resnet_ddp --data "$d/fashion" --epochs 1 --max-steps 300 --amp fp16 --checkpoint-dir /tmp/rnh \
      >"$logs/resnet_ddp_fp16.log" 2>&1
    summary "resnet_ddp fp16 rc=$? $(grep -iE 'epoch|accuracy' "$logs/resnet_ddp_fp16.log" | tail -2 | tr '\n' ' ')"
    timeout 180 bash "$here/.gpu/run.sh" gpt_fsdp --data "$d/fortunes" --checkpoint-dir /tmp/gpt >"$logs/gpt_fsdp.log" 2>&1
    summary "gpt_fsdp rc=$? $(grep -iE 'val|step' "$logs/gpt_fsdp.log" | tail -2 | tr '\n' ' ')"
    # Sharded checkpoints over NCCL: resume both examples from what they saved.
    timeout 120 bash "$here/.gpu/run.sh" gpt_fsdp --data "$d/fortunes" --checkpoint-dir /tmp/gpt --max-steps 1100 \
      --resume >"$logs/gpt_fsdp_resume.log" 2>&1
    summary "gpt_fsdp resume rc=$? $(grep -E 'resumed from|done in' "$logs/gpt_fsdp_resume.log" | tr '\n' ' ')"
    bash "$here/.gpu/run.sh" ckpt verify /tmp/gpt/step_1100 >"$logs/ckpt_verify.log" 2>&1
    summary "ckpt verify rc=$? $(cat "$logs/ckpt_verify.log")"
    timeout 120 bash "$here/.gpu/run.sh" resnet_ddp --data "$d/fashion" --epochs 2 --checkpoint-dir /tmp/rn \
      --resume >"$logs/resnet_ddp_resume.log" 2>&1
    summary "resnet_ddp resume rc=$? $(grep -E 'resumed from|epoch 2/2:' "$logs/resnet_ddp_resume.log" | tr '\n' ' ')"
    timeout 180 bash "$here/.gpu/run.sh" gpt_fsdp --data "$d/fortunes" --amp bf16 --checkpoint-dir /tmp/gpt16 \
      >"$logs/gpt_fsdp_bf16.log" 2>&1
    summary "gpt_fsdp bf16 rc=$? $(grep -iE 'val|step' "$logs/gpt_fsdp_bf16.log" | tail -2 | tr '\n' ' ')"
    timeout 120 bash "$here/.gpu/run.sh" resnet_ddp --nproc 1 --data "$d/fashion" --epochs 1 --max-steps 300 \
      --amp bf16 --cuda-graph 1 --checkpoint-dir /tmp/rng >"$logs/resnet_ddp_graph.log" 2>&1
    summary "resnet_ddp --cuda-graph 1 rc=$? $(grep -E 'cuda graph:|epoch 1/1' "$logs/resnet_ddp_graph.log" | tr '\n' ' ')"
    # The step as one CUDA graph beside the same run eager: the losses agree
    # up to the rounding of the learning rate (float32 on the device) and of
    # the norm's sums; the graph's line gives the host's share of a step.
    for g in 0 1; do
      timeout 180 bash "$here/.gpu/run.sh" gpt_fsdp --nproc 1 --data "$d/fortunes" --amp bf16 --max-steps 100 \
        --eval-every 1000 --sample-len 0 --cuda-graph $g --checkpoint-dir /tmp/gptg$g >"$logs/gpt_graph$g.log" 2>&1
      summary "gpt_fsdp --cuda-graph $g rc=$? $(grep -E 'cuda graph:|validation loss' "$logs/gpt_graph$g.log" | tail -2 | tr '\n' ' ')"
    done
    # The blocks' linears in float8 (cuBLASLt's float8 matmuls on the real
    # library): its validation loss beside the bf16 run's above.
    timeout 180 bash "$here/.gpu/run.sh" gpt_fsdp --nproc 1 --data "$d/fortunes" --amp bf16 --max-steps 100 \
      --eval-every 1000 --sample-len 0 --float8 1 --checkpoint-dir /tmp/gptf8 >"$logs/gpt_float8.log" 2>&1
    summary "gpt_fsdp --float8 1 rc=$? $(grep -E 'float8|validation loss' "$logs/gpt_float8.log" | tail -2 | tr '\n' ' ')"
    ;;
  attention)
    # The fused attention kernels on the real GPU: the CPU comparison, then
    # TFLOP/s beside PyTorch's SDPA flash backend (gpu_attention.json in $OUT).
    timeout 180 bash "$here/.gpu/run.sh" ops_nn_cuda_test --gtest_filter='*Attention*' >"$logs/attention_test.log" 2>&1
    summary "ops_nn_cuda_test attention rc=$? $(grep -c '^\[       OK \]' "$logs/attention_test.log") ok" \
      "$(grep '^\[  FAILED  \]' "$logs/attention_test.log" | sort -u | sed 's/\[  FAILED  \] //' | tr '\n' ' ')"
    timeout 420 python3 "$here/bench/attention_compare.py" --ours "bash $here/.gpu/run.sh attention_cuda_bench" \
      --rounds 3 --out "${OUT:-$logs}/gpu_attention.json" >"$logs/attention_compare.log" 2>&1
    summary "attention_compare rc=$?"
    grep -E '^(round|ours|\{)' "$logs/attention_compare.log" | tee -a "$logs/summary.txt"
    ;;
  *) summary "unknown step $s" ;;
  esac
done
