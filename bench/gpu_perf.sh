#!/usr/bin/env bash
# gpu_perf.sh: the ResNet-50 GPU step, ours (bench/gpu_step.cc) beside
# PyTorch's (bench/resnet50_cuda_peer.py) on the same GPU, and where each
# spends its time. Writes gpu_resnet50.json and gpu_breakdown.json into the
# output folder (commit them as bench/results/).
#
#   bench/gpu_perf.sh [--smoke] [--rounds N] [--out DIR] [speed] [breakdown] [benchmark] [kernels]
#
# Parts (none named: speed and breakdown):
#   speed      N rounds (default 3), each ours then PyTorch, every process
#              running every configuration (fp32, tf32, bf16 x nchw, cl);
#              the JSON rows are the medians of the rounds' medians, with
#              their ranges, and ours / PyTorch. About 4 minutes on an H100.
#   breakdown  one profiled step per side for each configuration in
#              channels-last, ours under CUDA_LAUNCH_BLOCKING=1 (so an op's
#              host time is its GPU time), PyTorch through torch.profiler
#              (CUDA activity); plus the convolution algorithms ours chose
#              (EMBER_CUDNN_LOG=1), and PyTorch's kernel launches per step.
#              About 1.5 minutes.
#   benchmark  both steps in benchmark mode (EMBER_CUDNN_BENCHMARK=1,
#              cudnn.benchmark = True): measured algorithm choices.
#   kernels    bn_cuda_bench: batch norm at every ResNet-50 shape, ours
#              beside cuDNN's, in GB/s beside a device-to-device copy.
# On the GPU machine the binaries come from the gpu-bundle (.gpu/run.sh);
# --smoke runs the whole script here instead, under the CUDA emulation
# (bazel-bin/bench/gpu_step_emu, tiny shapes) and PyTorch on the CPU, so a
# script bug costs no GPU minute. COMMIT names the commit in the JSON
# (default: git rev-parse HEAD, where .git exists).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
smoke=0
rounds=3
out=${OUT:-/tmp/gpu_perf}
parts=()
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) smoke=1 ;;
    --rounds) rounds=$2; shift ;;
    --out) out=$2; shift ;;
    speed | breakdown | benchmark | kernels) parts+=("$1") ;;
    *) echo "gpu_perf: unknown argument '$1' (--smoke, --rounds N, --out DIR, speed, breakdown, benchmark, kernels)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#parts[@]} -gt 0 ] || parts=(speed breakdown)
case $rounds in '' | *[!0-9]* | 0) echo "gpu_perf: --rounds expects a positive integer, got '$rounds'" >&2; exit 2 ;; esac
mkdir -p "$out/logs"
raw="$out/raw.txt"
: >"$raw"

if [ $smoke = 1 ]; then
  ours=("$here/bazel-bin/bench/gpu_step_emu")
  [ -x "${ours[0]}" ] || { echo "gpu_perf --smoke: build //bench:gpu_step_emu first" >&2; exit 2; }
  py=${PYTHON:-/usr/bin/python3}
  shape=(--batch 2 --image 32 --warmup 1 --steps 2)
  peer_extra=(--device cpu)
  configs=fp32,bf16
else
  ours=(bash "$here/.gpu/run.sh" gpu_step)
  py=${PYTHON:-python3}
  shape=()
  peer_extra=()
  configs=fp32,tf32,bf16
fi
peer=("$py" "$here/bench/resnet50_cuda_peer.py")

# Each line of the programs' output goes to raw.txt tagged with the part and
# round; the summary reads raw.txt alone.
tag() { sed -u "s/^/part=$1 round=$2 /" | tee -a "$raw"; }
say() { echo "== $*" | tee -a "$out/logs/steps.txt"; }

{
  echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit=${COMMIT:-$(git -C "$here" rev-parse HEAD 2>/dev/null || echo unknown)}"
  if [ $smoke = 1 ]; then echo "device=CUDA emulation (smoke run, tiny shapes; not a measurement)"
  else nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/device=/'; fi
  "$py" -c 'import torch; print("torch=" + torch.__version__); print("cudnn=" + str(torch.backends.cudnn.version()))'
} >"$out/meta.txt" 2>&1
cat "$out/meta.txt"

for part in "${parts[@]}"; do
  case $part in
    speed)
      for r in $(seq 1 "$rounds"); do
        say "speed round $r: ours"
        "${ours[@]}" --configs $configs --layouts nchw,cl "${shape[@]}" 2>>"$out/logs/ours_speed.err" | tag speed "$r"
        say "speed round $r: torch"
        "${peer[@]}" --configs $configs --layouts nchw,cl "${shape[@]}" "${peer_extra[@]}" \
          2>>"$out/logs/torch_speed.err" | tag speed "$r"
      done
      ;;
    breakdown)
      say "breakdown: ours (CUDA_LAUNCH_BLOCKING=1, EMBER_CUDNN_LOG=1)"
      CUDA_LAUNCH_BLOCKING=1 EMBER_CUDNN_LOG=1 "${ours[@]}" --configs $configs --layouts cl --steps 2 \
        --profile-top 25 "${shape[@]}" 2>"$out/logs/ours_breakdown.err" | tag breakdown 1
      grep '^\[ember cudnn\]' "$out/logs/ours_breakdown.err" | sed 's/^/part=algos round=1 /' >>"$raw"
      say "breakdown: torch (torch.profiler)"
      "${peer[@]}" --configs $configs --layouts cl --steps 2 --profile-top 25 "${shape[@]}" "${peer_extra[@]}" \
        2>"$out/logs/torch_breakdown.err" | tag breakdown 1
      ;;
    benchmark)
      say "benchmark: ours with benchmark mode (EMBER_CUDNN_BENCHMARK=1)"
      EMBER_CUDNN_BENCHMARK=1 "${ours[@]}" --configs $configs --layouts nchw,cl "${shape[@]}" \
        2>>"$out/logs/ours_breakdown.err" | sed -u 's/^ours /ours_benchmark /' | tag breakdown 1
      say "benchmark: torch with cudnn.benchmark"
      "${peer[@]}" --configs $configs --layouts nchw,cl --benchmark "${shape[@]}" "${peer_extra[@]}" \
        2>>"$out/logs/torch_breakdown.err" | sed -u 's/^torch /torch_benchmark /' | tag breakdown 1
      ;;
    kernels)
      if [ $smoke = 1 ]; then
        say "kernels: skipped under --smoke (ops_cuda_bench needs a GPU)"
      else
        say "kernels: bn_cuda_bench (ours beside cuDNN) and the device-to-device copy"
        { bash "$here/.gpu/run.sh" ops_cuda_bench --benchmark_filter=MemcpyD2D 2>&1
          bash "$here/.gpu/run.sh" bn_cuda_bench --benchmark_min_time=0.2 2>&1; } | tee "$out/logs/bn_cuda_bench.txt" | grep '^BM_' |
          sed 's/^/part=kernels round=1 /' >>"$raw"
      fi
      ;;
  esac
done
"$py" "$here/bench/gpu_perf_summary.py" "$out"
