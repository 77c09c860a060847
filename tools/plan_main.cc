// //tools:plan: which mesh to train a model with. For every
// dp_replicate x dp_shard x cp x tp x pp mesh of --gpus (with its pipeline
// schedule, cp's exchange, micro-batches, activation checkpointing and CPU offload) it
// predicts per-rank memory and the step time (distributed/parallel/
// mesh_plan.h), prints the fastest that fit and why the others were
// rejected.
//
//   bazel run //tools:plan -- --model llama-70b --gpus 64 --gpus-per-host 8 --mem-per-gpu 80GiB --global-batch 64
//   bazel run //tools:plan -- --layers 4 --dim 32 --heads 4 --vocab 114 --seq 16 --gpus 8 --mem-per-gpu 1GiB \
//       --global-batch 8 --dtype fp32
//
// --explain prints the best mesh's predicted step term by term (step_cost.h);
// giving the mesh (--dp-shard, --tp, --pp, ... as //examples:gpt takes them)
// predicts that one only. --compute-profile and --comm-fit predict this
// machine's CPU ranks from //bench:compute_profile's and
// //bench:collectives_fit's measurements instead of the GPU's figures:
//
//   bazel run -c opt //tools:plan -- --layers 2 --dim 128 --heads 4 --vocab 114 --seq 64 --gpus 4 \
//       --global-batch 64 --dtype fp32 --dp-shard 2 --tp 2 --explain --step-allreduces 2 \
//       --compute-profile bench/results/compute_profile.json --comm-fit bench/results/collectives_fit.json
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "core/exception.h"
#include "distributed/parallel/comm_cost.h"
#include "distributed/parallel/mesh_plan.h"
#include "distributed/parallel/step_cost.h"
#include "examples/cli.h"

namespace {

const char* kUsage =
    "usage: plan (--model NAME | --layers L --dim D --heads H --vocab V --seq S [--kv-heads K] [--ffn F]\n"
    "             [--swiglu] [--tied]) [--moe-experts E --moe-top-k K --moe-every N --moe-hidden H --moe-shared S]\n"
    "             --gpus N [--gpus-per-host G] [--mem-per-gpu 80GiB] --global-batch B\n"
    "             [--dtype bf16|fp16|fp32] [--optimizer adamw|adam|sgd] [--top K]\n"
    "             [--peak-tflops T] [--efficiency E] [--intra-host-gbps B] [--inter-host-gbps B]\n"
    "             [--explain] [--dp-replicate R --dp-shard S --tp T --pp P --pp-schedule X --pp-virtual V\n"
    "              --microbatches M --strategy full|hybrid|grad_op|no_shard|ddp|zero1 --ac none|full --sp on|off\n"
    "              --cp C --cp-exchange ring|allgather|alltoall --ep E]\n"
    "             [--compute-profile FILE --comm-fit FILE [--cores C]] [--step-allreduces K]\n"
    "             [--failures-per-gpu-day F] [--ckpt-gbps-per-host W] [--restart-s R]\n"
    "  models: gpt (= gpt2), gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-7b, llama-13b, llama-70b, resnet50,\n"
    "          resnet18-narrow\n"
    "  bandwidths in GB/s per GPU; the defaults are an H100 SXM host (989 TFLOPS bf16, NVLink 450, 400 Gb/s)\n"
    "  --explain: the best mesh's step time term by term; a mesh given (any of --dp-replicate ... --sp): that one\n"
    "  --explain also prints what failures cost the best mesh: a failure rate per GPU and day (default Llama 3's,\n"
    "    419 in 54 days on 16,384 GPUs), checkpoint writes per host (GB/s, default 2), a restart (default 300 s)\n"
    "  --compute-profile, --comm-fit: this machine's measured compute and collectives (CPU ranks, --cores\n"
    "    shared; default the profile's) instead of the GPU's peak and links; with --inter-host-gbps, hosts of\n"
    "    --gpus-per-host ranks joined by links of that speed (emulated hosts over a shaped veth pair)\n";

// Errors name the program and end with the usage (exit 2), as the examples' do.
const ember::examples::Cli kCli{"plan", kUsage};

double number(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(v >= 0))
    kCli.error(flag + " wants a non-negative number, got '" + text + "'");
  return v;
}

// "80GiB", "80GB", "24G" (GiB), "1073741824".
int64_t bytes(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const double v = number("--mem-per-gpu", text.substr(0, i));
  const std::string unit = text.substr(i);
  if (unit.empty() || unit == "B") return static_cast<int64_t>(v);
  if (unit == "GiB" || unit == "G") return static_cast<int64_t>(v * (1LL << 30));
  if (unit == "GB") return static_cast<int64_t>(v * 1e9);
  if (unit == "MiB" || unit == "M") return static_cast<int64_t>(v * (1LL << 20));
  if (unit == "MB") return static_cast<int64_t>(v * 1e6);
  kCli.error("--mem-per-gpu: unknown unit '" + unit + "' in '" + text + "' (GiB, GB, MiB, MB)");
}

// What failures cost the best mesh: its checkpoint (float32 parameters and
// the optimizer's two moments, 12 bytes per parameter, written once
// whatever the replicas, spread over the hosts), the mean time between
// failures of the job's GPUs, Young's checkpoint interval sqrt(2 x write x
// MTBF), and the fraction of the time lost: writing, plus per failure the
// restart and half an interval of work redone; with a live replica
// (dp_replicate > 1, live recovery from a replica) nothing is redone.
void reliability(const ember::distributed::MeshPlan& plan, double failures_per_gpu_day, double gbps_per_host,
                 double restart_s) {
  if (failures_per_gpu_day <= 0 || gbps_per_host <= 0)
    kCli.error("--failures-per-gpu-day and --ckpt-gbps-per-host must be positive");
  const auto& best = plan.best();
  const double hosts = std::max(1.0, static_cast<double>(plan.hw.gpus) / plan.hw.gpus_per_host);
  const double bytes = 12.0 * plan.model.num_params();
  const double write = bytes / hosts / (gbps_per_host * 1e9);
  const double mtbf = 86400 / (failures_per_gpu_day * plan.hw.gpus);
  const double interval = std::sqrt(2 * write * mtbf);
  const double lost = write / interval + (interval / 2 + restart_s) / mtbf;
  const double lost_live = write / interval + restart_s / mtbf;
  std::printf(
      "\nreliability: checkpoint %.0f GB (12 bytes per parameter), %.1f GB per host, written in %.1f s at %g GB/s "
      "per host; a failure every %.1f h on %d GPUs (%.3g per GPU and day); checkpoint every %.1f min "
      "(sqrt(2 x write x MTBF)); time lost %.2f%% (writing %.2f%%, per failure %.0f s restart + %.1f min redone)",
      bytes / 1e9, bytes / hosts / 1e9, write, gbps_per_host, mtbf / 3600, plan.hw.gpus, failures_per_gpu_day,
      interval / 60, 100 * lost, 100 * write / interval, restart_s, interval / 2 / 60);
  if (best.dims.dp_replicate > 1)
    std::printf("; with live recovery from a replica (dp_replicate=%d) nothing is redone: %.2f%%",
                best.dims.dp_replicate, 100 * lost_live);
  std::printf("\n");
}

using ember::distributed::Hardware;
using ember::distributed::MeshCandidate;
using ember::distributed::ModelSpec;
using ember::distributed::PlanOptions;

using ember::distributed::ParallelDims;

// A mesh degree's flag (ParallelDims::flags: --pp, --dp-shard, ...), or null.
const ParallelDims::Flag* mesh_flag(const std::string& name) {
  for (const auto& f : ParallelDims::flags())
    if (name == f.name) return &f;
  return nullptr;
}

// A model shape's flag (--layers, --dim, ...): the ModelSpec field it sets, or null.
int64_t ModelSpec::*model_size_flag(const std::string& name) {
  static const std::pair<const char*, int64_t ModelSpec::*> kFlags[] = {
      {"--layers", &ModelSpec::layers},
      {"--dim", &ModelSpec::dim},
      {"--heads", &ModelSpec::heads},
      {"--kv-heads", &ModelSpec::kv_heads},
      {"--ffn", &ModelSpec::ffn},
      {"--vocab", &ModelSpec::vocab},
      {"--seq", &ModelSpec::seq},
      {"--moe-experts", &ModelSpec::experts},
      {"--moe-top-k", &ModelSpec::top_k},
      {"--moe-every", &ModelSpec::moe_every},
      {"--moe-hidden", &ModelSpec::moe_hidden},
      {"--moe-shared", &ModelSpec::moe_shared},
  };
  for (const auto& [flag, field] : kFlags)
    if (name == flag) return field;
  return nullptr;
}

// The command line, parsed.
struct Args {
  ModelSpec m;
  Hardware hw;
  PlanOptions o;
  std::string model;
  bool gpus_given = false, explain = false, mesh_given = false, inter_given = false;
  MeshCandidate given = [] {
    MeshCandidate c;
    c.dims.dp_shard = -1;  // the rest
    return c;
  }();
  std::string given_sp = "on", compute_path, fit_path;
  // Reliability (--explain): Llama 3's 419 unexpected interruptions in 54
  // days on 16,384 H100s (Dubey et al. 2024, section 3.3.4) per GPU and day;
  // what one host writes to storage per second; a restart's cost (a new
  // rendezvous, the checkpoint read back, the warm-up).
  double failures_per_gpu_day = 419.0 / (54 * 16384), ckpt_gbps_per_host = 2, restart_s = 300;
  int cores = 0;
};

Args parse_args(int argc, char** argv) {
  Args args;
  auto& [m, hw, o, model, gpus_given, explain, mesh_given, inter_given, given, given_sp, compute_path, fit_path,
         failures_per_gpu_day, ckpt_gbps_per_host, restart_s, cores] = args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) kCli.error(a + " needs a value");
      return argv[++i];
    };
    auto integer = [&]() { return static_cast<int64_t>(number(a, value())); };
    if (a == "--model")
      model = value();
    else if (int64_t ModelSpec::*size = model_size_flag(a))
      m.*size = integer();
    else if (a == "--swiglu")
      m.swiglu = true;
    else if (a == "--tied")
      m.tied = true;
    else if (a == "--gpus")
      hw.gpus = static_cast<int>(integer()), gpus_given = true;
    else if (a == "--gpus-per-host")
      hw.gpus_per_host = static_cast<int>(integer());
    else if (a == "--mem-per-gpu")
      hw.mem_per_gpu = bytes(value());
    else if (a == "--global-batch")
      o.global_batch = integer();
    else if (a == "--dtype") {
      const std::string d = value();
      if (d != "bf16" && d != "fp16" && d != "fp32") kCli.error("--dtype takes bf16, fp16 or fp32, got '" + d + "'");
      o.mixed_precision = d != "fp32";
    } else if (a == "--optimizer")
      o.optimizer = value();
    else if (a == "--top")
      o.top = static_cast<int>(integer());
    else if (a == "--peak-tflops")
      hw.peak_flops = number(a, value()) * 1e12;
    else if (a == "--efficiency")
      hw.efficiency = number(a, value());
    else if (a == "--intra-host-gbps")
      hw.intra_host_bw = number(a, value()) * 1e9;
    else if (a == "--inter-host-gbps")
      hw.inter_host_bw = number(a, value()) * 1e9, inter_given = true;
    else if (a == "--explain")
      explain = true;
    else if (const ParallelDims::Flag* d = mesh_flag(a))
      given.dims.*d->degree = static_cast<int>(integer()), mesh_given = true;
    else if (a == "--pp-schedule")
      given.schedule = value(), mesh_given = true;
    else if (a == "--pp-virtual")
      given.virtual_stages = static_cast<int>(integer()), mesh_given = true;
    else if (a == "--microbatches")
      given.microbatches = integer(), mesh_given = true;
    else if (a == "--strategy")
      given.strategy = value(), mesh_given = true;
    else if (a == "--ac")
      given.ac = value(), mesh_given = true;
    else if (a == "--sp")
      given_sp = value(), mesh_given = true;
    else if (a == "--cp-exchange") {
      given.cp_exchange = value(), mesh_given = true;
      if (given.cp_exchange != "ring" && given.cp_exchange != "allgather" && given.cp_exchange != "alltoall")
        kCli.error("--cp-exchange wants ring, allgather or alltoall, got '" + given.cp_exchange + "'");
    } else if (a == "--compute-profile")
      compute_path = value();
    else if (a == "--comm-fit")
      fit_path = value();
    else if (a == "--cores")
      cores = static_cast<int>(integer());
    else if (a == "--failures-per-gpu-day")
      failures_per_gpu_day = number(a, value());
    else if (a == "--ckpt-gbps-per-host")
      ckpt_gbps_per_host = number(a, value());
    else if (a == "--restart-s")
      restart_s = number(a, value());
    else if (a == "--step-allreduces")
      o.step_allreduces = integer();
    else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      kCli.error("unknown argument '" + a + "'");
    }
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ember::distributed;
  Args args = parse_args(argc, argv);
  auto& [m, hw, o, model, gpus_given, explain, mesh_given, inter_given, given, given_sp, compute_path, fit_path,
         failures_per_gpu_day, ckpt_gbps_per_host, restart_s, cores] = args;
  if (!gpus_given) kCli.error("--gpus is required");
  if (o.global_batch <= 0) kCli.error("--global-batch is required");
  try {
    if (!model.empty()) {
      if (m.layers || m.dim || m.heads) kCli.error("give --model or --layers/--dim/--heads/..., not both");
      const ModelSpec moe = m;  // --moe-* apply to a preset too
      m = model_preset(model);
      m.experts = moe.experts, m.top_k = moe.top_k, m.moe_every = moe.moe_every, m.moe_hidden = moe.moe_hidden;
      m.moe_shared = moe.moe_shared;
    } else {
      if (m.layers <= 0 || m.dim <= 0 || m.heads <= 0 || m.vocab <= 0 || m.seq <= 0)
        kCli.error("give --model, or all of --layers, --dim, --heads, --vocab and --seq");
      m.name = "transformer";
    }
    if (m.experts > 0) {
      if (!m.transformer()) kCli.error("--moe-experts needs a transformer");
      if (m.top_k == 0) m.top_k = 2;
      if (m.moe_every == 0) m.moe_every = 1;
      if (m.moe_hidden == 0) m.moe_hidden = m.ffn > 0 ? m.ffn : 4 * m.dim;
      if (m.top_k > m.experts)
        kCli.error("--moe-top-k " + std::to_string(m.top_k) + " exceeds --moe-experts " + std::to_string(m.experts));
      m.name += " + MoE " + std::to_string(m.experts) + "x top-" + std::to_string(m.top_k);
    } else if (m.top_k || m.moe_hidden || m.moe_shared || m.moe_every != 1) {
      kCli.error("--moe-top-k, --moe-every, --moe-hidden and --moe-shared go with --moe-experts");
    }
    // This machine's measurements, or the GPU's figures.
    if (compute_path.empty() != fit_path.empty()) kCli.error("--compute-profile and --comm-fit go together");
    ComputeProfile profile;
    std::optional<CommCostModel> fits;
    std::optional<Links> links;
    if (!compute_path.empty()) {
      auto p = ComputeProfile::load(compute_path);
      if (!p.ok()) kCli.error(std::string(p.status().message()));
      profile = *p;
      if (cores > 0) profile.cores = cores;
      auto f = CommCostModel::load(fit_path);
      if (!f.ok()) kCli.error(std::string(f.status().message()));
      fits = std::move(*f);
      // --inter-host-gbps: hosts of --gpus-per-host ranks joined by such a link.
      links = Links::measured(*fits, hw.gpus, profile.cores, inter_given ? hw.inter_host_bw : 0, hw.gpus_per_host);
      o.compute = &profile;
      o.links = &*links;
    } else if (cores > 0) {
      kCli.error("--cores goes with --compute-profile");
    }
    if (mesh_given) {
      // That mesh only: dp_shard -1 takes the ranks the others leave.
      if (given_sp != "on" && given_sp != "off") kCli.error("--sp takes on or off, got '" + given_sp + "'");
      if (given.ac != "none" && given.ac != "full") kCli.error("--ac takes none or full, got '" + given.ac + "'");
      given.sequence_parallel = given_sp == "on";
      try {
        given.dims = given.dims.resolved(hw.gpus);
      } catch (const std::exception& e) {
        kCli.error(e.what());
      }
      if (given.dims.pp > 1 && given.schedule.empty()) given.schedule = "1f1b";
      if (given.dims.pp > 1 && given.microbatches == 1 && given.schedule != "") given.microbatches = given.dims.pp;
      const MeshCandidate k = evaluate_mesh(m, hw, o, given);
      if (!k.rejected.empty()) {
        std::fprintf(stderr, "plan: %s (%s): %s\n", k.mesh().c_str(), k.describe().c_str(), k.rejected.c_str());
        return 1;
      }
      std::printf("%s (%s), %lld micro-batch(es) of %lld per data-parallel rank\n", k.mesh().c_str(),
                  k.describe().c_str(), static_cast<long long>(k.microbatches), static_cast<long long>(k.micro_batch));
      std::printf("compute: %s; links: %s\n",
                  (o.compute ? *o.compute : ComputeProfile::from_hardware(hw)).source.c_str(),
                  (o.links ? *o.links : Links::analytic(hw)).source().c_str());
      std::fputs(k.explain.c_str(), stdout);
      std::printf("predicted step: %.6f s\n", k.step);
      return 0;
    }
    const MeshPlan plan = plan_mesh(m, hw, o);
    std::fputs(plan.table().c_str(), stdout);
    if (explain && !plan.feasible.empty()) {
      std::printf("\nthe best mesh's step, term by term (compute: %s; links: %s):\n",
                  (o.compute ? *o.compute : ComputeProfile::from_hardware(hw)).source.c_str(),
                  (o.links ? *o.links : Links::analytic(hw)).source().c_str());
      std::fputs(plan.best().explain.c_str(), stdout);
      reliability(plan, failures_per_gpu_day, ckpt_gbps_per_host, restart_s);
    }
    return plan.feasible.empty() ? 1 : 0;
  } catch (const ember::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());  // the message starts with "plan: "
    return 1;
  }
}
