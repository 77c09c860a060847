// //bench:compute_profile: how fast this machine computes a transformer's
// parts, for the step-time prediction (distributed/parallel/step_cost.h).
// One process, one thread (as each rank of a CPU job runs), nn::GPT as
// //examples:gpt builds it (untied head, the loss parallel_cross_entropy,
// AdamW):
//
//   block      a block's forward + backward on one micro-batch, from the
//              difference of a 3-layer and a 1-layer model on the same
//              batch, over widths and micro-batch sizes; fitted as
//              overhead_s + FLOPs / flops_per_s, FLOPs = (6 x the block's
//              parameters + 12 x dim x seq) x tokens (PaLM's count)
//   head       the rest of the 1-layer model's forward + backward
//              (embeddings, final norm, LM head, loss); FLOPs 6 x vocab x
//              dim x tokens
//   optimizer  AdamW's step, fitted as overhead_s + parameters x s_per_param
//   models     //examples:resnet_ddp's narrow ResNet-18 (width 16, 1 x 28 x
//              28 inputs): forward + backward over batches of 8 to 64,
//              fitted as overhead_s + samples x s_per_sample, and its
//              Nesterov SGD step (optimizer_s)
//
// Each point is the median of --reps timings after a warm-up; the fits are
// least squares, each point weighted by 1 / its time (relative errors), and
// the JSON holds the points, the fits and their median and largest
// relative errors.
//
//   bazel run -c opt //bench:compute_profile -- --out bench/results/compute_profile.json
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/ops.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace {
using namespace ember;
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Point {
  double x, t;  // FLOPs or parameters; seconds
};

// t = a + x / rate, least squares on relative errors.
struct Fit {
  double a = 0, per_x = 0, median_err = 0, max_err = 0;
};

Fit fit(const std::vector<Point>& pts) {
  // Weighted normal equations for t ~ a + b x, weights 1/t^2.
  double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
  for (const Point& p : pts) {
    const double w = 1 / (p.t * p.t);
    s00 += w, s01 += w * p.x, s11 += w * p.x * p.x, r0 += w * p.t, r1 += w * p.x * p.t;
  }
  Fit f;
  const double det = s00 * s11 - s01 * s01;
  f.a = (r0 * s11 - r1 * s01) / det;
  f.per_x = (s00 * r1 - s01 * r0) / det;
  if (f.a < 0) {  // no negative overhead: through the origin
    f.a = 0;
    f.per_x = r1 / s11;
  }
  if (f.per_x <= 0) {  // no time falling with work: a constant (the head's noise at these sizes)
    f.per_x = 1e-15;
    f.a = r0 / s00;
  }
  std::vector<double> errs;
  for (const Point& p : pts) errs.push_back(std::abs(f.a + f.per_x * p.x - p.t) / p.t);
  f.median_err = median(errs);
  f.max_err = *std::max_element(errs.begin(), errs.end());
  return f;
}

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr, "compute_profile: %s\nusage: compute_profile --out FILE [--reps N] [--vocab V] [--seq S]\n",
               msg.c_str());
  std::exit(2);
}

struct Args {
  std::string out;
  int reps = 7;
  int64_t vocab = 114, seq = 64;  // the fortunes' characters, //examples:gpt's context
};

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--out")
      args.out = v;
    else if (a == "--reps")
      args.reps = std::atoi(v.c_str());
    else if (a == "--vocab")
      args.vocab = std::atoll(v.c_str());
    else if (a == "--seq")
      args.seq = std::atoll(v.c_str());
    else
      usage("unknown argument '" + a + "'");
  }
  if (args.out.empty()) usage("--out is required");
  if (args.reps < 3 || args.vocab < 2 || args.seq < 1) usage("--reps must be at least 3, --vocab 2, --seq 1");
  return args;
}

struct GptShape {
  int64_t dim, heads, batch;
};

// One GPT of `layers` blocks on one micro-batch: the median forward +
// backward and AdamW step times, and its parameter count.
struct GptTiming {
  double fwd_bwd_s = 0, step_s = 0;
  int64_t params = 0;
};

GptTiming time_gpt(const Args& args, const GptShape& sh, int64_t layers) {
  manual_seed(0);
  auto model = std::make_shared<nn::GPT>(nn::GPTOptions{
      .vocab_size = args.vocab, .block_size = args.seq, .n_layer = layers, .n_head = sh.heads, .n_embd = sh.dim});
  optim::AdamW opt(model->parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.01});
  Tensor x = randint(0, args.vocab, {sh.batch, args.seq}), y = randint(0, args.vocab, {sh.batch, args.seq});
  std::vector<double> fb, st;
  for (int r = 0; r < args.reps + 2; ++r) {
    opt.zero_grad();
    const auto t0 = Clock::now();
    Tensor loss = distributed::parallel_cross_entropy((*model)(x), y);
    loss.backward();
    const auto t1 = Clock::now();
    opt.step();
    const auto t2 = Clock::now();
    if (r >= 2) {  // warm-up: the optimizer's state, the allocator's caches
      fb.push_back(std::chrono::duration<double>(t1 - t0).count());
      st.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
  }
  GptTiming out;
  out.fwd_bwd_s = median(fb);
  out.step_s = median(st);
  for (const Tensor& p : model->parameters()) out.params += p.numel();
  return out;
}

// The GPT's points: per shape, a block's time and FLOPs from the difference
// of a 3-layer and a 1-layer model, the head's from the rest of the 1-layer
// one, AdamW's step against the parameter count; each shape's row in `raw`.
struct GptPoints {
  std::vector<Point> block, head, opt;
};

GptPoints profile_gpt(const Args& args, nlohmann::json& raw) {
  const int64_t vocab = args.vocab, seq = args.seq;
  GptPoints pts;
  std::vector<GptShape> shapes;
  for (int64_t dim : {32, 64, 128, 256})
    for (int64_t batch : {1, 4, 16}) shapes.push_back({dim, std::max<int64_t>(1, dim / 32), batch});
  for (const GptShape& sh : shapes) {
    double t_layers[2] = {0, 0};
    int64_t block_params = 0, total_params[2] = {0, 0};
    double t_opt[2] = {0, 0};
    for (int which = 0; which < 2; ++which) {
      const GptTiming t = time_gpt(args, sh, which == 0 ? 1 : 3);
      t_layers[which] = t.fwd_bwd_s;
      t_opt[which] = t.step_s;
      total_params[which] = t.params;
      if (which == 1) block_params = (total_params[1] - total_params[0]) / 2;
    }
    const double tokens = static_cast<double>(sh.batch) * seq;
    const double block_t = (t_layers[1] - t_layers[0]) / 2, head_t = t_layers[0] - block_t;
    const double block_flops = (6.0 * block_params + 12.0 * sh.dim * seq) * tokens;
    const double head_flops = 6.0 * vocab * sh.dim * tokens;
    if (block_t > 0) pts.block.push_back({block_flops, block_t});
    if (head_t > 0) pts.head.push_back({head_flops, head_t});
    for (int w = 0; w < 2; ++w) pts.opt.push_back({static_cast<double>(total_params[w]), t_opt[w]});
    raw.push_back({{"dim", sh.dim},
                   {"heads", sh.heads},
                   {"micro_batch", sh.batch},
                   {"seq", seq},
                   {"vocab", vocab},
                   {"fwd_bwd_1_layer_s", t_layers[0]},
                   {"fwd_bwd_3_layers_s", t_layers[1]},
                   {"block_s", block_t},
                   {"block_flops", block_flops},
                   {"head_s", head_t},
                   {"head_flops", head_flops},
                   {"adamw_1_layer_s", t_opt[0]},
                   {"adamw_3_layers_s", t_opt[1]},
                   {"params_1_layer", total_params[0]},
                   {"params_3_layers", total_params[1]}});
    std::fprintf(stderr, "dim %lld batch %lld: block %.3f ms (%.3g FLOPs), head %.3f ms, adamw %.3f ms\n",
                 static_cast<long long>(sh.dim), static_cast<long long>(sh.batch), block_t * 1e3, block_flops,
                 head_t * 1e3, t_opt[1] * 1e3);
  }
  return pts;
}

// The narrow ResNet-18 of //examples:resnet_ddp: forward + backward per
// batch size (its rows in `raw`) and every Nesterov SGD step's time.
struct ResnetPoints {
  std::vector<Point> fwd_bwd;
  std::vector<double> sgd;
};

ResnetPoints profile_resnet(const Args& args, nlohmann::json& raw) {
  ResnetPoints pts;
  manual_seed(0);
  auto model = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true, .width = 16});
  model->train();
  optim::SGD opt(model->parameters(),
                 optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
  for (int64_t batch : {8, 16, 32, 64}) {
    Tensor x = randn({batch, 1, 28, 28}), y = randint(0, 10, {batch});
    std::vector<double> fb;
    for (int r = 0; r < args.reps + 2; ++r) {
      opt.zero_grad();
      const auto t0 = Clock::now();
      nn::functional::cross_entropy((*model)(x), y).backward();
      const auto t1 = Clock::now();
      opt.step();
      const auto t2 = Clock::now();
      if (r >= 2) {
        fb.push_back(std::chrono::duration<double>(t1 - t0).count());
        pts.sgd.push_back(std::chrono::duration<double>(t2 - t1).count());
      }
    }
    pts.fwd_bwd.push_back({static_cast<double>(batch), median(fb)});
    raw.push_back({{"model", "resnet18-narrow"}, {"micro_batch", batch}, {"fwd_bwd_s", median(fb)}});
  }
  return pts;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  const std::string& out = args.out;
  omp_set_num_threads(1);

  nlohmann::json raw = nlohmann::json::array();
  const GptPoints gpt = profile_gpt(args, raw);
  if (gpt.block.size() < 3 || gpt.head.size() < 3) {
    std::fprintf(stderr, "compute_profile: too few positive differences (%zu block, %zu head): a noisy machine?\n",
                 gpt.block.size(), gpt.head.size());
    return 1;
  }
  const Fit b = fit(gpt.block), h = fit(gpt.head), o = fit(gpt.opt);

  const ResnetPoints resnet = profile_resnet(args, raw);
  const std::vector<double>& sgd = resnet.sgd;
  const Fit rn = fit(resnet.fwd_bwd);
  nlohmann::json j = {
      {"about",
       "//bench:compute_profile: forward + backward of a GPT block and of the head as overhead_s + FLOPs / "
       "flops_per_s, AdamW as overhead_s + parameters x s_per_param; one thread"},
      {"machine", {{"cores", static_cast<int>(std::thread::hardware_concurrency())}}},
      {"block",
       {{"overhead_s", b.a},
        {"flops_per_s", 1 / b.per_x},
        {"median_rel_error", b.median_err},
        {"max_rel_error", b.max_err}}},
      {"head",
       {{"overhead_s", h.a},
        {"flops_per_s", 1 / h.per_x},
        {"median_rel_error", h.median_err},
        {"max_rel_error", h.max_err}}},
      {"optimizer",
       {{"overhead_s", o.a},
        {"s_per_param", o.per_x},
        {"median_rel_error", o.median_err},
        {"max_rel_error", o.max_err}}},
      {"models",
       {{"resnet18-narrow",
         {{"overhead_s", rn.a},
          {"s_per_sample", rn.per_x},
          {"optimizer_s", median(sgd)},
          {"median_rel_error", rn.median_err},
          {"max_rel_error", rn.max_err}}}}},
      {"points", raw}};
  std::ofstream f(out);
  if (!(f << j.dump(1) << "\n")) {
    std::fprintf(stderr, "compute_profile: cannot write %s\n", out.c_str());
    return 1;
  }
  std::printf(
      "block: %.3f ms + FLOPs / %.2f GFLOP/s (median error %.0f%%); head: %.3f ms + FLOPs / %.2f GFLOP/s "
      "(%.0f%%); adamw: %.3f ms + %.2f ns/param (%.0f%%); narrow ResNet-18: %.3f ms + %.3f ms/sample (%.0f%%)\n",
      b.a * 1e3, 1e-9 / b.per_x, 100 * b.median_err, h.a * 1e3, 1e-9 / h.per_x, 100 * h.median_err, o.a * 1e3,
      o.per_x * 1e9, 100 * o.median_err, rn.a * 1e3, rn.per_x * 1e3, 100 * rn.median_err);
  return 0;
}
