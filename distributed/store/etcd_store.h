// EtcdStore: the Store interface over an etcd v3 cluster, spoken through
// etcd's HTTP/JSON gateway (POST /v3/kv/range, /v3/kv/txn, /v3/lease/...)
// with libcurl. It is what lets the elastic agents meet without any one host
// being special (//tools:launch --rdzv-backend etcd, torchrun's etcd-v2
// rendezvous on the v3 API): etcd replicates every key over its members and
// survives the loss of any minority of them.
//
// Every request goes to one member and fails over to the next on a refused
// connection, a timeout, or a member that cannot serve ("no leader", "request
// timed out"); a call gives up after the store's timeout with an error that
// names each member and what it answered, and says when the members answer
// but cannot agree (a lost quorum). Counters (add) and compare_set are
// etcd transactions on the key's revision, so concurrent callers on many hosts
// see the same atomic results as with TCPStore. Blocking calls (get, wait)
// poll. A key written with set_leased() lives under this store's own lease,
// renewed by a thread while the store lives: when its process dies or
// freezes, the key vanishes after the lease's TTL (how an agent's liveness
// is seen by the others, and a crashed job's leftovers told from a live job).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "distributed/store/store.h"

namespace ember::distributed {

struct EtcdStoreOptions {
  // "host:port" of the members' client URLs (http), in the order tried.
  std::vector<std::string> endpoints;
  // Prepended to every key (and what num_keys and delete_prefix count under).
  std::string prefix = "/ember/";
  Millis timeout = kDefaultTimeout;  // each call (blocking or not), across every member
  // How long the first contact may take (etcd still starting, say); 0: timeout.
  Millis connect_timeout{0};
  // The TTL of the lease that set_leased() keys live under; 0: no lease.
  Millis lease_ttl{0};
};

class EtcdStore : public Store {
 public:
  // Reaches the cluster (a member that answers a read), waiting up to the
  // connect timeout; throws naming every endpoint and its error otherwise.
  explicit EtcdStore(EtcdStoreOptions options);
  ~EtcdStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  using Store::set;
  using Store::wait;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;

  // Sets key under this store's lease (options.lease_ttl > 0): gone once
  // the lease lapses, when this process has not renewed it for the TTL.
  void set_leased(const std::string& key, const std::string& value);
  // Keys under `prefix` (relative to options.prefix).
  int64_t count_prefix(const std::string& prefix);
  // The key's modification revision, 0 when it does not exist.
  int64_t revision(const std::string& key);
  // Deletes every key under `prefix` if each key of `unchanged` is still at
  // its revision (0: still absent), in one transaction: a caller that saw
  // stale state deletes nothing newer. Returns whether it did.
  bool delete_prefix_if(const std::string& prefix, const std::vector<std::pair<std::string, int64_t>>& unchanged);
  // "127.0.0.1:2379,127.0.0.1:2381" for messages.
  std::string endpoints() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// "h1:2379,h2:2379" into its endpoints; throws ember::Error naming what is
// malformed (an empty item, no port, a port outside 1-65535).
std::vector<std::string> parse_etcd_endpoints(const std::string& list);

}  // namespace ember::distributed
