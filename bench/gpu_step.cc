// gpu_step: the ResNet-50 training step on one GPU that bench/gpu_perf.sh
// sets beside PyTorch's (bench/resnet50_cuda_peer.py, the same step): batch
// 256 of 224x224 random images, SGD (lr 0.1, momentum 0.9, weight decay
// 1e-4), zero_grad + forward + cross-entropy + backward + step, the loss read
// at the end of each step (the one host synchronisation a step needs).
//
//   gpu_step [--configs fp32,tf32,bf16] [--layouts nchw,cl] [--batch 256]
//            [--image 224] [--warmup 3] [--steps 10] [--profile-top K]
//            [--cuda-graph 0|1]
//
// Configurations, as PyTorch names them:
//   fp32  float32, TF32 off (torch.backends.cudnn.allow_tf32 = False);
//   tf32  float32 at PyTorch's defaults (cuDNN may use TF32, matmul not);
//   bf16  autocast to bfloat16 around forward and loss, TF32 defaults.
// Prints one line per (config, layout):
//   ours config=tf32 layout=cl batch=256 median_ms=... min_ms=... max_ms=... steps=10 ... layout_copies=0.0
//   cuda_graph=0 host_ms=...
// host_ms is the median host time to issue a step (until the loss read
// starts waiting). --cuda-graph 1 captures the step once after the warm-up
// (core/cuda_graph.h) and times its replays: the host issues one launch.
// --profile-top K profiles one more step and prints its top K ops by self
// time as `ours_op config=.. layout=.. calls=.. self_ms=.. total_ms=.. name=..`,
// then the GPU's idle time in the step (`ours_idle ... idle_ms=..`) and the
// ops it waited before (`ours_gap ... gap_ms=.. name=..`)
// lines: run it with CUDA_LAUNCH_BLOCKING=1 so that each op's host time is
// its GPU time. The same binary links the CUDA emulation as gpu_step_emu, for
// gpu_perf.sh --smoke on a machine without a GPU.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/train_step.h"
#include "core/autocast.h"
#include "core/cuda_graph.h"
#include "core/device.h"
#include "core/profiler.h"
#include "nn/models.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

struct Args {
  std::vector<std::string> configs = {"fp32", "tf32", "bf16"};
  std::vector<std::string> layouts = {"nchw", "cl"};
  int64_t batch = 256, image = 224, warmup = 3, steps = 10, profile_top = 0;
  bool cuda_graph = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "gpu_step: %s\nusage: gpu_step [--configs fp32,tf32,bf16] [--layouts nchw,cl] [--batch N] [--image S] "
               "[--warmup N] [--steps N] [--profile-top K] [--cuda-graph 0|1]\n",
               why.c_str());
  std::exit(2);
}

int64_t positive(const char* flag, const char* v) {
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || n < 0) usage(std::string(flag) + " expects a non-negative integer, got '" + v + "'");
  return n;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) usage(f + " needs a value");
    const char* v = argv[++i];
    if (f == "--configs") a.configs = split(v);
    else if (f == "--layouts") a.layouts = split(v);
    else if (f == "--batch") a.batch = positive("--batch", v);
    else if (f == "--image") a.image = positive("--image", v);
    else if (f == "--warmup") a.warmup = positive("--warmup", v);
    else if (f == "--steps") a.steps = positive("--steps", v);
    else if (f == "--profile-top") a.profile_top = positive("--profile-top", v);
    else if (f == "--cuda-graph") {
      if (std::string(v) != "0" && std::string(v) != "1")
        usage(std::string("--cuda-graph expects 0 or 1, got '") + v + "'");
      a.cuda_graph = std::string(v) == "1";
    } else
      usage("unknown flag " + f);
  }
  for (const auto& c : a.configs)
    if (c != "fp32" && c != "tf32" && c != "bf16") usage("unknown config '" + c + "' (fp32, tf32, bf16)");
  for (const auto& l : a.layouts)
    if (l != "nchw" && l != "cl") usage("unknown layout '" + l + "' (nchw, cl)");
  if (a.steps == 0 || a.batch == 0 || a.image < 32) usage("--steps and --batch must be positive, --image at least 32");
  if (a.cuda_graph && a.warmup == 0)
    usage("--cuda-graph 1 needs --warmup 1 or more (the optimizer's state is made eagerly)");
  return a;
}

void run(const Args& a, const std::string& config, const std::string& layout) {
  set_cudnn_allow_tf32(config != "fp32");
  set_matmul_allow_tf32(false);
  const bool amp = config == "bf16";
  manual_seed(0);
  auto model = nn::resnet50(
      {.num_classes = 1000, .memory_format = layout == "cl" ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous});
  model->to(cuda_device(0));
  model->train();
  optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4});
  Tensor x = randn({a.batch, 3, a.image, a.image}).cuda();
  if (layout == "cl") x = x.contiguous(MemoryFormat::ChannelsLast);  // once, as the peer converts its input
  Tensor y = randint(0, 1000, {a.batch}).cuda();
  const std::optional<DType> amp_dtype = amp ? std::optional<DType>(DType::BFloat16) : std::nullopt;
  auto step = [&] { return bench::train_step_autocast(*model, opt, x, y, amp_dtype); };
  for (int64_t i = 0; i < a.warmup; ++i) step();
  // The step's launches without its loss read: what the host issues, and
  // what a CUDA graph captures.
  Tensor loss;
  auto issue = [&] {
    opt.zero_grad();
    std::optional<AutocastGuard> guard;
    if (amp_dtype) guard.emplace(DeviceType::CUDA, *amp_dtype);
    loss = nn::functional::cross_entropy((*model)(x), y);
    guard.reset();
    loss.backward();
    opt.step();
  };
  std::optional<CudaGraph> graph;
  if (a.cuda_graph) {
    graph.emplace(0);
    graph->capture(issue);
  }
  std::vector<double> ms, host_ms;
  const AllocatorStats before = cuda_allocator(0)->stats();
  const uint64_t copies_before = cuda_layout_copies();
  for (int64_t i = 0; i < a.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (graph)
      graph->replay();
    else
      issue();
    host_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    (void)loss.item();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(host_ms.begin(), host_ms.end());
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  // cudaMalloc calls during the timed steps (0 once the caching allocator is
  // warm) and what it holds: a step that keeps reaching the driver is slow.
  const AllocatorStats after = cuda_allocator(0)->stats();
  // Transposing copies per step (core/device.h): 0 in channels-last, where
  // weights, activations and pooling all stay NHWC.
  const double layout_copies = static_cast<double>(cuda_layout_copies() - copies_before) / static_cast<double>(n);
  std::printf(
      "ours config=%s layout=%s batch=%lld median_ms=%.3f min_ms=%.3f max_ms=%.3f steps=%zu "
      "device_allocs=%zu reserved_gib=%.1f layout_copies=%.1f cuda_graph=%d host_ms=%.3f\n",
      config.c_str(), layout.c_str(), static_cast<long long>(a.batch), median, sorted.front(), sorted.back(), n,
      after.num_device_allocs - before.num_device_allocs, after.reserved / 1073741824.0, layout_copies,
      a.cuda_graph ? 1 : 0, host_ms[n / 2]);
  if (std::getenv("GPU_STEP_VERBOSE"))
    for (double t : ms) std::printf("ours_step config=%s layout=%s ms=%.3f\n", config.c_str(), layout.c_str(), t);
  std::fflush(stdout);
  if (a.profile_top > 0 && !graph) {
    profiler::start();
    step();
    profiler::stop();
    // By GPU self time (the profiler's CUDA event pairs): host times on a
    // GPU are launches, not work.
    std::vector<profiler::Average> rows = profiler::key_averages(profiler::events());
    std::stable_sort(rows.begin(), rows.end(),
                     [](const auto& l, const auto& r) { return l.cuda_self_ns > r.cuda_self_ns; });
    int64_t shown = 0;
    for (const profiler::Average& av : rows) {
      if (shown++ >= a.profile_top) break;
      std::printf(
          "ours_op config=%s layout=%s calls=%lld self_ms=%.3f total_ms=%.3f host_self_ms=%.3f host_total_ms=%.3f "
          "name=%s\n",
          config.c_str(), layout.c_str(), static_cast<long long>(av.calls), av.cuda_self_ns / 1e6,
          av.cuda_total_ns / 1e6, av.self_ns / 1e6, av.total_ns / 1e6, av.name.c_str());
    }
    // Where the GPU sat idle (the profiler's cuda_gap_ns: the stream empty
    // before an op's work): a host-bound stretch shows at the op it held up.
    std::stable_sort(rows.begin(), rows.end(),
                     [](const auto& l, const auto& r) { return l.cuda_gap_ns > r.cuda_gap_ns; });
    int64_t idle = 0;
    for (const profiler::Average& av : rows) idle += av.cuda_gap_ns;
    std::printf("ours_idle config=%s layout=%s idle_ms=%.3f\n", config.c_str(), layout.c_str(), idle / 1e6);
    shown = 0;
    for (const profiler::Average& av : rows) {
      if (shown++ >= std::min<int64_t>(a.profile_top, 10) || av.cuda_gap_ns <= 0) break;
      std::printf("ours_gap config=%s layout=%s calls=%lld gap_ms=%.3f name=%s\n", config.c_str(), layout.c_str(),
                  static_cast<long long>(av.calls), av.cuda_gap_ns / 1e6, av.name.c_str());
    }
    std::fflush(stdout);
  }
  graph.reset();
  model.reset();
  cuda_allocator(0)->empty_cache();  // the next configuration starts from what this one freed
}

}  // namespace
}  // namespace ember

int main(int argc, char** argv) {
  using namespace ember;
  const Args a = parse(argc, argv);
  if (!cuda_is_available()) {
    std::fprintf(stderr, "gpu_step: no GPU: %s\n", cuda_unavailable_reason().c_str());
    return 1;
  }
  try {
    for (const auto& c : a.configs)
      for (const auto& l : a.layouts) run(a, c, l);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
