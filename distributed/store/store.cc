// PrefixStore (namespacing over a shared store) and the adapter that lets
// Gloo's rendezvous run over any ember Store. TCPStore and FileStore live in
// tcp_store.cc and file_store.cc.
#include "distributed/store/store.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/store.h>

#include "core/exception.h"

namespace ember::distributed {

std::string LostRank::describe() const {
  return "rank " + std::to_string(rank) + " (connection from " + peer + ", closed " + std::to_string(ms_ago) +
         " ms ago" + (replaced ? "; a replacement has connected since" : "") + ")";
}

// Blocking calls that take no timeout (get) run under the base store's
// timeout: the base has no per-call timeout for them, and every store of a
// job is normally built with the same one anyway.
PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : Store(base ? base->timeout() : kDefaultTimeout), prefix_(std::move(prefix)), base_(std::move(base)) {
  EMBER_CHECK(base_ != nullptr, "PrefixStore ", prefix_, ": the base store is null");
}

void PrefixStore::set(const std::string& k, const Bytes& value) { base_->set(key(k), value); }

Bytes PrefixStore::get(const std::string& k) { return base_->get(key(k)); }

int64_t PrefixStore::add(const std::string& k, int64_t delta) { return base_->add(key(k), delta); }

Bytes PrefixStore::compare_set(const std::string& k, const Bytes& expected, const Bytes& desired) {
  return base_->compare_set(key(k), expected, desired);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(key(k));
  return base_->check(full);
}

void PrefixStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(key(k));
  base_->wait(full, timeout);
}

bool PrefixStore::delete_key(const std::string& k) { return base_->delete_key(key(k)); }

// The stores cannot list keys, so this counts the whole base store, as
// c10d's PrefixStore does.
int64_t PrefixStore::num_keys() { return base_->num_keys(); }

namespace {

class GlooStore final : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::shared_ptr<distributed::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, Bytes(data.begin(), data.end()));
  }

  std::vector<char> get(const std::string& key) override {
    Bytes b = store_->get(key);
    return std::vector<char>(b.begin(), b.end());
  }

  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }

  // Gloo passes kNoTimeout (zero) for "the default"; ours is the store's.
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    if (timeout == gloo::kNoTimeout) {
      store_->wait(keys);
    } else {
      store_->wait(keys, timeout);
    }
  }

 private:
  std::shared_ptr<distributed::Store> store_;
};

}  // namespace

std::shared_ptr<gloo::rendezvous::Store> make_gloo_store(std::shared_ptr<Store> store) {
  EMBER_CHECK(store != nullptr, "make_gloo_store: the store is null");
  return std::make_shared<GlooStore>(std::move(store));
}

}  // namespace ember::distributed
