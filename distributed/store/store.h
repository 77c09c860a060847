// Rendezvous stores: a small key-value service every rank can reach, used
// to exchange addresses (Gloo), unique ids (NCCL) and to agree on things
// (sequence numbers, barriers) before any collective runs. The interface
// follows c10d's Store: set / get / add / compare_set / check / wait /
// delete_key / num_keys, every blocking call bounded by a timeout.
//
//   auto store = std::make_shared<TCPStore>("127.0.0.1", 29500, TCPStoreOptions{.is_server = rank == 0});
//   store->set("hello", "world");
//   std::string v = store->get_string("hello");  // waits until set, or throws after the timeout
//
// Errors: a timeout or an unreachable server throws ember::Error naming the
// store, the key(s) and the timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/exception.h"

namespace gloo::rendezvous {
class Store;
}

namespace ember::distributed {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

// torch.distributed's default: 10 minutes for every operation.
inline constexpr Millis kDefaultTimeout{10 * 60 * 1000};

// A rank whose store connection closed without saying goodbye: its process
// exited, crashed or was killed (see TCPStoreOptions::rank).
struct LostRank {
  int rank = -1;
  std::string peer;       // the address its connection came from
  int64_t ms_ago = 0;     // when the connection closed, as seen by the server
  bool replaced = false;  // a new process has since connected as this rank (live recovery)
  // "rank 2 (connection from 127.0.0.1:41872, closed 120 ms ago)"
  std::string describe() const;
};

// What a blocking store call throws instead of waiting out its timeout once
// a rank of the job is gone: whatever it waited for may never come.
class RankLostError : public Error {
 public:
  RankLostError(const std::string& what, std::vector<LostRank> lost) : Error(what), lost_(std::move(lost)) {}
  const std::vector<LostRank>& lost() const { return lost_; }

 private:
  std::vector<LostRank> lost_;
};

class Store {
 public:
  explicit Store(Millis timeout = kDefaultTimeout) : timeout_(timeout) {}
  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits (up to timeout()) until the key exists.
  virtual Bytes get(const std::string& key) = 0;
  // Atomically adds `delta` to the integer stored at key (0 if absent, stored
  // as decimal text as c10d does) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets key to `desired` if its current value equals `expected` (an empty
  // `expected` matches a missing key); returns the value stored afterwards.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;
  // True when every key exists; never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Blocks until every key exists; throws after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  // Returns whether the key existed.
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;
  // Ranks known to have left the job without saying goodbye; empty for
  // stores that cannot tell (FileStore: a dead rank is found by timeout).
  // Throws when the store itself cannot be reached.
  virtual std::vector<LostRank> lost_ranks() { return {}; }
  // The ranks lost less than `window` ago, including those a replacement
  // process has taken over since (which lost_ranks() no longer lists, so
  // that the new generation's waits block normally). A process group asks
  // with its own age: a peer that died while the group lived is dead to it
  // even once its replacement has said hello (live recovery's survivors
  // would otherwise wait out the timeout on a peer that is gone).
  virtual std::vector<LostRank> lost_ranks_since(Millis window) {
    (void)window;
    return lost_ranks();
  }
  // Leaves for good (a TCPStore client says goodbye, so its rank is not
  // reported lost, and never reconnects), even while other owners still
  // hold this store (live recovery's aborted groups, left to their
  // threads). Later calls throw. A no-op for stores without connections.
  virtual void close() {}

  Millis timeout() const { return timeout_; }
  void set_timeout(Millis t) { timeout_ = t; }

  void set(const std::string& key, const std::string& value) { set(key, Bytes(value.begin(), value.end())); }
  std::string get_string(const std::string& key) {
    Bytes b = get(key);
    return std::string(b.begin(), b.end());
  }

 protected:
  Millis timeout_;
};

struct TCPStoreOptions {
  bool is_server = false;  // this process hosts the store (rank 0 by convention)
  int num_workers = -1;    // if > 0 the server waits for this many clients to connect
  bool wait_for_workers = true;
  Millis timeout = kDefaultTimeout;  // connect, and every blocking call
  Millis connect_timeout{0};         // the first connection, if > 0 (a rendezvous can give up sooner)
  // The job rank this client speaks for (-1: none). When the connection of a
  // client with a rank closes without the goodbye its destructor sends, the
  // server records the rank as lost and fails every blocking call, parked
  // or later, with RankLostError naming it: a dead rank is reported within
  // milliseconds instead of at the timeout, which is left for ranks that are
  // alive but stuck.
  int rank = -1;
  // A shared secret of the job (EMBER_STORE_TOKEN, which the launcher
  // generates). The server refuses, and logs, any client that does not
  // present the same token; empty on the server: no token is asked for.
  std::string token;
  // The server listens only on the addresses `host` resolves to (loopback
  // when the host is a loopback address). true: on every interface, as
  // c10d does (EMBER_STORE_LISTEN_ALL=1), for hosts whose own name resolves
  // to a loopback address that other machines cannot reach.
  bool listen_on_all = false;
  // Who serves the store, for clients' errors ("did <server> exit?").
  std::string server = "the process hosting it, usually rank 0";
};

// One server thread (in the process with is_server) and one socket per
// client. Port 0 on the server picks a free port (see port()).
class TCPStore : public Store {
 public:
  TCPStore(std::string host, int port, TCPStoreOptions options = {});
  ~TCPStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  using Store::set;  // set(key, std::string), hidden by the override otherwise
  using Store::wait;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  std::vector<LostRank> lost_ranks() override;
  std::vector<LostRank> lost_ranks_since(Millis window) override;
  void close() override;
  int port() const;
  const std::string& host() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A store in one file on a shared file system (every access takes an
// exclusive flock). Good for single-node tests and clusters without a
// reachable master port.
class FileStore : public Store {
 public:
  FileStore(std::string path, int num_workers = -1, Millis timeout = kDefaultTimeout);
  ~FileStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  using Store::set;  // set(key, std::string), hidden by the override otherwise
  using Store::wait;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Namespaces every key as "<prefix>/<key>" over another store: sub-groups
// and successive process groups share one TCPStore without collisions.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  using Store::set;  // set(key, std::string), hidden by the override otherwise
  using Store::wait;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  std::vector<LostRank> lost_ranks() override { return base_->lost_ranks(); }
  std::vector<LostRank> lost_ranks_since(Millis window) override { return base_->lost_ranks_since(window); }
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string key(const std::string& k) const { return prefix_ + "/" + k; }
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

// Gloo's rendezvous talks to a gloo::rendezvous::Store; this adapts ours.
std::shared_ptr<gloo::rendezvous::Store> make_gloo_store(std::shared_ptr<Store> store);

}  // namespace ember::distributed
