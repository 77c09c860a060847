// //tools:pp_sim: a pipeline schedule's timeline before anything runs — one
// row per rank (as the seeds' figure), the bubble fraction beside its
// closed form, and each stage's peak number of live micro-batch activations.
//
//   bazel run //tools:pp_sim -- --schedule 1f1b --stages 4 --microbatches 8
//   bazel run //tools:pp_sim -- --schedule interleaved --stages 4 --virtual 2 --microbatches 8
//   bazel run //tools:pp_sim -- --schedule zb-h1 --stages 4 --microbatches 8 --tf 1 --tb 1 --tw 1
//
// --stages is the pp size P (ranks); with --virtual V each rank holds V
// stages. Costs are per stage and in any unit: --tb is the input-gradient
// part of a backward and --tw the weight-gradient part (a schedule without
// W actions pays tb + tw per B); --comm the time from a send to its receive.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "core/exception.h"
#include "distributed/parallel/pp/schedule/schedule.h"
#include "examples/cli.h"

namespace {

const char* kUsage =
    "usage: pp_sim --schedule gpipe|1f1b|interleaved|zb-h1 --stages P [--virtual V] --microbatches M\n"
    "              [--tf 1] [--tb 2] [--tw 1] [--comm 0]\n"
    "  prints the timeline (one row per rank), the line 'bubble fraction X' and each stage's peak\n"
    "  number of live micro-batch activations. Without W actions a B costs tb + tw.\n";

// Errors name the program and end with the usage (exit 2), as the examples' do.
const ember::examples::Cli kCli{"pp_sim", kUsage};

double number(const std::string& flag, const char* text, bool whole) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(v >= 0) || (whole && (v < 1 || v != static_cast<int>(v))))
    kCli.error(flag + " wants " + (whole ? "a positive whole number" : "a non-negative number") + ", got '" + text +
               "'");
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ember::distributed::pp;
  std::string name;
  int P = 0, V = 1, M = 0;
  // Defaults: B twice F (the usual estimate), split as B = W = F for zero-bubble.
  double tf = 1, tb = -1, tw = -1, comm = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) kCli.error(a + " needs a value");
    const char* v = argv[++i];
    if (a == "--schedule")
      name = v;
    else if (a == "--stages")
      P = static_cast<int>(number(a, v, true));
    else if (a == "--virtual")
      V = static_cast<int>(number(a, v, true));
    else if (a == "--microbatches")
      M = static_cast<int>(number(a, v, true));
    else if (a == "--tf")
      tf = number(a, v, false);
    else if (a == "--tb")
      tb = number(a, v, false);
    else if (a == "--tw")
      tw = number(a, v, false);
    else if (a == "--comm")
      comm = number(a, v, false);
    else
      kCli.error("unknown flag '" + a + "'");
  }
  if (name.empty() || P == 0 || M == 0) kCli.error("--schedule, --stages and --microbatches are required");
  try {
    const Schedule s = make_schedule(name, P, V, M);
    const bool split = s.split_backward();
    // Unset: a whole backward costs 2 F, split into equal B and W.
    if (tb < 0 && tw < 0)
      tb = split ? tf : 2 * tf, tw = split ? tf : 0;
    else if (tb < 0)
      tb = tf;
    else if (tw < 0)
      tw = split ? tf : 0;
    const Costs costs{.f = tf, .b = tb, .w = tw, .comm = comm};
    const Simulation sim = simulate(s, costs);
    std::printf("schedule %s: %d rank(s) x %d stage(s) each, %d micro-batches; F %g, B %g, W %g%s, comm %g\n",
                name.c_str(), P, V, M, tf, split ? tb : tb + tw, tw, split ? "" : " (in B)", comm);
    std::fputs(render_timeline(s, sim, costs).c_str(), stdout);
    std::printf("makespan %g\n", sim.makespan);
    std::printf("bubble fraction %.6f\n", sim.bubble_fraction);
    const double closed = closed_form_bubble(s, costs);
    if (closed >= 0 && comm == 0) std::printf("closed form %.6f\n", closed);
    std::printf("peak live micro-batches per stage:");
    for (size_t st = 0; st < sim.peak_live.size(); ++st) std::printf(" %zu:%d", st, sim.peak_live[st]);
    std::printf("\n");
  } catch (const ember::Error& e) {
    std::fprintf(stderr, "pp_sim: %s\n", e.what());
    return 1;
  }
  return 0;
}
