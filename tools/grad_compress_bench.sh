#!/bin/bash
# What DDP's gradient compression (resnet_ddp --grad-compress) buys when the
# allreduce crosses a link slower than loopback: two network namespaces
# ("hosts") joined by a veth pair whose egress is shaped to RATE (tc tbf,
# a bucket of 1 ms at the rate, a queue of up to 2 s so packets wait rather
# than drop; SHAPE="qdisc and arguments" replaces it, RATE standing for the
# rate: SHAPE="netem limit 100000 delay 1ms rate RATE" adds latency where the
# kernel has netem, which this machine's does not: CONFIG_NET_SCH_NETEM),
# one rank on each, synthetic data; every mode in turn, ROUNDS interleaved
# rounds, the img/s of each run's last progress line. Needs root (ip netns,
# tc); not part of CI (a minute or more per rate).
#
#   bazel build -c opt //examples:resnet_ddp //tools:launch
#   tools/grad_compress_bench.sh bazel-bin/tools/launch bazel-bin/examples/resnet_ddp [ROUNDS] [RATE...]
#   e.g. tools/grad_compress_bench.sh bazel-bin/tools/launch bazel-bin/examples/resnet_ddp 3 100mbit 1gbit
# CONFIGS="off,off bf16,off" picks the (--grad-compress, --amp) pairs.
set -uo pipefail
launch=$(realpath "$1") resnet=$(realpath "$2") rounds=${3:-3}
shift 3 2>/dev/null || shift $#
rates=("$@")
[ ${#rates[@]} -gt 0 ] || rates=(100mbit 1gbit)

source "$(dirname "$0")/netns_pair.sh"
netns_bench_setup grad_compress_bench ember_gc ember_gc egc 78

# run MODE AMP: one job, a rank per namespace; prints its img/s.
run() {
  local mode=$1 amp=$2 pids=()
  for node in 0 1; do
    local ns=$ns0 iface=$if0
    [ $node = 1 ] && ns=$ns1 iface=$if1
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$iface" EMBER_STORE_TOKEN=gc-bench \
      "$launch" --nnodes=2 --node_rank=$node --master_addr="$addr0" --master_port=29511 --nproc_per_node=1 -- \
      "$resnet" --data synthetic --epochs 1 --max-steps 30 --eval-size 64 --amp "$amp" --grad-compress "$mode" \
      --checkpoint-dir "$work/ckpt_$node" >"$work/node$node.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  rm -rf "$work"/ckpt_*
  grep "step 30/30" "$work/node0.log" | sed 's/.*  \([0-9]*\) img\/s.*/\1/'
}

for rate in "${rates[@]}"; do
  netns_shape "$rate" "${SHAPE:-}" || { echo "cannot shape the link to $rate"; exit 1; }
  for round in $(seq "$rounds"); do
    for cfg in ${CONFIGS:-"off,off" "bf16,off" "fp16,off" "off,bf16" "bf16,bf16"}; do
      cfg=${cfg/,/ }
      set -- $cfg
      echo "rate $rate round $round --grad-compress $1 --amp $2: $(run "$1" "$2") img/s"
    done
  done
done
