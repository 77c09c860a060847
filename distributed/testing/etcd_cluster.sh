#!/usr/bin/env bash
# A throwaway etcd cluster on localhost for the tests of the etcd rendezvous
# (EtcdStore, //tools:launch --rdzv-backend etcd): N members on free ports,
# each in DIR/m<i>/, started and waited for until the cluster serves a write.
#
#   etcd_cluster.sh start DIR [N]   # N members (default 3); writes DIR/endpoints
#                                   # ("127.0.0.1:P1,127.0.0.1:P2,...") and
#                                   # DIR/m<i>/{pid,client,log}
#   etcd_cluster.sh restart DIR I   # member I again (after a kill), same ports and data
#   etcd_cluster.sh stop DIR        # every member, SIGKILL; its data in /dev/shm removed
#
# Exits 3 with a message when etcd is not installed (tools/setup.sh --etcd
# installs Debian's etcd-server); the tests skip on that.
set -euo pipefail
cmd=${1:?usage: etcd_cluster.sh start|restart|stop DIR [N|I]}
dir=${2:?usage: etcd_cluster.sh start|restart|stop DIR [N|I]}
etcd=$(command -v etcd || true)
[ -z "$etcd" ] && [ -x /usr/bin/etcd ] && etcd=/usr/bin/etcd
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

member() {  # I: start member I in the background from DIR/m<I>/conf
  local i=$1 m=$dir/m$1
  # shellcheck disable=SC2046
  setsid "$etcd" $(cat "$m/conf") > "$m/log" 2>&1 < /dev/null &
  echo $! > "$m/pid"
}

# Up to 60 s: beside CI's other tests on 2 cores, 15 s once passed with no
# leader elected (the members' 50 ms heartbeats starved of CPU).
healthy() {  # until a write through the gateway succeeds (the cluster has a leader)
  local eps=$1
  for _ in $(seq 1 600); do
    for ep in ${eps//,/ }; do
      curl -s -m 1 -X POST "http://$ep/v3/kv/put" -d '{"key":"aGVhbHRo","value":"MQ=="}' 2>/dev/null |
        grep -q '"revision"' && return 0
    done
    sleep 0.1
  done
  return 1
}

case "$cmd" in
  start)
    [ -n "$etcd" ] || { echo "etcd_cluster: etcd is not installed (tools/setup.sh --etcd)"; exit 3; }
    n=${3:-3}
    mkdir -p "$dir"
    cluster="" eps=""
    for i in $(seq 0 $((n - 1))); do
      mkdir -p "$dir/m$i"
      c=$(free_port)
      p=$(free_port)
      echo "$c" > "$dir/m$i/client"
      echo "$p" > "$dir/m$i/peer"
      cluster+="${cluster:+,}m$i=http://127.0.0.1:$p"
      eps+="${eps:+,}127.0.0.1:$c"
    done
    token="t$$-$RANDOM"
    for i in $(seq 0 $((n - 1))); do
      c=$(cat "$dir/m$i/client") p=$(cat "$dir/m$i/peer")
      # The data in memory where it can be (/dev/shm): each write is an fsync,
      # which a loaded CI disk can stretch past the agents' timeouts.
      data=$dir/m$i/data
      if [ -d /dev/shm ] && [ -w /dev/shm ]; then data=$(mktemp -d /dev/shm/ember-etcd.XXXXXX); fi
      echo "$data" > "$dir/m$i/datadir"
      echo "--name m$i --data-dir $data --listen-client-urls http://127.0.0.1:$c" \
        "--advertise-client-urls http://127.0.0.1:$c --listen-peer-urls http://127.0.0.1:$p" \
        "--initial-advertise-peer-urls http://127.0.0.1:$p --initial-cluster $cluster" \
        "--initial-cluster-state new --initial-cluster-token $token --heartbeat-interval 50 --election-timeout 500" \
        > "$dir/m$i/conf"
      member "$i"
    done
    echo "$eps" > "$dir/endpoints"
    healthy "$eps" || { echo "etcd_cluster: no leader within 60 s"; tail -n 5 "$dir"/m*/log; exit 1; }
    ;;
  restart)
    i=${3:?member index}
    member "$i"
    ;;
  stop)
    for f in "$dir"/m*/pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2> /dev/null || true; done
    sleep 0.1
    for f in "$dir"/m*/datadir; do [ -f "$f" ] && case $(cat "$f") in /dev/shm/ember-etcd.*) rm -rf "$(cat "$f")" ;; esac; done
    ;;
  *) echo "etcd_cluster: unknown command $cmd" >&2; exit 2 ;;
esac
