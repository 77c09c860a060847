// Pipeline schedules as data: for each rank of the `pp` dimension, the list
// of actions it runs in one step — F(mb, stage), B(mb, stage), W(mb,
// stage) and the sends and receives between stages — made by a generator
// function, checked before anything runs, simulated with given costs, and
// executed by the one runtime (pipeline.h) whatever produced it.
//
//   Schedule s = make_schedule("1f1b", /*ranks=*/4, /*virtual_stages=*/1, /*microbatches=*/8);
//   validate(s);                                 // throws naming the two actions of a deadlock
//   Simulation sim = simulate(s, {.f = 1, .b = 2});
//   std::cout << render_timeline(s, sim);       // one row per rank, as the seeds' figure
//   sim.bubble_fraction;                        // 3/11
//
// Stages: P ranks hold P*V stages, rank r the stages r, r+P, r+2P, ...
// (Megatron's interleaving; V = 1 is a plain pipeline). Micro-batches and
// stages count from 0. A B is the whole backward of a micro-batch through a
// stage unless the schedule also has a W for it: then B computes only the
// input gradient (what the previous stage waits for) and W the weights'
// gradients later (zero-bubble, Qi et al. 2023; autograd's backward_input).
//
// Communication is explicit: SendF(mb, s) sends stage s's output to stage
// s+1, whose RecvF(mb, s+1) receives it; SendB(mb, s) sends the gradient of
// stage s's input to stage s-1, whose RecvB(mb, s-1) receives it. Stages on
// one rank hand over locally (no action). Sends are asynchronous (they never
// block the sender); a receive blocks until its send was posted. Under
// those rules validate() runs the lists against each other and reports a
// receive that can never complete before the first step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ember::distributed::pp {

enum class ActionKind { F, B, W, SendF, RecvF, SendB, RecvB };
const char* action_kind_name(ActionKind k);

struct Action {
  ActionKind kind;
  int mb = 0;     // micro-batch
  int stage = 0;  // the stage that runs it
  bool operator==(const Action& o) const { return kind == o.kind && mb == o.mb && stage == o.stage; }
  bool is_compute() const { return kind == ActionKind::F || kind == ActionKind::B || kind == ActionKind::W; }
  // "F(mb 3, stage 1)".
  std::string str() const;
};

struct Schedule {
  std::string name;
  int ranks = 1;                             // P: the pp dimension's size
  int virtual_stages = 1;                    // V: stages per rank
  int microbatches = 1;                      // M
  std::vector<std::vector<Action>> actions;  // per rank
  int num_stages() const { return ranks * virtual_stages; }
  int rank_of(int stage) const { return stage % ranks; }
  // The stages rank r holds, in order: r, r+P, ...
  std::vector<int> stages_of(int rank) const;
  // True when the schedule splits backward into B and W.
  bool split_backward() const;
  // True when it has no backward at all (forward_schedule).
  bool forward_only() const;
};

// The names make_schedule knows, for flags and errors.
const std::vector<std::string>& schedule_names();

// A schedule by name, and the virtual stages per rank (V) each takes:
//   "gpipe"        any V >= 1 (a rank's V stages run as consecutive stages
//                  of a longer pipeline, each over all micro-batches)
//   "1f1b"         V = 1 only (for V >= 2, "interleaved")
//   "interleaved"  interleaved 1F1B: V >= 2 only, and M a multiple of P
//   "zb-h1"        V = 1 only
// P and M must be at least 1. Errors name the argument that does not fit.
Schedule make_schedule(const std::string& name, int ranks, int virtual_stages, int microbatches);

// Forwards only (evaluation): every rank runs its stages' forwards in
// micro-batch order, nothing backward. The runtime runs it without
// recording the graph.
Schedule forward_schedule(int ranks, int virtual_stages, int microbatches);

// The compute order of each rank (F/B/W only) made into a full schedule:
// each receive placed just before the action that needs it, each send
// just after the action that produced it. What every generator ends with;
// for hand-written schedules too.
Schedule with_communication(std::string name, int ranks, int virtual_stages, int microbatches,
                            std::vector<std::vector<Action>> compute);

// Checks a schedule completely before it runs: every action on the rank
// that holds its stage; each (mb, stage) forwarded and backwarded exactly
// once (a W for all or none); each action after those it needs on its own
// rank; every send with its receive and the reverse; and, running the
// lists against each other, no receive waiting for a send that can never
// come (a deadlock, reported naming the waiting receive and the send, and
// where the sending rank is stuck). Throws ember::Error.
void validate(const Schedule& s);

// ---- The simulator ----

// Costs in any unit: a stage's forward, backward (B; without a W it does
// B's and W's work: b + w), weight gradient, and the time from a send to
// its receive.
struct Costs {
  double f = 1, b = 2, w = 1, comm = 0;
};

struct Interval {
  Action action;
  double start = 0, end = 0;
};

struct Simulation {
  std::vector<std::vector<Interval>> busy;  // per rank, compute actions in time order
  double makespan = 0;
  // Idle share of the ranks' time between the step's start and its end:
  // 1 - sum(busy) / (P * makespan).
  double bubble_fraction = 0;
  // Per stage: the most micro-batches whose activations it holds at once
  // (from F until B, or until W when backward is split).
  std::vector<int> peak_live;
};

// Runs the schedule with the given costs: each rank runs its list in order,
// an action starts when its rank is free and its inputs have arrived.
// Calls validate() first. `per_stage` (one entry per stage), where given,
// sets each stage's own F, B and W (a last stage with the LM head and the
// loss costs more); `costs.comm` applies to every transfer.
Simulation simulate(const Schedule& s, const Costs& costs, const std::vector<Costs>& per_stage = {});

// The timeline as text: one row per rank, one cell per time quantum (the
// largest of 1, 0.5, 0.25, 0.2, 0.1, ... that divides every cost), each
// compute action's label in every cell it covers ("F3", or "F3b" for a
// rank's second virtual stage), "." where the rank is idle.
std::string render_timeline(const Schedule& s, const Simulation& sim, const Costs& costs);

// The closed-form bubble of the schedule with unit-free costs, where one
// is known: gpipe/1f1b (P-1)/(M+P-1); interleaved (P-1)/(V*M+P-1);
// zb-h1 (P-1)(f+b-w) / (M(f+b+w) + (P-1)(f+b-w)) (Qi et al.'s ZB-H1);
// negative when none is.
double closed_form_bubble(const Schedule& s, const Costs& costs);

}  // namespace ember::distributed::pp
