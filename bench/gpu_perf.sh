#!/usr/bin/env bash
# gpu_perf.sh: the ResNet-50 GPU step, ours (bench/gpu_step.cc) beside
# PyTorch's (bench/resnet50_cuda_peer.py) on the same GPU, and where each
# spends its time. Writes gpu_resnet50.json and gpu_breakdown.json into the
# output folder (commit them as bench/results/).
#
#   bench/gpu_perf.sh [--smoke] [--lean] [--rounds N] [--out DIR] [speed] [breakdown] [benchmark] [kernels] [gpt]
#       [gpt_breakdown]
#
# Parts (none named: speed and breakdown):
#   speed      N rounds (default 3), each ours then PyTorch, every process
#              running every configuration (fp32, tf32, bf16 x nchw, cl);
#              the JSON rows are the medians of the rounds' medians, with
#              their ranges, and ours / PyTorch. About 4 minutes on an H100.
#   breakdown  one profiled step per side for each configuration in
#              channels-last, ours with the profiler's GPU time per op (a
#              CUDA event pair per op), PyTorch through torch.profiler
#              (CUDA activity); plus the convolution algorithms ours chose
#              (EMBER_CUDNN_LOG=1), and PyTorch's kernel launches per step.
#              About 1.5 minutes.
#   benchmark  both steps in benchmark mode (EMBER_CUDNN_BENCHMARK=1,
#              cudnn.benchmark = True): measured algorithm choices.
#   kernels    bn_cuda_bench: batch norm at every ResNet-50 shape, ours
#              beside cuDNN's, in GB/s beside a device-to-device copy.
#   gpt        //examples:gpt_fsdp on one GPU (FULL_SHARD over NCCL, AdamW,
#              clipping) beside PyTorch's FSDP2 on the same GPT
#              (bench/gpt_cuda_peer.py), float32 and bf16, N interleaved
#              rounds; tokens/s medians into gpu_gpt.json. Needs the
#              fortunes corpus in .gpudata/fortunes (tools/gpu_check.sh
#              --data). About 2 minutes.
#   gpt_breakdown  where the GPT step's time goes, per precision: ours
#              with --profile (3 steps after 3 warm-ups; the profiler's GPU
#              time per op from its ops-rank0.json, per step, and the GPU's
#              idle time before ops), PyTorch's through torch.profiler (one
#              step, bench/peer_profile.py); gpu_gpt_breakdown.json. About
#              1.5 minutes at 352 M.
# The speed part also replays our steps as one CUDA graph each (gpu_step
# --cuda-graph 1, rows <layout>_cudagraph, with the host's share of the
# step as ours_host_fraction), and runs them with EMBER_CUDNN_GRAPH flipped
# (layouts nchw_alt and cl_alt: cuDNN's graph API against its legacy API),
# so both ways of calling cuDNN are measured in the same rounds; the first
# round's choices of the flipped run are in logs/ours_speed_alt.err.
# --lean: only the rows a lease's must-have figures need, in about half the
# time: speed without the flipped cuDNN runs and the graph replays (ours
# eager beside PyTorch eager), gpt without the float8 variant.
# On the GPU machine the binaries come from the gpu-bundle (.gpu/run.sh);
# --smoke runs the whole script here instead, under the CUDA emulation
# (bazel-bin/bench/gpu_step_emu, tiny shapes) and PyTorch on the CPU, so a
# script bug costs no GPU minute. COMMIT names the commit in the JSON
# (default: the bundle's .gpu/COMMIT, which gpu_bundle.sh writes, else git
# rev-parse HEAD where .git exists).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
smoke=0
lean=0
rounds=3
out=${OUT:-/tmp/gpu_perf}
parts=()
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) smoke=1 ;;
    --lean) lean=1 ;;
    --rounds) rounds=$2; shift ;;
    --out) out=$2; shift ;;
    speed | breakdown | benchmark | kernels | gpt | gpt_breakdown) parts+=("$1") ;;
    *) echo "gpu_perf: unknown argument '$1' (--smoke, --lean, --rounds N, --out DIR, speed, breakdown, benchmark, kernels, gpt, gpt_breakdown)" >&2; exit 2 ;;
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
  gpt_ours=("$here/bazel-bin/examples/gpt")
  gpt_shape=(--layers 2 --dim 64 --heads 2 --seq 32 --batch-size 4)
  gpt_steps=8
  gpt_amps=off
  gpt_data=()
  gpt_py=${GPT_PYTHON:-$HOME/.venvs/torch2-peer/bin/python}  # FSDP2 needs torch 2
else
  ours=(bash "$here/.gpu/run.sh" gpu_step)
  py=${PYTHON:-python3}
  shape=()
  peer_extra=()
  configs=fp32,tf32,bf16
  gpt_ours=(bash "$here/.gpu/run.sh" gpt_fsdp)
  # GPT-2 blocks at 352 M parameters (12 x 28 x 1024^2 outside the small
  # character embeddings): the size the MFU and 1.1x targets are set for.
  gpt_shape=(${GPT_SHAPE:---layers 28 --dim 1024 --heads 16 --seq 1024 --batch-size 8})
  gpt_steps=25
  gpt_amps="off bf16"
  gpt_data=(--data "$here/.gpudata/fortunes")
  gpt_py=$py
fi
peer=("$py" "$here/bench/resnet50_cuda_peer.py")

# Each line of the programs' output goes to raw.txt tagged with the part and
# round; the summary reads raw.txt alone.
tag() { sed -u "s/^/part=$1 round=$2 /" | tee -a "$raw"; }
say() { echo "== $*" | tee -a "$out/logs/steps.txt"; }

{
  echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit=${COMMIT:-$(cat "$here/.gpu/COMMIT" 2>/dev/null || git -C "$here" rev-parse HEAD 2>/dev/null || echo unknown)}"
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
        if [ $lean = 0 ]; then
          # The other way of calling cuDNN (device.h's cudnn_graph_api):
          # flipped from whatever the default is, every configuration; its
          # rows are named <layout>_alt. The first round logs its choices.
          alt=0; [ "${EMBER_CUDNN_GRAPH:-1}" = 0 ] && alt=1  # the graph API is the default
          say "speed round $r: ours with EMBER_CUDNN_GRAPH=$alt"
          log=0; [ "$r" = 1 ] && log=1
          EMBER_CUDNN_GRAPH=$alt EMBER_CUDNN_LOG=$log "${ours[@]}" --configs $configs --layouts nchw,cl "${shape[@]}" \
            2>>"$out/logs/ours_speed_alt.err" | sed -u -E "s/layout=(nchw|cl) /layout=\1_alt graph=$alt /" |
            tag speed "$r"
          # The same steps captured once and replayed as one CUDA graph
          # (gpu_step --cuda-graph 1); rows named <layout>_cudagraph.
          say "speed round $r: ours replaying a CUDA graph"
          "${ours[@]}" --configs $configs --layouts nchw,cl --cuda-graph 1 "${shape[@]}" \
            2>>"$out/logs/ours_speed_graph.err" | sed -u -E "s/layout=(nchw|cl) /layout=\1_cudagraph /" |
            tag speed "$r"
        fi
        say "speed round $r: torch"
        "${peer[@]}" --configs $configs --layouts nchw,cl "${shape[@]}" "${peer_extra[@]}" \
          2>>"$out/logs/torch_speed.err" | tag speed "$r"
      done
      ;;
    breakdown)
      say "breakdown: ours (the profiler's GPU time per op, EMBER_CUDNN_LOG=1)"
      EMBER_CUDNN_LOG=1 "${ours[@]}" --configs $configs --layouts cl --steps 2 \
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
    gpt)
      # Ours reports tokens/s per step in --metrics; the median over the
      # steps after the first five is the round's figure, as the peer's.
      # bf16 also as one CUDA graph (--cuda-graph 1: amp bf16_cudagraph,
      # beside the same torch bf16 run), with the host's share of a step,
      # and with the blocks' linear layers in float8 (--float8 1: amp
      # bf16_float8, beside torch's bf16 eager step: the model is the same).
      # Each line carries the model's shape and parameter count for the MFU.
      for r in $(seq 1 "$rounds"); do
        for amp in $gpt_amps; do
          variants="plain"
          [ "$amp" = bf16 ] && variants="plain cudagraph float8"
          [ "$amp" = bf16 ] && [ $lean = 1 ] && variants="plain cudagraph"
          for v in $variants; do
          name=$amp g=0 f8=0
          case $v in
            cudagraph) name=${amp}_cudagraph g=1 ;;
            float8) name=${amp}_float8 f8=1 ;;
          esac
          say "gpt round $r amp $name: ours"
          rm -rf /tmp/gpu_perf_gpt && mkdir -p /tmp/gpu_perf_gpt
          "${gpt_ours[@]}" --nproc 1 "${gpt_shape[@]}" --max-steps $gpt_steps --eval-every 1000000 --sample-len 0 \
            --amp $amp --cuda-graph $g --float8 $f8 --checkpoint-dir /tmp/gpu_perf_gpt/ckpt --metrics /tmp/gpu_perf_gpt/m.jsonl \
            "${gpt_data[@]}" >"$out/logs/ours_gpt_$name.log" 2>&1
          vocab=$(sed -n 's/.*vocabulary \([0-9]*\).*/\1/p' "$out/logs/ours_gpt_$name.log" | head -1)
          "$py" - "$name" /tmp/gpu_perf_gpt/m.jsonl "$out/logs/ours_gpt_$name.log" "${gpt_shape[*]}" <<'PY' | tag gpt "$r"
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
rates = [r["tokens_per_s"] for r in rows if r["step"] > 5]
log = open(sys.argv[3]).read()
shape = dict(zip(sys.argv[4].split()[0::2], sys.argv[4].split()[1::2]))
params = re.search(r": (\d+) parameters, vocabulary (\d+)", log)
graph = re.search(r"cuda graph: .* host_ms=([\d.e+-]+) step_ms=([\d.e+-]+)", log)
extra = f" params={params.group(1)} vocab={params.group(2)}" if params else ""
extra += "".join(f" {k.strip('-')}={v}" for k, v in shape.items() if k in ("--layers", "--dim", "--seq"))
if graph:
    extra += f" host_fraction={float(graph.group(1)) / float(graph.group(2)):.4f}"
print(f"ours_gpt amp={sys.argv[1]} tokens_per_s={statistics.median(rates):.1f} steps={len(rates)} "
      f"mem_peak_mib={max(r['mem_peak_mib'] for r in rows):.1f}{extra}")
PY
          done
          say "gpt round $r amp $amp: torch (vocabulary ${vocab:-?})"
          "$gpt_py" "$here/bench/gpt_cuda_peer.py" "${gpt_shape[@]}" --vocab "${vocab:-96}" --steps $((gpt_steps - 5)) \
            --amp $amp "${peer_extra[@]}" 2>>"$out/logs/torch_gpt.err" | tag gpt "$r"
        done
      done
      ;;
    gpt_breakdown)
      for amp in $gpt_amps; do
        say "gpt_breakdown amp $amp: ours (--profile)"
        rm -rf /tmp/gpu_perf_gpt && mkdir -p /tmp/gpu_perf_gpt
        "${gpt_ours[@]}" --nproc 1 "${gpt_shape[@]}" --max-steps 6 --eval-every 1000000 --sample-len 0 --amp $amp \
          --checkpoint-dir /tmp/gpu_perf_gpt/ckpt --profile /tmp/gpu_perf_gpt/prof "${gpt_data[@]}" \
          >"$out/logs/ours_gpt_breakdown_$amp.log" 2>&1
        vocab=$(sed -n 's/.*vocabulary \([0-9]*\).*/\1/p' "$out/logs/ours_gpt_breakdown_$amp.log" | head -1)
        # Per step: the profiled steps are the ProfilerStep#N ranges. Ops
        # by GPU self time (host self time where the run had no GPU times:
        # --smoke); the ranges' own rows merge into one.
        "$py" - "$amp" /tmp/gpu_perf_gpt/prof/ops-rank0.json <<'PY' | tag gpt_breakdown 1
import json, sys
amp, doc = sys.argv[1], json.load(open(sys.argv[2]))
steps = sum(o["calls"] for o in doc["ops"] if o["name"].startswith("ProfilerStep#")) or 1
merged = {}
for o in doc["ops"]:
    name = "ProfilerStep#*" if o["name"].startswith("ProfilerStep#") else o["name"]
    m = merged.setdefault((name, o["kind"]), dict(o, name=name, calls=0, self_ms=0, total_ms=0, cuda_self_ms=0,
                                                  cuda_total_ms=0, cuda_gap_ms=0))
    for k in ("calls", "self_ms", "total_ms", "cuda_self_ms", "cuda_total_ms", "cuda_gap_ms"):
        m[k] += o[k]
gpu = doc["cuda"]
key, total = ("cuda_self_ms", "cuda_total_ms") if gpu else ("self_ms", "total_ms")
ops = sorted(merged.values(), key=lambda o: o[key], reverse=True)
for o in ops[:25]:
    print(f"ours_gpt_op amp={amp} calls={o['calls'] / steps:g} self_ms={o[key] / steps:.3f} "
          f"total_ms={o[total] / steps:.3f} host_self_ms={o['self_ms'] / steps:.3f} name={o['name']}")
if gpu:
    print(f"ours_gpt_idle amp={amp} idle_ms={sum(o['cuda_gap_ms'] for o in ops) / steps:.3f} steps={steps}")
    for o in sorted(ops, key=lambda o: o["cuda_gap_ms"], reverse=True)[:10]:
        if o["cuda_gap_ms"] > 0:
            print(f"ours_gpt_gap amp={amp} calls={o['calls'] / steps:g} gap_ms={o['cuda_gap_ms'] / steps:.3f} "
                  f"name={o['name']}")
PY
        say "gpt_breakdown amp $amp: torch (torch.profiler, vocabulary ${vocab:-?})"
        "$gpt_py" "$here/bench/gpt_cuda_peer.py" "${gpt_shape[@]}" --vocab "${vocab:-96}" --warmup 3 --steps 3 \
          --amp $amp --profile-top 25 "${peer_extra[@]}" 2>>"$out/logs/torch_gpt.err" | grep -v '^torch_gpt ' |
          tag gpt_breakdown 1
      done
      ;;
  esac
done
"$py" "$here/bench/gpu_perf_summary.py" "$out"
