// EtcdStore (etcd_store.h): etcd's v3 API through its HTTP/JSON gateway.
// Keys and values travel base64-encoded; 64-bit integers as JSON strings
// (the gateway's proto3 mapping). Requests are short: blocking calls poll,
// so no member holds a request of ours for long and a failover costs at most
// one attempt's timeout.
#include "distributed/store/etcd_store.h"

#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/exception.h"

namespace ember::distributed {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string b64(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kB64[(v >> s) & 63]);
  }
  if (i < in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (i + 1 < in.size() ? uint8_t(in[i + 1]) << 8 : 0);
    out.push_back(kB64[(v >> 18) & 63]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(i + 1 < in.size() ? kB64[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

std::string unb64(const std::string& in) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const char* p = std::strchr(kB64, c);
    if (!p || !c) throw Error("etcd: a reply holds invalid base64 data");
    acc = (acc << 6) | uint32_t(p - kB64);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return out;
}

// The gateway writes int64 as strings and leaves zero values out.
int64_t i64_of(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_string()) return std::strtoll(it->get<std::string>().c_str(), nullptr, 10);
  return it->get<int64_t>();
}

// The value of a range reply's only kv, or nullopt-like {false, ""}.
std::pair<bool, std::string> value_of(const json& range_reply) {
  auto kvs = range_reply.find("kvs");
  if (kvs == range_reply.end() || kvs->empty()) return {false, ""};
  const json& kv = (*kvs)[0];
  return {true, kv.contains("value") ? unb64(kv["value"].get<std::string>()) : std::string()};
}

// The end of the range of every key starting with `prefix` (etcd's "prefix" option).
std::string prefix_end(std::string p) {
  while (!p.empty()) {
    if (static_cast<unsigned char>(p.back()) < 0xff) {
      p.back() = static_cast<char>(p.back() + 1);
      return p;
    }
    p.pop_back();
  }
  return std::string(1, '\0');
}

size_t append_body(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

std::string ms(Millis m) { return std::to_string(m.count()) + " ms"; }

// How long every member that answers may say it has no leader before a call
// calls the quorum lost (etcd elects within about two election timeouts, 1 s each by default).
constexpr Millis kLeaderlessGrace{5000};

// Under the store's prefix: each writer's last add (see add()), not counted as keys.
constexpr const char* kAddMarks = ".adds/";

// An etcd error that another member may not have (a member without a
// leader, or one that could not commit in time): try the next one.
bool member_cannot_serve(int code, const std::string& msg) {
  return code == 14 || code == 4 || msg.find("no leader") != std::string::npos ||
         msg.find("request timed out") != std::string::npos || msg.find("leader changed") != std::string::npos ||
         msg.find("too many requests") != std::string::npos || msg.find("not capable") != std::string::npos;
}

}  // namespace

std::vector<std::string> parse_etcd_endpoints(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = list.find(',', start);
    std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (item.rfind("http://", 0) == 0) item = item.substr(7);
    while (!item.empty() && item.back() == '/') item.pop_back();
    const size_t colon = item.rfind(':');
    EMBER_CHECK(!item.empty(), "etcd endpoints '", list, "': an empty item (expected host:port,host:port,...)");
    EMBER_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < item.size(), "etcd endpoints '", list, "': '",
                item, "' is not host:port");
    const std::string port = item.substr(colon + 1);
    EMBER_CHECK(port.find_first_not_of("0123456789") == std::string::npos && port.size() <= 5 && std::stoi(port) >= 1 &&
                    std::stoi(port) <= 65535,
                "etcd endpoints '", list, "': port '", port, "' of '", item, "' is not in 1-65535");
    out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

struct EtcdStore::Impl {
  // One HTTP connection (libcurl handle) and the member it last reached.
  // The lease keeper has its own, so a long failover on the caller's side
  // does not delay a renewal and the other way round.
  struct Conn {
    std::mutex mu;
    CURL* h = nullptr;
    size_t current = 0;
    ~Conn() {
      if (h) curl_easy_cleanup(h);
    }
  };

  EtcdStoreOptions o;
  Conn main, keeper_conn;
  std::thread keeper;
  std::mutex lease_mu;
  std::condition_variable lease_cv;
  bool stopping = false;
  int64_t lease = 0;
  std::map<std::string, std::string> leased;  // full key -> value, put again under a new lease
  std::string writer = random_id();           // names this store's add marks
  std::atomic<int64_t> adds{0};

  static std::string random_id() {
    std::random_device rd;
    char buf[17];
    std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
    return buf;
  }

  std::string endpoints() const {
    std::string s;
    for (const auto& e : o.endpoints) s += (s.empty() ? "" : ",") + e;
    return s;
  }

  // One request to one member. Returns the parsed reply; on failure sets
  // `error` and whether another member might serve it (`retry`).
  json post_once(Conn& c, const std::string& endpoint, const std::string& path, const std::string& body, Millis timeout,
                 std::string* error, bool* retry) {
    if (!c.h) c.h = curl_easy_init();
    EMBER_CHECK(c.h != nullptr, "etcd: curl_easy_init failed");
    CURL* h = c.h;
    std::string reply;
    const std::string url = "http://" + endpoint + path;
    curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, append_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &reply);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);  // threads: no SIGALRM for timeouts
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<int64_t>(timeout.count(), 1)));
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::clamp<int64_t>(timeout.count(), 1, 1000)));
    curl_easy_setopt(h, CURLOPT_PROXY, "");  // an http_proxy in the environment must not capture the cluster
    const CURLcode rc = curl_easy_perform(h);
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(headers);
    *retry = true;
    if (rc != CURLE_OK) {
      if (rc == CURLE_OPERATION_TIMEDOUT)
        *error = "no reply within " + ms(timeout);
      else if (rc == CURLE_COULDNT_CONNECT)
        *error = "connection refused (no etcd member listening)";
      else
        *error = curl_easy_strerror(rc);
      return nullptr;
    }
    json j = json::parse(reply, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      *error = "HTTP " + std::to_string(status) + " with a reply that is not JSON (is this an etcd client URL?)";
      *retry = true;
      return nullptr;
    }
    if (status != 200 || j.contains("error")) {
      // Unary calls answer {"error": "...", "code": N, "message": "..."};
      // streaming ones (lease keepalive) {"error": {"code": N, "message": ...}}.
      const json& e = j.contains("error") && j["error"].is_object() ? j["error"] : j;
      std::string msg = "HTTP " + std::to_string(status);
      if (e.contains("message") && e["message"].is_string())
        msg = e["message"].get<std::string>();
      else if (e.contains("error") && e["error"].is_string())
        msg = e["error"].get<std::string>();
      const int code = e.contains("code") && e["code"].is_number_integer() ? e["code"].get<int>() : 0;
      *error = msg;
      *retry = member_cannot_serve(code, msg);
      return nullptr;
    }
    return j;
  }

  // Whether the member at `endpoint` says it has no leader (its status'
  // errors), asked with a short timeout: a member that cannot commit
  // answers a request only after etcd's own request timeout (~6 s).
  bool says_no_leader(Conn& c, const std::string& endpoint) {
    std::string error;
    bool retry = true;
    const json st = post_once(c, endpoint, "/v3/maintenance/status", "{}", Millis{1000}, &error, &retry);
    // A fresh connection for the request that follows, as after any failure.
    curl_easy_cleanup(c.h);
    c.h = nullptr;
    if (st.is_null() || !st.contains("errors") || !st["errors"].is_array()) return false;
    for (const auto& e : st["errors"])
      if (e.is_string() && e.get<std::string>().find("no leader") != std::string::npos) return true;
    return false;
  }

  // Whether every member that answered `last` (with an error saying it
  // cannot serve) says it has no leader, and at least one answered.
  bool answering_leaderless(Conn& c, const std::vector<std::string>& last) {
    bool answered = false;
    for (size_t k = 0; k < last.size(); ++k) {
      if (!member_cannot_serve(0, last[k])) continue;
      answered = true;
      if (!says_no_leader(c, o.endpoints[k])) return false;
    }
    return answered;
  }

  // A request to the cluster: the member that last answered first, then
  // the others in turn, until one serves it or `within` has passed; but
  // every member is tried once before giving up (up to a second each), so a
  // call that this process's own stop (SIGSTOP, a starved CPU) ran past its
  // deadline still gets its answer rather than blaming the cluster.
  // A cluster that lost its quorum is named sooner than `within` (a join
  // timeout is 600 s by default): when every member that answers says it
  // has no leader, and keeps saying so each second for kLeaderlessGrace
  // (an election takes a second or two), waiting longer only hides the
  // fault. Only a call with more than that grace left watches so.
  json call(Conn& c, const std::string& path, const json& request, Millis within, const std::string& what) {
    global_init();
    std::lock_guard<std::mutex> lock(c.mu);
    const std::string body = request.dump();
    const auto deadline = Clock::now() + within;
    const size_t n = o.endpoints.size();
    // One attempt may not take the whole call: a frozen member would use it up.
    const Millis attempt_cap = std::max<Millis>(Millis{1000}, within / 3);
    std::vector<std::string> last(n);
    Millis backoff{20};
    for (;;) {
      for (size_t i = 0; i < n; ++i) {
        const size_t k = (c.current + i) % n;
        Millis left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        if (left <= Millis{0} && !last[k].empty()) continue;
        if (left <= Millis{0}) left = std::min<Millis>(Millis{1000}, attempt_cap);  // its one try
        std::string error;
        bool retry = true;
        json j = post_once(c, o.endpoints[k], path, body, std::min(left, attempt_cap), &error, &retry);
        if (!j.is_null()) {
          c.current = k;
          return j;
        }
        last[k] = error;
        // A fresh connection for the next try: one that saw a failure can
        // stay stuck (the gateway's keep-alive connection after a leader change).
        curl_easy_cleanup(c.h);
        c.h = nullptr;
        if (std::getenv("EMBER_ETCD_DEBUG"))
          std::fprintf(stderr, "etcd %s %s: %s\n", o.endpoints[k].c_str(), what.c_str(), error.c_str());
        if (!retry) throw Error("etcd " + o.endpoints[k] + ": " + what + ": " + error);
      }
      if (Clock::now() >= deadline) break;
      // No member served this pass: do those that answered all lack a
      // leader, and go on lacking one, polled each second?
      if (deadline - Clock::now() > kLeaderlessGrace + Millis{2000} && answering_leaderless(c, last)) {
        const auto since = Clock::now();
        bool still = true;
        while (still && Clock::now() - since < kLeaderlessGrace) {
          std::this_thread::sleep_for(Millis{1000});
          still = answering_leaderless(c, last);
        }
        if (still)
          throw Error("etcd cluster " + endpoints() + ": " + what + " failed: the members that answer have had no " +
                      "leader for " + ms(std::chrono::duration_cast<Millis>(Clock::now() - since)) + ": " +
                      members_said(last) + " (the cluster has lost its quorum: a majority of its members down?)");
      }
      std::this_thread::sleep_for(std::min(backoff, std::chrono::duration_cast<Millis>(deadline - Clock::now())));
      backoff = std::min(backoff * 2, Millis{250});
    }
    int refused = 0, answered_unable = 0, silent = 0;
    for (size_t k = 0; k < n; ++k) {
      const std::string& e = last[k].empty() ? std::string("not tried in time") : last[k];
      if (e.find("refused") != std::string::npos || e.find("resolve") != std::string::npos)
        ++refused;
      else if (e.find("no reply") != std::string::npos)
        ++silent;
      else if (member_cannot_serve(0, e))
        ++answered_unable;
    }
    std::string hint;
    if (answered_unable > 0 || (silent > 0 && refused > 0))
      hint =
          " (the members that answer cannot commit: has the cluster lost its quorum, a majority of its members "
          "down?)";
    else if (refused == static_cast<int>(n))
      hint = " (is etcd running there? --rdzv-endpoint lists the members' client URLs, host:2379)";
    throw Error("etcd cluster " + endpoints() + ": " + what + " failed within " + ms(within) + ": " +
                members_said(last) + hint);
  }

  // "endpoint: its last error; ..." for every member.
  std::string members_said(const std::vector<std::string>& last) const {
    std::string members;
    for (size_t k = 0; k < last.size(); ++k)
      members +=
          (members.empty() ? "" : "; ") + o.endpoints[k] + ": " + (last[k].empty() ? "not tried in time" : last[k]);
    return members;
  }

  json call(const std::string& path, const json& request, const std::string& what) {
    return call(main, path, request, o.timeout, what);
  }

  std::string full(const std::string& key) const { return o.prefix + key; }

  json range(const std::string& key, const std::string& what) {
    return call("/v3/kv/range", {{"key", b64(full(key))}}, what);
  }

  // Grants the lease (and puts the leased keys again) when there is none;
  // the keeper renews it every third of its TTL.
  int64_t ensure_lease() {
    std::unique_lock<std::mutex> lock(lease_mu);
    if (lease != 0) return lease;
    const int64_t ttl_s = std::max<int64_t>(1, (o.lease_ttl.count() + 999) / 1000);
    json g = call(keeper_conn, "/v3/lease/grant", {{"TTL", std::to_string(ttl_s)}}, o.timeout, "lease grant");
    lease = i64_of(g, "ID");
    EMBER_CHECK(lease != 0, "etcd cluster ", endpoints(), ": lease grant returned no lease id");
    for (const auto& [k, v] : leased)
      call(keeper_conn, "/v3/kv/put", {{"key", b64(k)}, {"value", b64(v)}, {"lease", std::to_string(lease)}}, o.timeout,
           "put");
    if (!keeper.joinable()) keeper = std::thread([this] { keep_alive(); });
    return lease;
  }

  void put_leased_keys(int64_t id) {
    std::map<std::string, std::string> keys;
    {
      std::lock_guard<std::mutex> lock(lease_mu);
      keys = leased;
    }
    for (const auto& [k, v] : keys)
      call(keeper_conn, "/v3/kv/put", {{"key", b64(k)}, {"value", b64(v)}, {"lease", std::to_string(id)}}, o.timeout,
           "put");
  }

  void keep_alive() {
    std::unique_lock<std::mutex> lock(lease_mu);
    const Millis every = std::max<Millis>(Millis{100}, o.lease_ttl / 3);
    while (!stopping) {
      lease_cv.wait_for(lock, every);
      if (stopping) return;
      const int64_t id = lease;
      lock.unlock();
      bool lapsed = false;
      try {
        json r = call(keeper_conn, "/v3/lease/keepalive", {{"ID", std::to_string(id)}}, every, "lease keepalive");
        const json& res = r.contains("result") && r["result"].is_object() ? r["result"] : r;
        lapsed = i64_of(res, "TTL") <= 0;  // expired: etcd answers without a TTL
        if (!lapsed) put_leased_keys(id);  // back if something deleted them (a takeover racing this agent's start)
      } catch (const std::exception&) {
        // The cluster is unreachable for now: try again at the next tick
        // (the lease may still be alive when it is back).
      }
      lock.lock();
      if (lapsed && lease == id) lease = 0;
      if (lapsed) {
        lock.unlock();
        try {
          ensure_lease();
        } catch (const std::exception&) {
        }
        lock.lock();
      }
    }
  }
};

EtcdStore::EtcdStore(EtcdStoreOptions options) : Store(options.timeout), impl_(std::make_unique<Impl>()) {
  EMBER_CHECK(!options.endpoints.empty(), "EtcdStore: no endpoints");
  impl_->o = std::move(options);
  const Millis first = impl_->o.connect_timeout.count() > 0 ? impl_->o.connect_timeout : impl_->o.timeout;
  impl_->call(impl_->main, "/v3/kv/range", {{"key", b64(impl_->o.prefix)}, {"count_only", true}}, first,
              "reaching the cluster");
}

EtcdStore::~EtcdStore() {
  {
    std::lock_guard<std::mutex> lock(impl_->lease_mu);
    impl_->stopping = true;
  }
  impl_->lease_cv.notify_all();
  if (impl_->keeper.joinable()) impl_->keeper.join();
  // The lease is revoked, so its keys go now rather than after the TTL
  // (an agent that leaves on purpose is not "alive" for a TTL longer).
  if (impl_->lease != 0) {
    try {
      impl_->call(impl_->main, "/v3/lease/revoke", {{"ID", std::to_string(impl_->lease)}}, Millis{2000},
                  "lease revoke");
    } catch (const Error&) {
    }
  }
}

std::string EtcdStore::endpoints() const { return impl_->endpoints(); }

void EtcdStore::set(const std::string& key, const Bytes& value) {
  impl_->call("/v3/kv/put", {{"key", b64(impl_->full(key))}, {"value", b64({(const char*)value.data(), value.size()})}},
              "set(" + key + ")");
}

void EtcdStore::set_leased(const std::string& key, const std::string& value) {
  EMBER_CHECK(impl_->o.lease_ttl.count() > 0, "EtcdStore::set_leased(", key, "): the store has no lease_ttl");
  {
    std::lock_guard<std::mutex> lock(impl_->lease_mu);
    impl_->leased[impl_->full(key)] = value;
  }
  for (int attempt = 0;; ++attempt) {
    const int64_t lease = impl_->ensure_lease();
    try {
      impl_->call("/v3/kv/put",
                  {{"key", b64(impl_->full(key))}, {"value", b64(value)}, {"lease", std::to_string(lease)}},
                  "set(" + key + ")");
      return;
    } catch (const Error& e) {
      // The lease lapsed (this process was stopped past its TTL) and the
      // keeper has not granted the next yet: grant it here, once.
      if (attempt > 0 || std::string(e.what()).find("lease not found") == std::string::npos) throw;
      std::lock_guard<std::mutex> lock(impl_->lease_mu);
      if (impl_->lease == lease) impl_->lease = 0;
    }
  }
}

Bytes EtcdStore::get(const std::string& key) {
  wait({key}, timeout_);
  auto [found, v] = value_of(impl_->range(key, "get(" + key + ")"));
  EMBER_CHECK(found, "etcd cluster ", endpoints(), ": get(", key, "): the key was deleted while read");
  return Bytes(v.begin(), v.end());
}

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  auto parse = [&](const std::pair<bool, std::string>& kv) -> int64_t {
    if (!kv.first) return 0;
    char* end = nullptr;
    const int64_t v = std::strtoll(kv.second.c_str(), &end, 10);
    if (kv.second.empty() || *end != '\0')
      throw Error("etcd cluster " + endpoints() + ": add(" + key + "): the value stored is not an integer: '" +
                  kv.second + "'");
    return v;
  };
  // add(k, 0) of a key that exists reads: the agents poll counters so, and
  // a write per poll would grow etcd's history and make the writers'
  // transactions retry. A missing key is created as "0", as TCPStore does
  // (compare_set on it relies on that).
  if (delta == 0) {
    const auto kv = value_of(impl_->range(key, "add(" + key + ")"));
    if (kv.first) return parse(kv);
    compare_set(key, {}, Bytes{'0'});
    return parse(value_of(impl_->range(key, "add(" + key + ")")));
  }
  // A transaction on the revision read: another writer in between makes it
  // fail, and the add is tried again on the new value. The same transaction
  // also writes this writer's mark (its own sequence number): a call that
  // went in on an attempt the client could not confirm (a member that
  // committed, then timed out) and was sent again fails its comparison the
  // second time, and the mark tells that apart from another writer's add,
  // so nothing is counted twice.
  const std::string k = b64(impl_->full(key));
  const std::string mark = b64(impl_->o.prefix + kAddMarks + key + "/" + impl_->writer);
  const std::string seq = std::to_string(impl_->adds.fetch_add(1) + 1);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (int tries = 1;; ++tries) {
    json r = impl_->range(key, "add(" + key + ")");
    const auto kv = value_of(r);
    const int64_t cur = parse(kv);
    const std::string next = std::to_string(cur + delta);
    json cmp = kv.first ? json{{"key", k},
                               {"result", "EQUAL"},
                               {"target", "MOD"},
                               {"mod_revision", std::to_string(i64_of(r["kvs"][0], "mod_revision"))}}
                        : json{{"key", k}, {"result", "EQUAL"}, {"target", "CREATE"}, {"create_revision", "0"}};
    // Not under the lease: one that lapsed (this process stopped past its
    // TTL) would fail the add. A mark per writer and counter: a job's few.
    json put_mark = {{"key", mark}, {"value", b64(seq)}};
    json t = impl_->call(
        "/v3/kv/txn",
        {{"compare", json::array({cmp})},
         {"success", json::array({{{"request_put", {{"key", k}, {"value", b64(next)}}}}, {{"request_put", put_mark}}})},
         {"failure", json::array({{{"request_range", {{"key", mark}}}}})}},
        "add(" + key + ")");
    if (t.value("succeeded", false)) return cur + delta;
    const json& resp = t.contains("responses") && !t["responses"].empty() ? t["responses"][0] : json::object();
    if (resp.contains("response_range") && value_of(resp["response_range"]) == std::make_pair(true, seq))
      return cur + delta;  // ours went in before: cur is what it added to (its comparison held)
    if (std::chrono::steady_clock::now() >= deadline)
      throw Error("etcd cluster " + endpoints() + ": add(" + key + "): " + std::to_string(tries) +
                  " tries lost to other writers within " + ms(timeout_));
  }
}

Bytes EtcdStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  const std::string k = b64(impl_->full(key));
  const std::string want(expected.begin(), expected.end());
  json cmp = expected.empty() ? json{{"key", k}, {"result", "EQUAL"}, {"target", "CREATE"}, {"create_revision", "0"}}
                              : json{{"key", k}, {"result", "EQUAL"}, {"target", "VALUE"}, {"value", b64(want)}};
  json t = impl_->call(
      "/v3/kv/txn",
      {{"compare", json::array({cmp})},
       {"success",
        json::array({{{"request_put", {{"key", k}, {"value", b64({(const char*)desired.data(), desired.size()})}}}}})},
       {"failure", json::array({{{"request_range", {{"key", k}}}}})}},
      "compare_set(" + key + ")");
  if (t.value("succeeded", false)) return desired;
  // Failed: the stored value (TCPStore's answer), or "" when the key is absent.
  const json& resp = t["responses"][0];
  auto [found, v] = value_of(resp.contains("response_range") ? resp["response_range"] : json::object());
  return found ? Bytes(v.begin(), v.end()) : Bytes{};
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  for (const std::string& key : keys)
    if (!value_of(impl_->range(key, "check(" + key + ")")).first) return false;
  return true;
}

void EtcdStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  Millis pause{10};
  for (;;) {
    if (check(keys)) return;
    if (Clock::now() >= deadline) {
      std::string names;
      for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
      throw Error("etcd cluster " + endpoints() + ": wait(" + names + ") timed out after " + ms(timeout));
    }
    std::this_thread::sleep_for(std::min(pause, std::chrono::duration_cast<Millis>(deadline - Clock::now())));
    pause = std::min(pause * 2, Millis{100});
  }
}

bool EtcdStore::delete_key(const std::string& key) {
  json r = impl_->call("/v3/kv/deleterange", {{"key", b64(impl_->full(key))}}, "delete_key(" + key + ")");
  return i64_of(r, "deleted") > 0;
}

int64_t EtcdStore::count_prefix(const std::string& prefix) {
  const std::string p = impl_->full(prefix);
  json r = impl_->call("/v3/kv/range", {{"key", b64(p)}, {"range_end", b64(prefix_end(p))}, {"count_only", true}},
                       "count(" + prefix + ")");
  return i64_of(r, "count");
}

int64_t EtcdStore::num_keys() { return count_prefix("") - count_prefix(kAddMarks); }

int64_t EtcdStore::revision(const std::string& key) {
  json r = impl_->range(key, "revision(" + key + ")");
  auto kvs = r.find("kvs");
  return kvs == r.end() || kvs->empty() ? 0 : i64_of((*kvs)[0], "mod_revision");
}

bool EtcdStore::delete_prefix_if(const std::string& prefix,
                                 const std::vector<std::pair<std::string, int64_t>>& unchanged) {
  const std::string p = impl_->full(prefix);
  json cmps = json::array();
  for (const auto& [key, rev] : unchanged)
    cmps.push_back({{"key", b64(impl_->full(key))},
                    {"result", "EQUAL"},
                    {"target", "MOD"},
                    {"mod_revision", std::to_string(rev)}});
  json t = impl_->call(
      "/v3/kv/txn",
      {{"compare", cmps},
       {"success", json::array({{{"request_delete_range", {{"key", b64(p)}, {"range_end", b64(prefix_end(p))}}}}})}},
      "delete(" + prefix + "*)");
  return t.value("succeeded", false);
}

}  // namespace ember::distributed
