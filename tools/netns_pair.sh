# Sourced by tools/multihost_test.sh and the link benches: two network
# namespaces ("hosts") joined by a veth pair, their shaping and cleanup.
#
#   source tools/netns_pair.sh
#   netns_pair NAME IFACE OCTET   # sets ns0 ns1 if0 if1 addr0 addr1 (10.OCTET.x.1 / .2, /24)
#   netns_pair_cleanup            # kills whatever runs in them, deletes them
#   netns_require_root TEST       # skips the test (exit 0) where they cannot be made
#   netns_shape RATE [QDISC]      # both ends' egress shaped to RATE (e.g. 100mbit)
#   netns_bench_setup BENCH WORK NAME IFACE OCTET  # a link bench's root check, $work dir, pair
# Needs root and iproute2; returns non-zero if the setup fails.

netns_pair() {
  local name=$1 iface=$2 octet=$3
  ns0=${name}0_$$ ns1=${name}1_$$ if0=${iface}0_$$ if1=${iface}1_$$
  if0=${if0:0:15} if1=${if1:0:15}
  addr0=10.$octet.$(( $$ % 200 )).1 addr1=10.$octet.$(( $$ % 200 )).2
  ip netns add "$ns0" && ip netns add "$ns1" &&
    ip link add "$if0" type veth peer name "$if1" &&
    ip link set "$if0" netns "$ns0" && ip link set "$if1" netns "$ns1" &&
    ip -n "$ns0" addr add "$addr0/24" dev "$if0" && ip -n "$ns1" addr add "$addr1/24" dev "$if1" &&
    ip -n "$ns0" link set "$if0" up && ip -n "$ns1" link set "$if1" up &&
    ip -n "$ns0" link set lo up && ip -n "$ns1" link set lo up
}

# netns_require_root TEST: exits 0 with a SKIPPED line where namespaces
# cannot be made (not root, no iproute2).
netns_require_root() {
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! ip netns add "ember_probe_$$" 2>/dev/null; then
    echo "$1: SKIPPED: network namespaces need root and iproute2 (ip netns); run as root to test"
    exit 0
  fi
  ip netns del "ember_probe_$$"
}

netns_pair_cleanup() {
  local ns pids
  for ns in "$ns0" "$ns1"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
}

# netns_shape RATE [QDISC]: both ends' egress through tc tbf at RATE, its
# bucket holding 1 ms at the rate (64 KB at least: a 64 KB bucket at 1 Gbit/s,
# refilled every 0.5 ms, stalls an allreduce's two-way bursts, docs/ddp.md)
# and a queue of up to 2 s, so packets wait rather than drop. QDISC, when
# given, replaces it ("qdisc and arguments", RATE in it standing for the rate).
netns_shape() {
  local rate=$1 burst shape dev
  burst=$(python3 -c "import re; v,u=re.fullmatch(r'([0-9.]+)([kmg]?)bit','$rate').groups()
print(max(64000, int(float(v)*{'':1,'k':1e3,'m':1e6,'g':1e9}[u]/8/1000)))") || return 1
  shape=${2:-"tbf rate RATE burst ${burst}b latency 2s"}
  for dev in "$ns0 $if0" "$ns1 $if1"; do
    set -- $dev
    # shellcheck disable=SC2086
    ip netns exec "$1" tc qdisc replace dev "$2" root ${shape//RATE/$rate} || return 1
  done
}

# netns_bench_setup BENCH WORK NAME IFACE OCTET: what the link benches set
# up first: exits 1 naming BENCH unless root; $work, a fresh directory
# /tmp/WORK.XXXXXX; the pair (netns_pair NAME IFACE OCTET), exiting 1 if
# it cannot be made; both removed when the script exits.
netns_bench_setup() {
  [ "$(id -u)" = 0 ] || { echo "$1: needs root (ip netns, tc)"; exit 1; }
  work=$(mktemp -d "/tmp/$2.XXXXXX")
  trap 'netns_pair_cleanup; rm -rf "$work"' EXIT
  netns_pair "$3" "$4" "$5" || { echo "network setup failed"; exit 1; }
}
