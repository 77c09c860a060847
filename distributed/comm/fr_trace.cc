// fr_trace's analysis (see fr_trace.h): load the ranks' dumps (in
// parallel: a 64-rank job's full rings are tens of MB of JSON), group the
// entries by process group and rank, then walk each group's collectives by
// sequence id and its transfers by pair.
#include "distributed/comm/fr_trace.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "core/exception.h"
#include "core/json_limits.h"

namespace ember::distributed::fr {
namespace {

using nlohmann::json;

struct Op {
  int64_t seq = 0;
  std::string op;
  int peer = -1, tag = 0;
  int64_t msg = -1;   // p2p: the message's number for its peer and tag
  std::string shape;  // "input [4] float32 output [16] float32"
  std::string state;
  std::string error;
};

struct Member {
  std::map<int64_t, Op> coll;  // by sequence id
  std::vector<Op> p2p;         // in record order
  int64_t last_scheduled = -1, last_completed = -1;
};

struct Group {
  std::string name;
  std::vector<int> ranks;
  std::map<int, Member> by_rank;  // ranks with a dump that recorded this group
};

struct Dump {
  std::string path, error;
  int rank = -1, world_size = -1;
  int64_t dumped_at_ns = 0;
  json j;
};

std::string list(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

std::string group_label(const Group& g) { return "group " + g.name + " [" + list(g.ranks) + "]"; }

std::string shapes(const json& e) {
  std::string out;
  auto side = [&](const char* what, const char* sizes_key, const char* dtypes_key) {
    auto sizes = e.find(sizes_key);
    auto dtypes = e.find(dtypes_key);
    if (sizes == e.end()) return;
    for (size_t i = 0; i < sizes->size(); ++i) {
      if (!out.empty()) out += ' ';
      out += what;
      out += " [";
      const json& s = (*sizes)[i];
      for (size_t k = 0; k < s.size(); ++k) {
        if (k) out += ',';
        out += std::to_string(s[k].get<int64_t>());
      }
      out += "] ";
      out += dtypes != e.end() && i < dtypes->size() ? (*dtypes)[i].get_ref<const std::string&>() : std::string("?");
    }
  };
  side("input", "input_sizes", "input_dtypes");
  side("output", "output_sizes", "output_dtypes");
  return out;
}

std::string dtypes_only(const json& e) {
  std::string s;
  for (const char* k : {"input_dtypes", "output_dtypes"})
    for (const json& d : e.value(k, json::array())) s += (s.empty() ? "" : " ") + d.get<std::string>();
  return "dtypes " + s;
}

Dump load(const std::string& path) {
  Dump d;
  d.path = path;
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    d.error = path + ": cannot read";
    return d;
  }
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (std::string e = json_depth_error(text); !e.empty()) {
    d.error = path + ": " + e;
    return d;
  }
  try {
    // The entries' fields fr_trace does not read are dropped while parsing
    // (a 64-rank job's dumps are tens of MB).
    d.j = json::parse(text, [](int depth, json::parse_event_t event, json& parsed) {
      if (depth != 3 || event != json::parse_event_t::key) return true;
      const std::string& k = parsed.get_ref<const std::string&>();
      return !(k == "frame" || k == "caller" || k == "time_created_ns" || k == "time_started_ns" ||
               k == "time_completed_ns" || k == "timeout_ms" || k == "record_id" || k == "group");
    });
    if (d.j.value("format", "") != "ember_flight_recorder") {
      d.error = path + ": not a flight recorder dump (no \"format\": \"ember_flight_recorder\")";
      return d;
    }
    d.rank = d.j.at("rank").get<int>();
    d.world_size = d.j.at("world_size").get<int>();
    d.dumped_at_ns = d.j.value("dumped_at_ns", int64_t{0});
  } catch (const std::exception& e) {
    d.error = path + ": " + e.what();
  }
  return d;
}

// Ranks joined by their key ("allreduce input [4] float32 ..."): the
// mismatch line "ranks 0,2,3 <key>; rank 1 <other key>".
std::string by_key(const std::map<std::string, std::vector<int>>& keys) {
  std::string s;
  for (const auto& [key, ranks] : keys)
    s += (s.empty() ? "" : "; ") + std::string(ranks.size() == 1 ? "rank " : "ranks ") + list(ranks) + " " + key;
  return s;
}

class Analysis {
 public:
  Analysis(TraceReport& r, std::vector<int> here) : r_(r), here_(here.begin(), here.end()) {}

  void add(const Dump& d) {
    dumped_.insert(d.rank);
    world_ = std::max(world_, d.world_size);
    std::vector<Member*> by_id;
    std::vector<std::string> labels;
    for (const json& g : d.j.value("groups", json::array())) {
      const std::vector<int> ranks = g.at("ranks").get<std::vector<int>>();
      Member& m = member(g.at("name").get<std::string>(), ranks, d.rank);
      m.last_scheduled = g.value("last_scheduled_seq", int64_t{-1});
      m.last_completed = g.value("last_completed_seq", int64_t{-1});
      by_id.push_back(&m);
      labels.push_back("group " + g.at("name").get<std::string>() + " [" + list(ranks) + "]");
    }
    for (const json& e : d.j.value("entries", json::array())) {
      const int64_t id = e.value("group_id", int64_t{-1});
      if (id < 0) continue;  // an operation of no group (none today)
      EMBER_CHECK(id < static_cast<int64_t>(by_id.size()), "entry ", e.value("record_id", int64_t{-1}),
                  " names group_id ", id, " but the dump lists ", by_id.size(), " groups");
      Member& m = *by_id[static_cast<size_t>(id)];
      Op op;
      op.seq = e.at("seq").get<int64_t>();
      op.op = e.at("op").get<std::string>();
      op.peer = e.value("peer", -1);
      op.tag = e.value("tag", 0);
      op.msg = e.value("msg", int64_t{-1});
      // The uneven all-to-all's sizes differ by rank by design: its ranks
      // agree on the op and the dtypes.
      op.shape = op.op == "all_to_all_v" ? dtypes_only(e) : shapes(e);
      op.state = e.at("state").get<std::string>();
      op.error = e.value("error", "");
      if (op.state != "completed" && !waiting_.count(d.rank)) {
        // The rank's oldest unfinished operation: where it is blocked.
        const std::string& g = labels[static_cast<size_t>(id)];
        waiting_[d.rank] = e.value("p2p", false)
                               ? "a p2p " + op.op + " with rank " + std::to_string(op.peer) + " of " + g
                               : "collective " + std::to_string(op.seq) + " (" + op.op + ") of " + g;
      }
      if (e.value("p2p", false))
        m.p2p.push_back(std::move(op));
      else
        m.coll[op.seq] = std::move(op);
    }
  }

  void run() {
    std::set<int> without;
    for (auto& [key, g] : groups_)
      for (int r : g.ranks)
        if (!dumped_.count(r) && expected(r)) without.insert(r);
    for (int r = 0; r < world_; ++r)
      if (!dumped_.count(r) && expected(r)) without.insert(r);
    r_.without_dump.assign(without.begin(), without.end());
    if (!without.empty())
      r_.lines.push_back("no dump from rank" + std::string(without.size() == 1 ? " " : "s ") + list(r_.without_dump) +
                         " (frozen, killed before it could dump, or never started; SIGUSR1 to a live worker dumps it)");
    for (auto& [key, g] : groups_) {
      collectives(g);
      transfers(g);
    }
    r_.lines.insert(r_.lines.end(), later_.begin(), later_.end());
    for (auto& [key, g] : groups_) progress(g);
    if (r_.status == 0 && !found_)
      r_.lines.push_back("no mismatch: in every group the ranks' recorded operations agree");
    r_.suspects.assign(suspects_.begin(), suspects_.end());
    if (!r_.suspects.empty()) r_.lines.push_back("suspect rank(s): " + list(r_.suspects));
  }

 private:
  // Whether rank r's dump belongs in this directory (a node's launcher
  // sees its own ranks' only): a rank elsewhere without a dump here is
  // unknown, never a suspect.
  bool expected(int r) const { return here_.empty() || here_.count(r); }
  std::string elsewhere(int r) const { return expected(r) ? "" : " (its dump is on another node)"; }

  Member& member(const std::string& name, const std::vector<int>& ranks, int rank) {
    const std::string key = name + "|" + list(ranks);
    Group& g = groups_[key];
    g.name = name;
    g.ranks = ranks;
    return g.by_rank[rank];
  }

  // `consequence`: every rank it names as missing is blocked in another
  // operation; such findings are listed after the others (the causes).
  void finding(std::string line, const std::vector<int>& suspects, bool consequence = false) {
    (consequence ? later_ : r_.lines).push_back(std::move(line));
    r_.status = 1;
    found_ = true;
    suspects_.insert(suspects.begin(), suspects.end());
  }

  // The first sequence id of `g` its ranks disagree on, or that some
  // member never joined.
  void collectives(const Group& g) {
    std::set<int64_t> seqs;
    for (const auto& [r, m] : g.by_rank)
      for (const auto& [s, op] : m.coll) seqs.insert(s);
    for (int64_t s : seqs) {
      std::vector<int> joined, missing, no_dump, unfinished;
      std::map<std::string, std::vector<int>> keys, ops;
      for (int r : g.ranks) {
        auto it = g.by_rank.find(r);
        if (it == g.by_rank.end()) {
          (dumped_.count(r) ? missing : no_dump).push_back(r);  // a dump without the group: never joined it
          continue;
        }
        const Member& m = it->second;
        auto e = m.coll.find(s);
        if (e == m.coll.end()) {
          // Scheduled but gone from the ring (it wrapped): joined, details lost.
          if (s <= m.last_scheduled) continue;
          missing.push_back(r);
          continue;
        }
        joined.push_back(r);
        keys[e->second.op + " " + e->second.shape].push_back(r);
        ops[e->second.op].push_back(r);
        if (e->second.state != "completed") unfinished.push_back(r);
      }
      if (joined.empty()) continue;
      const std::string op = ops.size() == 1 ? ops.begin()->first + ", " : "";
      const std::string head = "collective " + std::to_string(s) + " (" + op + group_label(g) + ")";
      if (keys.size() > 1) {
        // The ranks in the smallest camp are the odd ones out.
        size_t fewest = SIZE_MAX;
        for (const auto& [k, rs] : keys) fewest = std::min(fewest, rs.size());
        std::vector<int> odd;
        for (const auto& [k, rs] : keys)
          if (rs.size() == fewest) odd.insert(odd.end(), rs.begin(), rs.end());
        if (keys.size() == 2 && fewest * 2 == joined.size()) odd.clear();  // no majority: name both sides only
        const char* what = ops.size() > 1 ? "op" : "sizes or dtypes";
        finding(head + " mismatched " + what + ": " + by_key(keys) + miss_text(missing, no_dump), odd);
        return;
      }
      std::vector<int> lost;  // expected here, no dump: frozen, killed
      for (int r : no_dump)
        if (expected(r)) lost.push_back(r);
      if (!missing.empty() || (!lost.empty() && !unfinished.empty())) {
        // Ranks whose dumps are on another node are neither missing nor
        // present here; they are only named.
        std::vector<int> absent = missing;
        absent.insert(absent.end(), lost.begin(), lost.end());
        std::sort(absent.begin(), absent.end());
        // A missing rank blocked in another operation is a victim of that
        // one (named, not suspected); one with nothing pending skipped this
        // collective, or is stuck outside any (compute, I/O, a deadlock).
        std::string notes;
        std::vector<int> suspects;
        for (int r : absent) {
          auto w = waiting_.find(r);
          if (w == waiting_.end()) {
            suspects.push_back(r);
          } else {
            notes += (notes.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " waits in " + w->second);
          }
        }
        if (!lost.empty()) notes += (notes.empty() ? "" : "; ") + ("no dump from " + list(lost));
        if (lost.size() < no_dump.size())
          notes += (notes.empty() ? "" : "; ") + std::string("other nodes' ranks unknown");
        finding(head + " joined by ranks " + list(joined) + "; missing: " + list(absent) +
                    (notes.empty() ? "" : " (" + notes + ")"),
                suspects, suspects.size() < absent.size());
        return;
      }
      if (!unfinished.empty() && no_dump.empty()) {  // (with ranks elsewhere, nothing to say)
        // Everyone joined with the same call, yet it did not complete: the
        // hang is elsewhere (a rank inside it is stuck on another group).
        std::string err;
        for (int r : unfinished)
          if (const Op& e = g.by_rank.at(r).coll.at(s); !e.error.empty()) {
            err = " (rank " + std::to_string(r) + ": " + e.error.substr(0, 300) + ")";
            break;
          }
        r_.lines.push_back(head + " joined by every rank but not completed on ranks " + list(unfinished) + err);
        return;
      }
    }
  }

  static std::string miss_text(const std::vector<int>& missing, const std::vector<int>& no_dump) {
    std::string s;
    if (!missing.empty()) s += "; missing: " + list(missing);
    if (!no_dump.empty()) s += "; no dump from " + list(no_dump);
    return s;
  }

  // Sends and receives matched by order between each pair (and tag).
  // Sends and receives matched by their message number per sender,
  // receiver and tag (the recorder's `msg`), so rings that wrapped at
  // different points still pair the same messages.
  void transfers(const Group& g) {
    using Key = std::tuple<int, int, int>;  // (src, dst, tag)
    std::map<Key, std::map<int64_t, const Op*>> sends, recvs;
    for (const auto& [r, m] : g.by_rank)
      for (const Op& op : m.p2p) {
        if (op.op == "send") sends[{r, op.peer, op.tag}][op.msg] = &op;
        if (op.op == "recv") recvs[{op.peer, r, op.tag}][op.msg] = &op;
      }
    std::set<Key> pairs;
    for (const auto& [k, s] : sends) pairs.insert(k);
    for (const auto& [k, s] : recvs) pairs.insert(k);
    for (const Key& k : pairs) {
      const auto [src, dst, tag] = k;
      const std::map<int64_t, const Op*>& s = sends[k];
      const std::map<int64_t, const Op*>& v = recvs[k];
      // Each side's newest message is always in its ring: its count.
      const int64_t sent = s.empty() ? 0 : s.rbegin()->first + 1, received = v.empty() ? 0 : v.rbegin()->first + 1;
      const std::string where = " (" + group_label(g) + ", tag " + std::to_string(tag) + ", message ";
      auto body = [](const std::string& shape) { return shape.substr(shape.find(' ') + 1); };
      for (const auto& [i, op] : v)
        if (auto it = s.find(i); it != s.end() && body(it->second->shape) != body(op->shape)) {
          finding("p2p " + std::to_string(src) + " -> " + std::to_string(dst) + where + std::to_string(i + 1) +
                      ") mismatched sizes: rank " + std::to_string(src) + " sends " + it->second->shape + "; rank " +
                      std::to_string(dst) + " receives " + op->shape,
                  {src, dst});
          break;
        }
      auto side = [&](int r, int64_t n, const char* what, const char* dir) {
        if (!dumped_.count(r)) return "no dump from rank " + std::to_string(r) + elsewhere(r);
        return "rank " + std::to_string(r) + " posted " + std::to_string(n) + " " + what + " with that tag " + dir +
               " rank " + std::to_string(r == src ? dst : src);
      };
      auto suspects = [&](int r) { return expected(r) ? std::vector<int>{r} : std::vector<int>{}; };
      for (const auto& [i, op] : v)
        if (i >= sent && op->state != "completed") {
          finding("p2p recv by rank " + std::to_string(dst) + " from rank " + std::to_string(src) + where +
                      std::to_string(i + 1) + ", " + op->shape +
                      ") never matched: " + side(src, sent, "send(s)", "to") + "; sender " + std::to_string(src) +
                      ", receiver " + std::to_string(dst),
                  suspects(src));
          break;
        }
      for (const auto& [i, op] : s)
        if (i >= received && op->state != "completed") {
          finding("p2p send by rank " + std::to_string(src) + " to rank " + std::to_string(dst) + where +
                      std::to_string(i + 1) + ", " + op->shape +
                      ") never received: " + side(dst, received, "recv(s)", "from") + "; sender " +
                      std::to_string(src) + ", receiver " + std::to_string(dst),
                  suspects(dst));
          break;
        }
    }
  }

  void progress(const Group& g) {
    bool any = false;
    std::string s = "  " + group_label(g) + ": last completed collective by rank:";
    for (int r : g.ranks) {
      auto it = g.by_rank.find(r);
      if (it == g.by_rank.end()) {
        s += " " + std::to_string(r) + "=?";
        continue;
      }
      any = any || !it->second.coll.empty() || it->second.last_scheduled >= 0;
      s += " " + std::to_string(r) + "=" + std::to_string(it->second.last_completed);
    }
    if (any) r_.lines.push_back(s);
  }

  TraceReport& r_;
  std::map<std::string, Group> groups_;
  std::set<int> dumped_;
  std::set<int> here_;  // empty: every rank's dump belongs here
  std::set<int> suspects_;
  std::map<int, std::string> waiting_;  // rank -> its oldest unfinished operation
  std::vector<std::string> later_;      // findings that are consequences of others
  int world_ = 0;
  bool found_ = false;
};

}  // namespace

TraceReport analyze_dumps(const std::string& dir, int64_t since_ns, const std::vector<int>& here) {
  TraceReport report;
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    report.status = 2;
    report.lines.push_back("fr_trace: " + dir + " is not a directory");
    return report;
  }
  std::vector<std::string> paths;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("ember_fr_rank", 0) == 0 && e.path().extension() == ".json") paths.push_back(e.path().string());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<Dump> dumps(paths.size());
  std::atomic<size_t> next{0};
  const unsigned n = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), paths.size()));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < n; ++t)
    pool.emplace_back([&] {
      for (size_t i; (i = next++) < paths.size();) dumps[i] = load(paths[i]);
    });
  for (auto& t : pool) t.join();

  Analysis a(report, here);
  std::set<int> seen;
  for (const Dump& d : dumps) {
    if (!d.error.empty()) {
      report.lines.push_back("fr_trace: skipped " + d.error);
      continue;
    }
    if (d.dumped_at_ns < since_ns) continue;  // an earlier job's
    if (!seen.insert(d.rank).second) {
      report.lines.push_back("fr_trace: skipped " + d.path + ": a second dump of rank " + std::to_string(d.rank));
      continue;
    }
    try {
      a.add(d);
      ++report.dumps;
    } catch (const std::exception& e) {
      report.lines.push_back("fr_trace: skipped " + d.path + ": " + e.what());
    }
  }
  if (report.dumps == 0) {
    report.status = 2;
    report.lines.push_back("fr_trace: no flight recorder dump (ember_fr_rank<R>.json) in " + dir);
    return report;
  }
  report.lines.insert(report.lines.begin(), "fr_trace: " + std::to_string(report.dumps) + " dump(s) in " + dir +
                                                " (ranks " + list({seen.begin(), seen.end()}) + ")");
  a.run();
  return report;
}

}  // namespace ember::distributed::fr
