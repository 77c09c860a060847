#!/bin/bash
# //tools:plan as a user runs it: the issue's flags, the seeds' decision
# matrix in its "best:" line (LLaMA-70B on 64 GPUs: pp > 1 and each
# sequence split within a host, by tp or, since it is searched, by cp;
# ResNet-50 on 8: DDP), each mesh written dp_replicate=.. dp_shard=.. tp=..
# pp=.., the rejection reasons, a model given by its shape, and errors for
# bad flags.
set -euo pipefail
plan=$1
out=$("$plan" --model llama-70b --gpus 64 --gpus-per-host 8 --mem-per-gpu 80GiB --global-batch 64 --dtype bf16)
grep -qE "^best: dp_replicate=[0-9]+ dp_shard=[0-9]+ (tp=[2-8] pp=([2-9]|[1-9][0-9]+) |tp=[1-8] pp=([2-9]|[1-9][0-9]+) cp=[2-8] )" <<<"$out" ||
  { echo "$out"; exit 1; }
grep -q "does not fit in memory, e.g. dp_replicate=64 dp_shard=1 tp=1 pp=1 (DDP): needs" <<<"$out" || { echo "$out"; exit 1; }
grep -q "spans hosts" <<<"$out" || { echo "$out"; exit 1; }
out=$("$plan" --model resnet50 --gpus 8 --global-batch 256)
grep -q "^best: dp_replicate=8 dp_shard=1 tp=1 pp=1 (DDP)$" <<<"$out" || { echo "$out"; exit 1; }
# //examples:gpt's small model on 8 CPU ranks, float32.
out=$("$plan" --layers 4 --dim 32 --heads 4 --vocab 114 --seq 16 --tied --gpus 8 --mem-per-gpu 1GiB --global-batch 8 \
      --dtype fp32)
grep -q "^| 1 | dp_replicate=" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$plan" --model llama-70b --gpus 64 2>&1); then echo "accepted no --global-batch"; exit 1; fi
grep -q "global-batch is required" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$plan" --model llama-8t --gpus 8 --global-batch 8 2>&1); then echo "accepted llama-8t"; exit 1; fi
grep -q "unknown model 'llama-8t'" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$plan" --model gpt2 --gpus 8 --global-batch 8 --mem-per-gpu 80XB 2>&1); then echo "accepted 80XB"; exit 1; fi
grep -q "unknown unit 'XB'" <<<"$out" || { echo "$out"; exit 1; }
# --explain: the best mesh's terms, summing to its step, and the failure cost.
out=$("$plan" --model llama-70b --gpus 1024 --gpus-per-host 8 --mem-per-gpu 80GiB --global-batch 1024 --explain)
grep -q "^| compute | " <<<"$out" || { echo "$out"; exit 1; }
grep -q "^| step | " <<<"$out" || { echo "$out"; exit 1; }
grep -q "^reliability: checkpoint 828 GB " <<<"$out" || { echo "$out"; exit 1; }
# A given mesh with this machine's measurements (bench/results).
out=$("$plan" --layers 2 --dim 128 --heads 4 --vocab 114 --seq 64 --gpus 4 --global-batch 32 --dtype fp32 \
      --dp-shard 2 --tp 2 --step-allreduces 3 --compute-profile "$2" --comm-fit "$3")
grep -q "^dp_replicate=1 dp_shard=2 tp=2 pp=1 (FSDP + TP), 1 micro-batch(es) of 16" <<<"$out" || { echo "$out"; exit 1; }
grep -q "^| tp | allgather 512.0 KiB over 2 ranks x 15 | " <<<"$out" || { echo "$out"; exit 1; }
grep -qE "^predicted step: 0\.[0-9]+ s$" <<<"$out" || { echo "$out"; exit 1; }
# A given context-parallel mesh, with this machine's measurements: its
# all-gathers in the step, and what cp cannot split, named.
out=$("$plan" --layers 2 --dim 128 --heads 4 --vocab 114 --seq 1024 --gpus 4 --global-batch 2 --dtype fp32 \
      --dp-shard 1 --cp 4 --cp-exchange allgather --compute-profile "$2" --comm-fit "$3")
grep -q "^dp_replicate=1 dp_shard=1 tp=1 pp=1 cp=4 (CP allgather), 1 micro-batch(es) of 2" <<<"$out" ||
  { echo "$out"; exit 1; }
grep -q "^| cp | allgather 2.00 MiB over 4 ranks x 4 | " <<<"$out" || { echo "$out"; exit 1; }
if out=$("$plan" --layers 2 --dim 128 --heads 4 --vocab 114 --seq 100 --gpus 4 --global-batch 2 --cp 4 2>&1); then
  echo "$out"; echo "accepted seq 100 over cp 4"; exit 1; fi
grep -q "seq 100 does not cut into 2 x cp = 8 head-tail chunks" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$plan" --model gpt2 --gpus 4 --global-batch 8 --cp 4 --cp-exchange ulysses 2>&1); then
  echo "accepted --cp-exchange ulysses"; exit 1; fi
grep -q -- "--cp-exchange wants ring, allgather or alltoall, got 'ulysses'" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$plan" --model gpt2 --gpus 4 --global-batch 8 --tp 2 --strategy zero3 2>&1); then
  echo "accepted --strategy zero3"; exit 1; fi
grep -q "unknown strategy 'zero3'" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$plan" --model gpt2 --gpus 4 --global-batch 8 --compute-profile "$2" 2>&1); then
  echo "accepted --compute-profile alone"; exit 1; fi
grep -q "go together" <<<"$out" || { echo "$out"; exit 1; }
echo "plan: decision matrix rows and errors as expected"
