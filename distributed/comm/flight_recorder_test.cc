// The flight recorder (flight_recorder.h) and fr_trace (fr_trace.h):
//   * real Gloo groups on 2 processes: every operation's entry (op, group
//     name and ranks, sequence id, sizes, dtypes, peer, state, times) read
//     back from the ring and from the JSON dump; SIGUSR1 dumps;
//   * the ring's overflow and recording off (EMBER_FR_BUFFER=0);
//   * fr_trace on dumps made by recorders standing in for the ranks of a
//     job: a rank that never joined, mismatched sizes and ops, unmatched
//     transfers both ways, a rank without a dump, a job whose ranks agree,
//     unreadable files, and a 64-rank job with full rings.
#include "distributed/comm/flight_recorder.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/ops.h"
#include "distributed/comm/fr_trace.h"
#include "distributed/comm/process_group.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed {
namespace {

namespace mp = testing;
namespace fs = std::filesystem;
using nlohmann::json;

std::string fresh_dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  fs::path d = fs::path(tmp ? tmp : "/tmp") / ("fr_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

// ---- Real groups ----

EMBER_WORKER(fr_records_every_op) {
  const std::string dir = env.arg;
  mp::init_world(env, std::chrono::seconds(20));
  auto pg = default_group();
  fr::FlightRecorder& rec = fr::FlightRecorder::get();
  rec.clear();
  Tensor x = ember::full({2, 3}, 1.0);
  pg->allreduce(x)->wait();
  Tensor out = ember::zeros({8}, DType::Float64);
  {
    fr::CallerTag tag("test all-gather");
    pg->allgather_into_tensor(out, ember::ones({4}, DType::Float64))->wait();
  }
  Tensor msg = ember::ones({5}, DType::Int64);
  if (env.rank == 0) pg->send(msg, 1, 7)->wait();
  if (env.rank == 1) pg->recv(msg, 0, 7)->wait();
  auto sub = new_group({0, 1});
  pg->barrier()->wait();
  sub->allreduce(x)->wait();

  std::vector<fr::Entry> es = rec.entries();
  WCHECK(es.size() == 5, "rank ", env.rank, ": ", es.size(), " entries");
  const char* ops[] = {"allreduce", "allgather_into_tensor", env.rank == 0 ? "send" : "recv", "barrier", "allreduce"};
  for (size_t i = 0; i < es.size(); ++i) {
    WCHECK(std::string(es[i].op) == ops[i], "entry ", i, " is ", es[i].op);
    WCHECK(es[i].state == fr::State::Completed, "entry ", i, " is ", fr::state_name(es[i].state));
    WCHECK(es[i].created_ns > 0 && es[i].started_ns >= es[i].created_ns && es[i].completed_ns >= es[i].started_ns,
           "entry ", i, " times");
    WCHECK(es[i].timeout_ms == 20000, "entry ", i, " timeout ", es[i].timeout_ms);
  }
  WCHECK(es[0].group->name == "default" && es[0].group->ranks == std::vector<int>({0, 1}), "group of entry 0");
  WCHECK(es[0].seq == 0 && es[1].seq == 1 && es[3].seq == 2, "collective seqs ", es[0].seq, es[1].seq, es[3].seq);
  WCHECK(es[0].inputs.size() == 1 && es[0].inputs[0].sizes == Shape({2, 3}), "allreduce sizes");
  WCHECK(es[1].outputs[0].sizes == Shape({8}) && es[1].outputs[0].dtype == DType::Float64, "all-gather output");
  WCHECK(std::string(es[1].caller) == "test all-gather", "caller tag ", es[1].caller);
  WCHECK(es[2].p2p && es[2].peer == 1 - env.rank && es[2].tag == 7 && es[2].seq == 0, "p2p entry");
  WCHECK(es[4].group->name == "group_1" && es[4].seq == 0, "sub-group entry ", es[4].group->name, " ", es[4].seq);

  const std::string path = rec.dump("test", dir);
  WCHECK(path == fr::dump_path(dir, env.rank), path);
  json j = read_json(path);
  WCHECK(j["format"] == "ember_flight_recorder" && j["version"] == 1 && j["rank"] == env.rank && j["world_size"] == 2 &&
             j["reason"] == "test" && j["buffer_size"] == 2000,
         j.dump());
  WCHECK(j["entries"].size() == 5, "dumped entries");
  const json& e1 = j["entries"][1];
  WCHECK(e1["op"] == "allgather_into_tensor" && e1["group"] == "default" && e1["seq"] == 1 &&
             e1["input_sizes"] == json::parse("[[4]]") && e1["output_dtypes"] == json::parse("[\"float64\"]") &&
             e1["state"] == "completed" && e1["caller"] == "test all-gather" && !e1["frame"].get<std::string>().empty(),
         e1.dump());
  WCHECK(j["entries"][2]["peer"] == 1 - env.rank, "dumped peer");
  bool found = false;
  for (const json& g : j["groups"])
    if (g["name"] == "default") {
      found = true;
      WCHECK(g["last_completed_seq"] == 2 && g["last_scheduled_seq"] == 2 && g["p2p_completed"] == 1, g.dump());
    }
  WCHECK(found, "no default group in ", j["groups"].dump());
  pg->barrier()->wait();
}

TEST(FlightRecorder, RecordsEveryOpOfRealGroups) {
  const std::string dir = fresh_dir("real");
  EMBER_EXPECT_RANKS("fr_records_every_op", 2, {.arg = dir});
  // The two dumps agree: fr_trace finds nothing.
  fr::TraceReport r = fr::analyze_dumps(dir);
  std::string all;
  for (const auto& l : r.lines) all += l + "\n";
  EXPECT_EQ(r.status, 0) << all;
  EXPECT_EQ(r.dumps, 2) << all;
  EXPECT_NE(all.find("no mismatch"), std::string::npos) << all;
}

// A failed collective dumps the ring on its own (the first failure).
EMBER_WORKER(fr_dumps_on_timeout) {
  setenv("EMBER_FR_DUMP_DIR", env.arg.c_str(), 1);
  mp::init_world(env, std::chrono::milliseconds(1500));
  auto pg = default_group();
  Tensor x = ember::ones({4});
  pg->allreduce(x)->wait();
  if (env.rank == 1) {
    // Never joins the second all-reduce; waits for rank 0's dump instead.
    for (int i = 0; i < 200 && !fs::exists(fr::dump_path(env.arg, 0)); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    WCHECK(fs::exists(fr::dump_path(env.arg, 0)), "rank 0 did not dump");
    fr::dump_flight_recorder("test: rank 1 asked");
    return;
  }
  bool failed = false;
  try {
    pg->allreduce(x)->wait();
  } catch (const Error&) {
    failed = true;
  }
  WCHECK(failed, "the all-reduce rank 1 skipped did not fail");
}

TEST(FlightRecorder, TimeoutDumpsAndFrTraceNamesTheMissingRank) {
  const std::string dir = fresh_dir("timeout");
  EMBER_EXPECT_RANKS("fr_dumps_on_timeout", 2, {.arg = dir});
  json j = read_json(fr::dump_path(dir, 0));
  EXPECT_NE(j["reason"].get<std::string>().find("timed out"), std::string::npos) << j["reason"];
  const json& last = j["entries"].back();
  EXPECT_EQ(last["state"], "failed");
  EXPECT_EQ(last["seq"], 1);
  fr::TraceReport r = fr::analyze_dumps(dir);
  std::string all;
  for (const auto& l : r.lines) all += l + "\n";
  EXPECT_EQ(r.status, 1) << all;
  EXPECT_NE(all.find("collective 1 (allreduce, group default [0,1]) joined by ranks 0; missing: 1"), std::string::npos)
      << all;
  EXPECT_EQ(r.suspects, std::vector<int>({1})) << all;
}

EMBER_WORKER(fr_sigusr1_dumps) {
  setenv("EMBER_FR_DUMP_DIR", env.arg.c_str(), 1);
  mp::init_world(env);
  default_group()->barrier()->wait();
  ::kill(getpid(), SIGUSR1);
  const std::string path = fr::dump_path(env.arg, env.rank);
  for (int i = 0; i < 200 && !fs::exists(path); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  WCHECK(fs::exists(path), "no dump after SIGUSR1 at ", path);
  json j = read_json(path);
  WCHECK(j["reason"] == "SIGUSR1" && j["rank"] == env.rank, j["reason"]);
}

TEST(FlightRecorder, Sigusr1Dumps) {
  const std::string dir = fresh_dir("usr1");
  EMBER_EXPECT_RANKS("fr_sigusr1_dumps", 2, {.arg = dir});
}

// ---- The ring ----

struct Job {
  std::string dir;
  int world;
  std::vector<std::unique_ptr<fr::FlightRecorder>> recs;
  std::shared_ptr<fr::GroupDesc> world_group;
  Job(const std::string& name, int w, int64_t capacity = 100) : dir(fresh_dir(name)), world(w) {
    world_group = group("default", all());
    for (int r = 0; r < w; ++r) {
      recs.push_back(std::make_unique<fr::FlightRecorder>(capacity));
      recs.back()->set_identity(r, w);
    }
  }
  std::vector<int> all() const {
    std::vector<int> v;
    for (int r = 0; r < world; ++r) v.push_back(r);
    return v;
  }
  static std::shared_ptr<fr::GroupDesc> group(const std::string& name, std::vector<int> ranks) {
    auto g = std::make_shared<fr::GroupDesc>();
    g->name = name;
    g->ranks = std::move(ranks);
    g->backend = "gloo";
    return g;
  }
  // One op on rank r: recorded, then completed unless `done` is false.
  void op(int r, const std::shared_ptr<fr::GroupDesc>& g, const char* name, int64_t seq, Shape in, bool done = true,
          bool p2p = false, int peer = -1) {
    std::vector<fr::TensorMeta> ins, outs;
    if (std::string(name) == "recv")
      outs.push_back({in, DType::Float32});
    else
      ins.push_back({in, DType::Float32});
    fr::PendingCall call(g, ins, outs, peer, 0, nullptr);
    const int64_t id = recs[r]->record_op(name, p2p, seq, 1000);
    recs[r]->started(id);
    if (done) recs[r]->finished(id);
  }
  void dump(std::vector<int> skip = {}) {
    for (int r = 0; r < world; ++r)
      if (std::find(skip.begin(), skip.end(), r) == skip.end()) recs[r]->dump("test", dir);
  }
  std::string verdict(fr::TraceReport* out = nullptr) {
    fr::TraceReport r = fr::analyze_dumps(dir);
    std::string all = "status " + std::to_string(r.status) + "\n";
    for (const auto& l : r.lines) all += l + "\n";
    if (out) *out = r;
    return all;
  }
};

TEST(FlightRecorder, RingKeepsTheNewestEntries) {
  fr::FlightRecorder rec(3);
  auto g = Job::group("default", {0, 1});
  std::vector<int64_t> ids;
  for (int i = 0; i < 5; ++i) {
    fr::PendingCall call(g, {}, {}, -1, 0, nullptr);
    ids.push_back(rec.record_op("allreduce", false, i, 10));
  }
  rec.finished(ids[0]);  // overwritten: ignored
  rec.finished(ids[4]);
  std::vector<fr::Entry> es = rec.entries();
  ASSERT_EQ(es.size(), 3u);
  EXPECT_EQ(es[0].id, 2);
  EXPECT_EQ(es[2].id, 4);
  EXPECT_EQ(es[2].state, fr::State::Completed);
  EXPECT_EQ(es[1].state, fr::State::Scheduled);
  rec.finished(ids[3], "boom");
  EXPECT_EQ(rec.entries()[1].state, fr::State::Failed);
  EXPECT_EQ(rec.entries()[1].error, "boom");
  // The group's progress survives the wrap.
  json j = json::parse(rec.dump_json("x"));
  EXPECT_EQ(j["groups"][0]["last_scheduled_seq"], 4);
  EXPECT_EQ(j["groups"][0]["last_completed_seq"], 4);
  EXPECT_EQ(j["recorded"], 5);

  fr::FlightRecorder off(0);
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(off.record_op("allreduce", false, 0, 10), -1);
  EXPECT_TRUE(off.entries().empty());
}

// ---- fr_trace ----

TEST(FrTrace, NamesTheRankThatNeverJoined) {
  Job job("missing", 4);
  for (int r = 0; r < 4; ++r)
    for (int s = 0; s < 6; ++s)
      if (!(r == 2 && s == 5)) job.op(r, job.world_group, "allreduce", s, {16}, s < 5);
  job.dump();
  fr::TraceReport rep;
  const std::string v = job.verdict(&rep);
  EXPECT_EQ(rep.status, 1) << v;
  EXPECT_NE(v.find("collective 5 (allreduce, group default [0,1,2,3]) joined by ranks 0,1,3; missing: 2"),
            std::string::npos)
      << v;
  EXPECT_NE(v.find("last completed collective by rank: 0=4 1=4 2=4 3=4"), std::string::npos) << v;
  EXPECT_EQ(rep.suspects, std::vector<int>({2})) << v;
}

TEST(FrTrace, NamesMismatchedSizesAndOps) {
  Job job("sizes", 4);
  auto dp = Job::group("dp_shard", {0, 2});
  for (int r = 0; r < 4; ++r) {
    job.op(r, job.world_group, "allreduce", 0, {4});
    job.op(r, job.world_group, "allgather_into_tensor", 1, {r == 1 ? 8 : 4}, false);
  }
  job.op(0, dp, "allreduce", 0, {3}, false);
  job.op(2, dp, "barrier", 0, {}, false);
  job.dump();
  fr::TraceReport rep;
  const std::string v = job.verdict(&rep);
  EXPECT_EQ(rep.status, 1) << v;
  EXPECT_NE(
      v.find("collective 1 (allgather_into_tensor, group default [0,1,2,3]) mismatched sizes or dtypes: "
             "ranks 0,2,3 allgather_into_tensor input [4] float32; rank 1 allgather_into_tensor input [8] float32"),
      std::string::npos)
      << v;
  EXPECT_NE(v.find("collective 0 (group dp_shard [0,2]) mismatched op: rank 0 allreduce input [3] float32; rank 2 "
                   "barrier input [] float32"),
            std::string::npos)
      << v;
  EXPECT_EQ(rep.suspects, std::vector<int>({1})) << v;  // a 1-1 split names no side
}

TEST(FrTrace, NamesUnmatchedTransfers) {
  Job job("p2p", 3);
  auto pp = Job::group("pp", {0, 1, 2});
  for (int k = 0; k < 2; ++k) {
    job.op(0, pp, "send", k, {4, 8}, true, true, 1);
    job.op(1, pp, "recv", k, {4, 8}, true, true, 0);
  }
  job.op(1, pp, "recv", 2, {4, 8}, false, true, 0);  // stage 0 never sends the third
  job.op(1, pp, "send", 3, {4, 8}, false, true, 2);  // stage 2 never receives
  job.dump();
  fr::TraceReport rep;
  const std::string v = job.verdict(&rep);
  EXPECT_EQ(rep.status, 1) << v;
  EXPECT_NE(v.find("p2p recv by rank 1 from rank 0 (group pp [0,1,2], tag 0, message 3, output [4,8] float32) never "
                   "matched: rank 0 posted 2 send(s) with that tag to rank 1; sender 0, receiver 1"),
            std::string::npos)
      << v;
  EXPECT_NE(v.find("p2p send by rank 1 to rank 2 (group pp [0,1,2], tag 0, message 1, input [4,8] float32) never "
                   "received: rank 2 posted 0 recv(s) with that tag from rank 1; sender 1, receiver 2"),
            std::string::npos)
      << v;
}

TEST(FrTrace, NamesARankWithoutADump) {
  Job job("frozen", 4);
  for (int r = 0; r < 4; ++r)
    for (int s = 0; s < 3; ++s) job.op(r, job.world_group, "allreduce", s, {16}, s < 2 || r == 1);
  job.dump({1});  // frozen: never dumps
  fr::TraceReport rep;
  const std::string v = job.verdict(&rep);
  EXPECT_EQ(rep.status, 1) << v;
  EXPECT_NE(v.find("no dump from rank 1 "), std::string::npos) << v;
  EXPECT_NE(v.find("collective 2 (allreduce, group default [0,1,2,3]) joined by ranks 0,2,3; missing: 1 (no dump "
                   "from 1)"),
            std::string::npos)
      << v;
  EXPECT_EQ(rep.without_dump, std::vector<int>({1}));
}

TEST(FrTrace, AgreeingRanksAndBadInput) {
  Job job("agree", 2);
  for (int r = 0; r < 2; ++r)
    for (int s = 0; s < 3; ++s) job.op(r, job.world_group, "allreduce", s, {16});
  job.dump();
  fr::TraceReport rep;
  std::string v = job.verdict(&rep);
  EXPECT_EQ(rep.status, 0) << v;
  // Another file in the directory is skipped, named.
  std::ofstream(job.dir + "/ember_fr_rank9.json") << "{not json";
  v = job.verdict(&rep);
  EXPECT_EQ(rep.status, 0) << v;
  EXPECT_NE(v.find("fr_trace: skipped " + job.dir + "/ember_fr_rank9.json"), std::string::npos) << v;
  // Nothing to read.
  const std::string empty = fresh_dir("empty");
  rep = fr::analyze_dumps(empty);
  EXPECT_EQ(rep.status, 2);
  rep = fr::analyze_dumps(empty + "/nope");
  EXPECT_EQ(rep.status, 2);
  ASSERT_FALSE(rep.lines.empty());
  EXPECT_NE(rep.lines[0].find("is not a directory"), std::string::npos);
}

// The uneven all-to-all's sizes differ by rank by design; a node's
// launcher reads only its ranks' dumps and names no other rank.
TEST(FrTrace, UnevenAllToAllAndOtherNodes) {
  Job job("a2av", 4);
  for (int r = 0; r < 4; ++r) {
    job.op(r, job.world_group, "all_to_all_v", 0, {3 + r, 8});
    job.op(r, job.world_group, "allreduce", 1, {4}, r != 3);
  }
  job.dump({2, 3});  // ranks 2 and 3 dump on another node
  fr::TraceReport rep = fr::analyze_dumps(job.dir, 0, {0, 1});
  std::string v;
  for (const auto& l : rep.lines) v += l + "\n";
  EXPECT_EQ(rep.status, 0) << v;
  EXPECT_EQ(v.find("no dump"), std::string::npos) << v;
  EXPECT_TRUE(rep.suspects.empty()) << v;
  // All four here: rank 3 never completed the all-reduce the others did,
  // and no all-to-all is called a mismatch.
  job.dump();
  rep = fr::analyze_dumps(job.dir);
  v.clear();
  for (const auto& l : rep.lines) v += l + "\n";
  EXPECT_EQ(v.find("all_to_all_v"), std::string::npos) << v;
  EXPECT_EQ(v.find("mismatched"), std::string::npos) << v;
}

// Transfers are matched by message number: rings that wrapped at different
// points (the receiver keeps 3 of its messages, the sender all 8) still
// pair message 8 with message 8.
TEST(FrTrace, TransfersMatchAcrossWrappedRings) {
  Job job("p2pwrap", 2, 8);
  auto pp = Job::group("pp", {0, 1});
  for (int k = 0; k < 8; ++k) job.op(0, pp, "send", k, {4}, true, true, 1);
  for (int k = 0; k < 8; ++k) job.op(1, pp, "recv", k, {4}, true, true, 0);
  for (int k = 0; k < 5; ++k) job.op(1, job.world_group, "allreduce", k, {1});  // rank 1's ring wraps
  job.op(1, pp, "recv", 8, {4}, false, true, 0);                                // the 9th: never sent
  job.dump();
  fr::TraceReport rep;
  const std::string v = job.verdict(&rep);
  EXPECT_NE(v.find("p2p recv by rank 1 from rank 0 (group pp [0,1], tag 0, message 9, output [4] float32) never "
                   "matched: rank 0 posted 8 send(s) with that tag to rank 1"),
            std::string::npos)
      << v;
  EXPECT_EQ(v.find("mismatched"), std::string::npos) << v;
}

// 64 ranks, full rings of 2,000 entries each (a default group and 8 dp
// groups of 8): rank 37 never joined its dp group's last all-reduce. The
// time is printed (the figure //tools:fr_trace reports in docs/reliability.md
// comes from an opt build on the same dumps: FR_TRACE_KEEP=dir keeps them).
TEST(FrTrace, SixtyFourRankJob) {
  const int world = 64, cap = 2000;
  Job job("sim64", world, cap);
  std::vector<std::shared_ptr<fr::GroupDesc>> dp(8);
  for (int g = 0; g < 8; ++g) {
    std::vector<int> ranks;
    for (int k = 0; k < 8; ++k) ranks.push_back(g * 8 + k);
    dp[g] = Job::group("dp_shard", ranks);
  }
  const int steps = 1100;  // 2 ops a step: the rings wrap
  for (int r = 0; r < world; ++r)
    for (int s = 0; s < steps; ++s) {
      const bool last = s == steps - 1;
      job.op(r, job.world_group, "allreduce", s, {1024}, true);
      if (!(last && r == 37)) job.op(r, dp[r / 8], "reduce_scatter_tensor", s, {4096, 8}, !last);
    }
  job.dump();
  if (const char* keep = std::getenv("FR_TRACE_KEEP")) fs::copy(job.dir, keep, fs::copy_options::recursive);
  const auto t0 = std::chrono::steady_clock::now();
  fr::TraceReport rep;
  const std::string v = job.verdict(&rep);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fr_trace on 64 ranks x %d entries: %.3f s\n", cap, secs);
  EXPECT_EQ(rep.status, 1) << v;
  EXPECT_EQ(rep.dumps, 64);
  EXPECT_NE(v.find("collective 1099 (reduce_scatter_tensor, group dp_shard [32,33,34,35,36,37,38,39]) joined by ranks "
                   "32,33,34,35,36,38,39; missing: 37"),
            std::string::npos)
      << v.substr(0, 2000);
  EXPECT_EQ(rep.suspects, std::vector<int>({37}));
}

}  // namespace
}  // namespace ember::distributed
