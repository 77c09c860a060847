#!/bin/bash
# FSDP against HSDP across a slow link (the cost model's link check): two network namespaces
# ("hosts") joined by a veth pair shaped to RATE (tc tbf, a bucket of 1 ms at
# the rate), 2 //examples:gpt workers in each, 4 ranks. FULL_SHARD over all 4
# gathers every unit's parameters and reduce-scatters its gradients across
# the link; HYBRID_SHARD with --shard-size 2 shards within a host and sends
# only the replicas' allreduce of each shard across it. Prints each run's
# tokens/s (the mean of its steps after the second, from --metrics); ROUNDS
# interleaved rounds. Needs root (ip netns, tc); not part of CI.
# docs/scaling.md sets these beside //tools:plan's predictions for the same
# meshes and links (--inter-host-gbps with --comm-fit).
#
#   bazel build -c opt //examples:gpt //tools:launch
#   tools/hsdp_link_bench.sh bazel-bin/tools/launch bazel-bin/examples/gpt [ROUNDS] [RATE...]
set -uo pipefail
launch=$(realpath "$1") gpt=$(realpath "$2") rounds=${3:-3}
shift 3 2>/dev/null || shift $#
rates=("$@")
[ ${#rates[@]} -gt 0 ] || rates=(100mbit)

source "$(dirname "$0")/netns_pair.sh"
netns_bench_setup hsdp_link_bench ember_hsdp ember_hs ehs 79

steps=12
# run STRATEGY...: one job, 2 ranks per namespace; prints its tokens/s.
run() {
  local pids=()
  for node in 0 1; do
    local ns=$ns0 iface=$if0
    [ $node = 1 ] && ns=$ns1 iface=$if1
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$iface" EMBER_STORE_TOKEN=hsdp-bench \
      "$launch" --nnodes=2 --node_rank=$node --master_addr="$addr0" --master_port=29512 --nproc_per_node=2 -- \
      "$gpt" --layers 4 --dim 256 --heads 4 --seq 64 --global-batch 16 --max-steps $steps --eval-every 100000 \
      --sample-len 0 "$@" --checkpoint-dir "$work/ckpt" --overwrite --metrics "$work/m.jsonl" \
      >"$work/node$node.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  python3 -c 'import json,sys
r=[json.loads(l) for l in open(sys.argv[1])][2:]
print("%.0f" % (sum(x["tokens_per_s"] for x in r) / len(r)))' "$work/m.jsonl" 2>/dev/null || echo "failed: $(tail -3 "$work/node0.log")"
  rm -rf "$work"/ckpt "$work"/m.jsonl
}

for rate in "${rates[@]}"; do
  netns_shape "$rate" || { echo "cannot shape the link to $rate"; exit 1; }
  for round in $(seq "$rounds"); do
    echo "rate $rate round $round FSDP FULL_SHARD over 4: $(run --strategy full) tokens/s"
    echo "rate $rate round $round HSDP, shard 2 x replicate 2: $(run --strategy hybrid --shard-size 2) tokens/s"
  done
done
