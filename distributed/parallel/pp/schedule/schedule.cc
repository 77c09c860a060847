// The schedule generators, the checker and the simulator (schedule.h).
// Generators produce each rank's compute order only; with_communication
// adds the sends and receives the same way for all of them, so the
// runtime, the checker and the simulator see one kind of list.
#include "distributed/parallel/pp/schedule/schedule.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <map>
#include <sstream>
#include <tuple>

#include "core/exception.h"

namespace ember::distributed::pp {
namespace {

Action F(int mb, int s) { return {ActionKind::F, mb, s}; }
Action B(int mb, int s) { return {ActionKind::B, mb, s}; }
Action W(int mb, int s) { return {ActionKind::W, mb, s}; }

void check_sizes(const std::string& name, int ranks, int v, int m) {
  EMBER_CHECK(ranks >= 1, "pipeline schedule ", name, ": the pp size must be at least 1, got ", ranks);
  EMBER_CHECK(v >= 1, "pipeline schedule ", name, ": virtual stages per rank must be at least 1, got ", v);
  EMBER_CHECK(m >= 1, "pipeline schedule ", name, ": micro-batches must be at least 1, got ", m);
}

// GPipe: every forward, then every backward in reverse (the seeds' figure:
// F1 F2 F3 F4, then B4 B3 B2 B1). A rank's later virtual stages come after
// its earlier ones, each over all micro-batches.
std::vector<std::vector<Action>> gpipe(int P, int V, int M) {
  std::vector<std::vector<Action>> out(P);
  for (int r = 0; r < P; ++r) {
    for (int c = 0; c < V; ++c)
      for (int mb = 0; mb < M; ++mb) out[r].push_back(F(mb, r + c * P));
    for (int c = V - 1; c >= 0; --c)
      for (int mb = M - 1; mb >= 0; --mb) out[r].push_back(B(mb, r + c * P));
  }
  return out;
}

// 1F1B (PipeDream-flush): rank r runs P-1-r forwards, then alternates one
// forward and one backward, then the remaining backwards: at most P-r
// micro-batches' activations alive.
std::vector<std::vector<Action>> one_f_one_b(int P, int M) {
  std::vector<std::vector<Action>> out(P);
  for (int r = 0; r < P; ++r) {
    const int warmup = std::min(P - 1 - r, M);
    int f = 0, b = 0;
    for (; f < warmup; ++f) out[r].push_back(F(f, r));
    for (; f < M; ++f, ++b) out[r].push_back(F(f, r)), out[r].push_back(B(b, r));
    for (; b < M; ++b) out[r].push_back(B(b, r));
  }
  return out;
}

// Megatron-LM's interleaved 1F1B: rank r holds V chunks; micro-batches go
// through them in groups of P (chunk 0 for micro-batches 0..P-1, chunk 1
// for the same, ..., then the next group), backwards mirror it, and the
// warm-up is (P-r-1)*2 + (V-1)*P forwards (all of them when M == P).
std::vector<std::vector<Action>> interleaved(int P, int V, int M) {
  std::vector<std::vector<Action>> out(P);
  const int total = M * V;
  for (int r = 0; r < P; ++r) {
    auto at = [&](int k, bool forward) {
      const int within = k % (P * V), group = k / (P * V);
      const int chunk = forward ? within / P : V - 1 - within / P;
      const int mb = group * P + within % P;
      const int stage = r + chunk * P;
      return forward ? F(mb, stage) : B(mb, stage);
    };
    int warmup = M == P ? total : std::min((P - r - 1) * 2 + (V - 1) * P, total);
    int f = 0, b = 0;
    for (; f < warmup; ++f) out[r].push_back(at(f, true));
    for (; f < total; ++f, ++b) out[r].push_back(at(f, true)), out[r].push_back(at(b, false));
    for (; b < total; ++b) out[r].push_back(at(b, false));
  }
  return out;
}

// ZB-H1 (Qi et al., 2023): 1F1B's order with each backward split, rank
// r running W(k) right after B(k + r) and the last r W's at the end. The
// W's that wait fill the cooldown, where 1F1B's ranks sit waiting for the
// backward chain: the first rank, which waits least, runs each W at once;
// the last, which waits most, keeps r of them back. Peak memory is 1F1B's
// (P micro-batches on the first stage): rank r holds P-r until B, plus r
// waiting for their W.
std::vector<std::vector<Action>> zb_h1(int P, int M) {
  std::vector<std::vector<Action>> out = one_f_one_b(P, M);
  for (int r = 0; r < P; ++r) {
    std::vector<Action> with_w;
    int w = 0;
    for (const Action& a : out[r]) {
      with_w.push_back(a);
      if (a.kind == ActionKind::B && a.mb - r >= 0) with_w.push_back(W(w++, r));
    }
    for (; w < M; ++w) with_w.push_back(W(w, r));
    out[r] = std::move(with_w);
  }
  return out;
}

// The send a receive waits for.
Action send_of(const Action& recv) {
  return recv.kind == ActionKind::RecvF ? Action{ActionKind::SendF, recv.mb, recv.stage - 1}
                                        : Action{ActionKind::SendB, recv.mb, recv.stage + 1};
}

using Key = std::tuple<int, int, int>;  // kind, mb, stage
Key key(const Action& a) { return {static_cast<int>(a.kind), a.mb, a.stage}; }

}  // namespace

const char* action_kind_name(ActionKind k) {
  // Indexed by the enumerator, in ActionKind's order.
  static constexpr const char* kNames[] = {"F", "B", "W", "SendF", "RecvF", "SendB", "RecvB"};
  static_assert(std::size(kNames) == static_cast<size_t>(ActionKind::RecvB) + 1, "a name for every ActionKind");
  const auto i = static_cast<size_t>(k);
  return i < std::size(kNames) ? kNames[i] : "?";
}

std::string Action::str() const {
  return std::string(action_kind_name(kind)) + "(mb " + std::to_string(mb) + ", stage " + std::to_string(stage) + ")";
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int c = 0; c < virtual_stages; ++c) out.push_back(rank + c * ranks);
  return out;
}

bool Schedule::split_backward() const {
  for (const auto& list : actions)
    for (const Action& a : list)
      if (a.kind == ActionKind::W) return true;
  return false;
}

bool Schedule::forward_only() const {
  for (const auto& list : actions)
    for (const Action& a : list)
      if (a.kind == ActionKind::B) return false;
  return true;
}

Schedule forward_schedule(int P, int V, int M) {
  check_sizes("forward", P, V, M);
  std::vector<std::vector<Action>> compute(P);
  // Micro-batch by micro-batch through the rank's stages, lowest first: a
  // stage's input always comes from an earlier entry or another rank.
  for (int r = 0; r < P; ++r)
    for (int mb = 0; mb < M; ++mb)
      for (int c = 0; c < V; ++c) compute[r].push_back(F(mb, r + c * P));
  Schedule s = with_communication("forward", P, V, M, std::move(compute));
  validate(s);
  return s;
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "interleaved", "zb-h1"};
  return names;
}

Schedule with_communication(std::string name, int P, int V, int M, std::vector<std::vector<Action>> compute) {
  check_sizes(name, P, V, M);
  EMBER_CHECK(static_cast<int>(compute.size()) == P, "pipeline schedule ", name, ": ", compute.size(),
              " rank lists for a pp size of ", P);
  Schedule s{std::move(name), P, V, M, {}};
  const int S = s.num_stages();
  s.actions.resize(P);
  for (int r = 0; r < P; ++r) {
    for (const Action& a : compute[r]) {
      const bool prev_remote = a.stage > 0 && s.rank_of(a.stage - 1) != r;
      const bool next_remote = a.stage < S - 1 && s.rank_of(a.stage + 1) != r;
      if (a.kind == ActionKind::F && prev_remote) s.actions[r].push_back({ActionKind::RecvF, a.mb, a.stage});
      if (a.kind == ActionKind::B && next_remote) s.actions[r].push_back({ActionKind::RecvB, a.mb, a.stage});
      s.actions[r].push_back(a);
      if (a.kind == ActionKind::F && next_remote) s.actions[r].push_back({ActionKind::SendF, a.mb, a.stage});
      if (a.kind == ActionKind::B && prev_remote) s.actions[r].push_back({ActionKind::SendB, a.mb, a.stage});
    }
  }
  return s;
}

Schedule make_schedule(const std::string& name, int P, int V, int M) {
  check_sizes(name, P, V, M);
  std::vector<std::vector<Action>> compute;
  if (name == "gpipe") {
    compute = gpipe(P, V, M);
  } else if (name == "1f1b") {
    EMBER_CHECK(V == 1, "pipeline schedule 1f1b runs one stage per rank, got ", V,
                " virtual stages (use --pp-schedule interleaved)");
    compute = one_f_one_b(P, M);
  } else if (name == "interleaved") {
    EMBER_CHECK(V >= 2, "pipeline schedule interleaved needs at least 2 virtual stages per rank, got ", V);
    EMBER_CHECK(M % P == 0, "pipeline schedule interleaved needs the micro-batches (", M,
                ") to be a multiple of the pp size (", P, "), as Megatron-LM's");
    compute = interleaved(P, V, M);
  } else if (name == "zb-h1") {
    EMBER_CHECK(V == 1, "pipeline schedule zb-h1 runs one stage per rank, got ", V, " virtual stages");
    compute = zb_h1(P, M);
  } else {
    std::string known;
    for (const auto& n : schedule_names()) known += (known.empty() ? "" : ", ") + n;
    EMBER_CHECK(false, "unknown pipeline schedule '", name, "' (known: ", known, ")");
  }
  Schedule s = with_communication(name, P, V, M, std::move(compute));
  validate(s);
  return s;
}

void validate(const Schedule& s) {
  const int P = s.ranks, S = s.num_stages(), M = s.microbatches;
  const std::string what = "pipeline schedule " + s.name + ": ";
  EMBER_CHECK(static_cast<int>(s.actions.size()) == P, what, s.actions.size(), " rank lists for a pp size of ", P);
  // Where each action is: rank and position. Each at most once.
  std::map<Key, std::pair<int, int>> at;
  for (int r = 0; r < P; ++r) {
    for (int i = 0; i < static_cast<int>(s.actions[r].size()); ++i) {
      const Action& a = s.actions[r][i];
      EMBER_CHECK(a.mb >= 0 && a.mb < M && a.stage >= 0 && a.stage < S, what, "rank ", r, " runs ", a.str(),
                  ", outside ", M, " micro-batches and ", S, " stages");
      EMBER_CHECK(s.rank_of(a.stage) == r, what, "rank ", r, " runs ", a.str(), ", but rank ", s.rank_of(a.stage),
                  " holds stage ", a.stage, " (rank r holds stages r, r+P, ...)");
      auto [it, fresh] = at.emplace(key(a), std::make_pair(r, i));
      EMBER_CHECK(fresh, what, a.str(), " appears twice on rank ", r, " (at positions ", it->second.second, " and ", i,
                  ")");
    }
  }
  auto find = [&](ActionKind k, int mb, int stage) -> const std::pair<int, int>* {
    auto it = at.find(Key{static_cast<int>(k), mb, stage});
    return it == at.end() ? nullptr : &it->second;
  };
  const bool split = s.split_backward(), fwd_only = s.forward_only();
  for (int st = 0; st < S; ++st) {
    const int r = s.rank_of(st);
    for (int mb = 0; mb < M; ++mb) {
      for (ActionKind k : {ActionKind::F, ActionKind::B, ActionKind::W}) {
        if ((k == ActionKind::W && !split) || (k != ActionKind::F && fwd_only)) continue;
        EMBER_CHECK(find(k, mb, st) != nullptr, what, Action{k, mb, st}.str(), " is missing from rank ", r, "'s list",
                    k == ActionKind::W ? " (the schedule has W actions, so every B needs its W)" : "");
      }
      // Inputs, on the action's own rank, before it.
      auto needs = [&](const Action& a, const Action& dep) {
        const auto* pa = find(a.kind, a.mb, a.stage);
        const auto* pd = find(dep.kind, dep.mb, dep.stage);
        EMBER_CHECK(pd != nullptr, what, a.str(), " on rank ", r, " needs ", dep.str(), ", which no rank runs");
        EMBER_CHECK(pd->first == pa->first && pd->second < pa->second, what, a.str(), " on rank ", r, " needs ",
                    dep.str(), ", which comes ",
                    pd->first == pa->first ? "later in its list" : "on rank " + std::to_string(pd->first));
      };
      const bool prev_remote = st > 0 && s.rank_of(st - 1) != r;
      const bool next_remote = st < S - 1 && s.rank_of(st + 1) != r;
      if (st > 0) needs(F(mb, st), prev_remote ? Action{ActionKind::RecvF, mb, st} : F(mb, st - 1));
      if (next_remote) needs({ActionKind::SendF, mb, st}, F(mb, st));
      if (fwd_only) continue;
      needs(B(mb, st), F(mb, st));
      if (st < S - 1) needs(B(mb, st), next_remote ? Action{ActionKind::RecvB, mb, st} : B(mb, st + 1));
      if (split) needs(W(mb, st), B(mb, st));
      if (prev_remote) needs({ActionKind::SendB, mb, st}, B(mb, st));
    }
  }
  // Sends and receives pair up across ranks.
  for (int r = 0; r < P; ++r)
    for (const Action& a : s.actions[r]) {
      Action peer = a;
      switch (a.kind) {
        case ActionKind::SendF:
          peer = {ActionKind::RecvF, a.mb, a.stage + 1};
          break;
        case ActionKind::RecvF:
          peer = {ActionKind::SendF, a.mb, a.stage - 1};
          break;
        case ActionKind::SendB:
          peer = {ActionKind::RecvB, a.mb, a.stage - 1};
          break;
        case ActionKind::RecvB:
          peer = {ActionKind::SendB, a.mb, a.stage + 1};
          break;
        default:
          continue;
      }
      EMBER_CHECK(peer.stage >= 0 && peer.stage < S && s.rank_of(peer.stage) != r, what, a.str(), " on rank ", r,
                  " has no peer stage on another rank");
      EMBER_CHECK(find(peer.kind, peer.mb, peer.stage) != nullptr, what, a.str(), " on rank ", r, " has no matching ",
                  peer.str(), " on rank ", s.rank_of(peer.stage));
    }
  // Run the lists against each other: sends post at once, a receive waits
  // for its send.
  std::vector<size_t> pc(P, 0);
  std::map<Key, bool> posted;
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      while (pc[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][pc[r]];
        if ((a.kind == ActionKind::RecvF || a.kind == ActionKind::RecvB) && !posted.count(key(send_of(a)))) break;
        if (a.kind == ActionKind::SendF || a.kind == ActionKind::SendB) posted[key(a)] = true;
        ++pc[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < P; ++r) {
    if (pc[r] == s.actions[r].size()) continue;
    const Action& waiting = s.actions[r][pc[r]];
    const Action send = send_of(waiting);
    const int q = s.rank_of(send.stage);
    const Action& stuck = s.actions[q][pc[q]];
    EMBER_CHECK(false, what, "deadlock: rank ", r, "'s ", waiting.str(), " waits for ", send.str(), " on rank ", q,
                ", which comes after rank ", q, "'s ", stuck.str(), ", itself waiting for ", send_of(stuck).str(),
                " on rank ", s.rank_of(send_of(stuck).stage), "; no rank can go on");
  }
}

Simulation simulate(const Schedule& s, const Costs& c, const std::vector<Costs>& per_stage) {
  validate(s);
  EMBER_CHECK(per_stage.empty() || static_cast<int>(per_stage.size()) == s.num_stages(),
              "pipeline simulator: ", per_stage.size(), " stage costs for ", s.num_stages(), " stages");
  EMBER_CHECK(c.f >= 0 && c.b >= 0 && c.w >= 0 && c.comm >= 0, "pipeline simulator: costs must be non-negative");
  const int P = s.ranks;
  const bool split = s.split_backward();
  std::map<Key, double> end;      // compute actions: when they finish; sends: when posted
  std::map<Key, double> arrival;  // receives: when the data is here
  std::vector<double> free(P, 0);
  std::vector<size_t> pc(P, 0);
  Simulation sim;
  sim.busy.resize(P);
  auto ready = [&](const Action& a) -> double {  // inputs' time; the checker ordered them
    const int S = s.num_stages(), r = s.rank_of(a.stage);
    auto local = [&](const Action& d) { return end.at(key(d)); };
    auto recv = [&](ActionKind k) { return arrival.at(Key{static_cast<int>(k), a.mb, a.stage}); };
    switch (a.kind) {
      case ActionKind::F:
        if (a.stage == 0) return 0.0;
        return s.rank_of(a.stage - 1) == r ? local(F(a.mb, a.stage - 1)) : recv(ActionKind::RecvF);
      case ActionKind::B: {
        double t = local(F(a.mb, a.stage));
        if (a.stage < S - 1)
          t = std::max(t, s.rank_of(a.stage + 1) == r ? local(B(a.mb, a.stage + 1)) : recv(ActionKind::RecvB));
        return t;
      }
      default:
        return local(B(a.mb, a.stage));
    }
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      for (; pc[r] < s.actions[r].size(); ++pc[r], progress = true) {
        const Action& a = s.actions[r][pc[r]];
        if (a.kind == ActionKind::SendF) {
          end[key(a)] = end.at(key(F(a.mb, a.stage)));
        } else if (a.kind == ActionKind::SendB) {
          end[key(a)] = end.at(key(B(a.mb, a.stage)));
        } else if (a.kind == ActionKind::RecvF || a.kind == ActionKind::RecvB) {
          auto it = end.find(key(send_of(a)));
          if (it == end.end()) break;  // not posted yet: another rank first
          arrival[key(a)] = it->second + c.comm;
        } else {
          const Costs& sc = per_stage.empty() ? c : per_stage[a.stage];
          const double cost = a.kind == ActionKind::F   ? sc.f
                              : a.kind == ActionKind::W ? sc.w
                              : split                   ? sc.b
                                                        : sc.b + sc.w;
          const double start = std::max(free[r], ready(a));
          free[r] = start + cost;
          end[key(a)] = free[r];
          sim.busy[r].push_back({a, start, free[r]});
        }
      }
    }
  }
  double busy = 0;
  for (int r = 0; r < P; ++r) {
    EMBER_INTERNAL_ASSERT(pc[r] == s.actions[r].size(), "simulate: rank ", r, " did not finish");
    for (const Interval& iv : sim.busy[r]) busy += iv.end - iv.start, sim.makespan = std::max(sim.makespan, iv.end);
  }
  sim.bubble_fraction = sim.makespan > 0 ? 1.0 - busy / (P * sim.makespan) : 0.0;
  sim.peak_live.assign(s.num_stages(), 0);
  std::vector<int> live(s.num_stages(), 0);
  for (int r = 0; r < P; ++r)
    for (const Action& a : s.actions[r]) {
      if (a.kind == ActionKind::F) sim.peak_live[a.stage] = std::max(sim.peak_live[a.stage], ++live[a.stage]);
      if ((a.kind == ActionKind::B && !split) || a.kind == ActionKind::W) --live[a.stage];
    }
  return sim;
}

std::string render_timeline(const Schedule& s, const Simulation& sim, const Costs& c) {
  double q = 1;
  for (double cand : {1.0, 0.5, 0.25, 0.2, 0.1, 0.05, 0.02, 0.01}) {
    q = cand;
    bool fits = true;
    for (double v : {c.f, c.b, c.w, c.comm}) fits = fits && std::fabs(v / q - std::round(v / q)) < 1e-9;
    if (fits) break;
  }
  const int cells = static_cast<int>(std::round(sim.makespan / q));
  auto label = [&](const Action& a) {
    std::string l = std::string(action_kind_name(a.kind)) + std::to_string(a.mb);
    if (s.virtual_stages > 1) l += static_cast<char>('a' + a.stage / s.ranks);
    return l;
  };
  size_t width = 1;
  for (const auto& row : sim.busy)
    for (const Interval& iv : row) width = std::max(width, label(iv.action).size());
  std::ostringstream out;
  if (cells > 2000) {
    out << "(the timeline is " << cells << " cells of " << q << "; too wide to draw)\n";
    return out.str();
  }
  for (int r = 0; r < s.ranks; ++r) {
    out << "rank " << r << " |";
    size_t k = 0;
    for (int i = 0; i < cells; ++i) {
      const double mid = (i + 0.5) * q;
      while (k < sim.busy[r].size() && sim.busy[r][k].end <= mid) ++k;
      std::string cell = ".";
      if (k < sim.busy[r].size() && sim.busy[r][k].start <= mid) cell = label(sim.busy[r][k].action);
      out << ' ' << cell << std::string(width - cell.size(), ' ');
    }
    out << "\n";
  }
  return out.str();
}

double closed_form_bubble(const Schedule& s, const Costs& c) {
  const double P = s.ranks, M = s.microbatches, V = s.virtual_stages;
  if (s.name == "gpipe" && s.virtual_stages == 1) return (P - 1) / (M + P - 1);
  if (s.name == "1f1b") return (P - 1) / (M + P - 1);
  if (s.name == "interleaved") return (P - 1) / (V * M + P - 1);
  if (s.name == "zb-h1") {
    const double idle = (P - 1) * std::max(0.0, c.f + c.b - c.w);
    return idle / (M * (c.f + c.b + c.w) + idle);
  }
  return -1;
}

}  // namespace ember::distributed::pp
