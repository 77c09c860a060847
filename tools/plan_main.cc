// //tools:plan: which mesh to train a model with. For every
// dp_replicate x dp_shard x tp x pp mesh of --gpus (with its pipeline
// schedule, micro-batches, activation checkpointing and CPU offload) it
// predicts per-rank memory and the step time (distributed/parallel/
// mesh_plan.h), prints the fastest that fit and why the others were
// rejected.
//
//   bazel run //tools:plan -- --model llama-70b --gpus 64 --gpus-per-host 8 --mem-per-gpu 80GiB --global-batch 64
//   bazel run //tools:plan -- --layers 4 --dim 32 --heads 4 --vocab 114 --seq 16 --gpus 8 --mem-per-gpu 1GiB \
//       --global-batch 8 --dtype fp32
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/exception.h"
#include "distributed/parallel/mesh_plan.h"

namespace {

const char* kUsage =
    "usage: plan (--model NAME | --layers L --dim D --heads H --vocab V --seq S [--kv-heads K] [--ffn F]\n"
    "             [--swiglu] [--tied]) --gpus N [--gpus-per-host G] [--mem-per-gpu 80GiB] --global-batch B\n"
    "             [--dtype bf16|fp16|fp32] [--optimizer adamw|adam|sgd] [--top K]\n"
    "             [--peak-tflops T] [--efficiency E] [--intra-host-gbps B] [--inter-host-gbps B]\n"
    "  models: gpt (= gpt2), gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-7b, llama-13b, llama-70b, resnet50\n"
    "  bandwidths in GB/s per GPU; the defaults are an H100 SXM host (989 TFLOPS bf16, NVLink 450, 400 Gb/s)\n";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "plan: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

double number(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(v >= 0))
    usage_error(flag + " wants a non-negative number, got '" + text + "'");
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
  usage_error("--mem-per-gpu: unknown unit '" + unit + "' in '" + text + "' (GiB, GB, MiB, MB)");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ember::distributed;
  ModelSpec m;
  Hardware hw;
  PlanOptions o;
  std::string model;
  bool gpus_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    auto integer = [&]() { return static_cast<int64_t>(number(a, value())); };
    if (a == "--model")
      model = value();
    else if (a == "--layers")
      m.layers = integer();
    else if (a == "--dim")
      m.dim = integer();
    else if (a == "--heads")
      m.heads = integer();
    else if (a == "--kv-heads")
      m.kv_heads = integer();
    else if (a == "--ffn")
      m.ffn = integer();
    else if (a == "--vocab")
      m.vocab = integer();
    else if (a == "--seq")
      m.seq = integer();
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
      if (d != "bf16" && d != "fp16" && d != "fp32") usage_error("--dtype takes bf16, fp16 or fp32, got '" + d + "'");
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
      hw.inter_host_bw = number(a, value()) * 1e9;
    else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      usage_error("unknown argument '" + a + "'");
    }
  }
  if (!gpus_given) usage_error("--gpus is required");
  if (o.global_batch <= 0) usage_error("--global-batch is required");
  try {
    if (!model.empty()) {
      if (m.layers || m.dim || m.heads) usage_error("give --model or --layers/--dim/--heads/..., not both");
      m = model_preset(model);
    } else {
      if (m.layers <= 0 || m.dim <= 0 || m.heads <= 0 || m.vocab <= 0 || m.seq <= 0)
        usage_error("give --model, or all of --layers, --dim, --heads, --vocab and --seq");
      m.name = "transformer";
    }
    const MeshPlan plan = plan_mesh(m, hw, o);
    std::fputs(plan.table().c_str(), stdout);
    return plan.feasible.empty() ? 1 : 0;
  } catch (const ember::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());  // the message starts with "plan: "
    return 1;
  }
}
