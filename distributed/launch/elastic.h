// Elastic launching (torchrun's elastic agent): one agent per host, all
// meeting in rendezvous rounds over a TCP store at a known endpoint, or an
// etcd cluster.
//
//   # on each host (or twice on one, as two "hosts"):
//   launch --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 \
//          --rdzv-endpoint host0:29400 --rdzv-id job7 -- prog args...
//
// A round closes when MAX nodes have joined, or MIN have and no other came
// for last_call; its members get ranks afresh (node index by arrival, ranks
// in node order) and start their workers with WORLD_SIZE = the nodes'
// workers together and EMBER_RESTART_COUNT (= TORCHELASTIC_RESTART_COUNT) =
// the round's number, so a program resumes from its newest checkpoint in
// every round after the first. Every agent logs
// "rendezvous round R: world size W".
//
// A new round starts when a worker fails (its agent stops its workers and
// asks for one; that counts against max_restarts, across the job), when an
// agent sees a member's heartbeat stop for heartbeat_timeout (a host that
// froze or was cut off), or when an agent that came too late for the running
// round waits and the round has fewer than MAX nodes (scale up). Every
// agent polls the store twice a second and stops its workers at once when
// the round changes: survivors never sit in a collective until its timeout.
// A host that is gone simply does not join the next round (scale down).
//
// The store (rdzv_backend "c10d"): the agent that can listen on the
// endpoint (the first on that host) serves it; the others connect. Losing
// the host of that agent ends the job (the others report it and exit), as
// with torchrun's c10d rendezvous backend; every other host may come and
// go. With "etcd" the agents meet in an etcd cluster (EtcdStore) that no
// agent serves: any host may be lost, and a minority of etcd's members.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace ember::distributed {

struct ElasticOptions {
  int min_nodes = 1, max_nodes = 1;
  int nproc_per_node = 1;
  std::string endpoint_host = "127.0.0.1";
  int endpoint_port = 29400;
  // "c10d": the agents meet over a TCP store that the first agent on the
  // endpoint's host serves (losing that host ends the job). "etcd": over an
  // etcd cluster at etcd_endpoints (the endpoint above is the first of them),
  // which no agent serves: any host may be lost (EtcdStore).
  std::string rdzv_backend = "c10d";
  std::vector<std::string> etcd_endpoints;
  std::string rdzv_id = "none";  // agents of one job share it; another job must pick its own
  // The address other hosts reach this one at (MASTER_ADDR when this node
  // is node 0 of a round). Empty: the endpoint's host when that is this
  // host, else this host's name.
  std::string local_addr;
  int max_restarts = 0;  // worker failures the job survives, counted over all agents
  // torchrun's --rdzv-conf names and defaults (seconds there).
  std::chrono::milliseconds last_call = std::chrono::seconds(30);
  std::chrono::milliseconds join_timeout = std::chrono::seconds(600);
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(30);
  bool prefix_output = true;
  std::chrono::milliseconds grace = std::chrono::seconds(5);
  // --live-recovery: a worker that fails is replaced in place, with the
  // same rank, while every other worker keeps running (torchft's recovery);
  // the workers rebuild their groups and the replacement takes the training
  // state from a live replica (init.h, "Live recovery"). Node 0's agent
  // hosts the workers' store (torchrun's agent store), so losing any worker,
  // rank 0's included, leaves it. Each replacement counts against
  // max_restarts. A lost node, or workers that cannot recover in place,
  // still end the round: a new one resumes from the newest checkpoint.
  bool live_recovery = false;
};

// Runs this host's agent until the job ends. Returns 0 when this node's
// workers of the last round succeeded; the failing worker's status when
// restarts are exhausted (here or on another node: then 1); 1 when the
// rendezvous fails (MIN nodes never joined within join_timeout, the id
// belongs to another job, the store is gone); 128 + signal for a signal to
// the agent. Throws ember::Error for invalid options.
int elastic_launch(const ElasticOptions& options, const std::vector<std::string>& argv);

}  // namespace ember::distributed
