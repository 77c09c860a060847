// The numerical contract, measured: each kernel family with a choice of
// algorithm or accumulation, run on representative shapes in every dtype and
// algorithm it has, against the same computation in float64 on the CPU,
// forward and every gradient. The figure is max |got - ref| / max |ref| over
// the tensor (the error relative to its scale, the measure the drawn kernel
// tests' tolerances use). docs/design.md, Note [numerics], quotes this
// tool's output.
//
//   bazel run //bench:numerics            # CPU and the CUDA emulation
//   bazel run //bench:numerics -- --quick # smaller shapes (a smoke run)
//
// The CUDA rows run under the host emulation here, whose cuDNN and cuBLAS
// compute in the precision the call asks for (TF32 rounds the operands to
// 10 mantissa bits, 16-bit GEMMs accumulate in float32) but always with a
// direct summation; a GPU's cuDNN may pick FFT or Winograd engines with
// other errors, so on a GPU rerun this tool (tools/gpu_check.sh does).
// The last rows follow a small ResNet through SGD steps, Winograd and
// direct against float64, and time the CPU convolution passes both ways.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/ops.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"
#include "core/ops_optim.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

Tensor rnd(const Shape& s, uint64_t seed, double scale = 1.0) {
  Generator g(seed);
  return randn(s, {DType::Float64}, &g) * scale;
}

double rel_err(const Tensor& got, const Tensor& ref) {
  const Tensor r = ref.cpu().to(DType::Float64);
  const double scale = max(abs(r)).item();
  return max(abs(got.detach().cpu().to(DType::Float64) - r)).item() / (scale > 0 ? scale : 1.0);
}

struct Variant {
  std::string name;
  DType dt;
  bool cuda;
  std::function<void()> setup = [] {};
};

// Runs f on the float64 `inputs` cast to the variant's dtype and device,
// the floating ones as leaves, then backward of sum(y * r); returns y and
// the gradients.
std::vector<Tensor> run(const Fn& f, const std::vector<Tensor>& inputs, DType dt, bool cuda,
                        const std::vector<bool>& grad) {
  std::vector<Tensor> in;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor t = inputs[i].to(dt);
    if (cuda) t = t.cuda();
    in.push_back(grad[i] ? t.detach().requires_grad_() : t);
  }
  Tensor y = f(in);
  std::vector<Tensor> out = {y};
  if (y.requires_grad()) {
    Tensor r = rnd(y.sizes(), 4242).to(y.dtype());
    sum(y * (cuda ? r.cuda() : r)).backward();
    for (size_t i = 0; i < in.size(); ++i)
      if (grad[i]) out.push_back(in[i].grad());
  }
  return out;
}

void measure(const std::string& family, const std::string& shape, const std::vector<std::string>& passes, const Fn& f,
             const std::vector<Tensor>& inputs, const std::vector<bool>& grad, const std::vector<Variant>& variants) {
  const std::vector<Tensor> ref = run(f, inputs, DType::Float64, false, grad);
  for (const Variant& v : variants) {
    if (v.cuda && !cuda_is_available()) continue;
    v.setup();
    const std::vector<Tensor> got = run(f, inputs, v.dt, v.cuda, grad);
    std::string errs;
    for (size_t i = 0; i < got.size() && i < passes.size(); ++i) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%s%s %.1e", i ? ", " : "", passes[i].c_str(), rel_err(got[i], ref[i]));
      errs += buf;
    }
    std::printf("| %s | %s | %s | %s |\n", family.c_str(), shape.c_str(), v.name.c_str(), errs.c_str());
    std::fflush(stdout);
  }
  set_cudnn_allow_tf32(true);
  set_matmul_allow_tf32(false);
  set_cpu_conv_algorithm(ConvAlgorithm::Auto);
}

const Variant kCpu32{"CPU float32", DType::Float32, false};
const Variant kCpuBf16{"CPU bfloat16", DType::BFloat16, false};
const Variant kCpuF16{"CPU float16", DType::Float16, false};
const Variant kCuda32{"CUDA float32", DType::Float32, true, [] {
                        set_cudnn_allow_tf32(false);
                        set_matmul_allow_tf32(false);
                      }};
const Variant kCudaTf32{"CUDA TF32", DType::Float32, true, [] {
                          set_cudnn_allow_tf32(true);
                          set_matmul_allow_tf32(true);
                        }};
const Variant kCudaBf16{"CUDA bfloat16", DType::BFloat16, true};
const Variant kCudaF16{"CUDA float16", DType::Float16, true};

std::string shape_of(const std::vector<Shape>& shapes) {
  std::string s;
  for (const Shape& sh : shapes) s += (s.empty() ? "" : " ") + shape_str(sh);
  return s;
}

// A 3x3 convolution's input and output channels.
struct ConvLayer {
  Shape x;
  int64_t o;
};

void conv_rows(bool quick) {
  const std::vector<ConvLayer> layers =
      quick ? std::vector<ConvLayer>{{{2, 16, 14, 14}, 16}}
            : std::vector<ConvLayer>{{{4, 64, 28, 28}, 64}, {{4, 128, 14, 14}, 128}, {{4, 256, 7, 7}, 256}};
  for (const ConvLayer& l : layers) {
    const Shape ws = {l.o, l.x[1], 3, 3};
    const Fn f = [](const std::vector<Tensor>& v) { return conv2d(v[0], v[1], Tensor(), {1, 1}, {1, 1}); };
    Variant direct{"CPU float32 direct", DType::Float32, false, [] { set_cpu_conv_algorithm(ConvAlgorithm::Direct); }};
    Variant wino{"CPU float32 Winograd (auto)", DType::Float32, false,
                 [] { set_cpu_conv_algorithm(ConvAlgorithm::Auto); }};
    measure("conv2d 3x3", shape_of({l.x, ws}), {"y", "dx", "dw"}, f, {rnd(l.x, 1), rnd(ws, 2, 0.1)}, {true, true},
            {direct, wino, kCpuBf16, kCuda32, kCudaTf32, kCudaBf16, kCudaF16});
  }
  // A strided 1x1 (ResNet's downsample) and a 7x7 stem: the direct path.
  const Shape x = quick ? Shape{2, 8, 16, 16} : Shape{4, 64, 56, 56}, w1 = {x[1] * 2, x[1], 1, 1};
  measure("conv2d 1x1 stride 2", shape_of({x, w1}), {"y", "dx", "dw"},
          [](const std::vector<Tensor>& v) {
            return conv2d(v[0], v[1], Tensor(), {2, 2});
          },
          {rnd(x, 3), rnd(w1, 4, 0.1)}, {true, true}, {kCpu32, kCpuBf16, kCuda32, kCudaTf32, kCudaBf16});
}

void matmul_rows(bool quick) {
  for (int64_t k : quick ? std::vector<int64_t>{256} : std::vector<int64_t>{1024, 4096}) {
    const Shape a = {256, k}, b = {k, 256};
    measure("matmul", shape_of({a, b}), {"y", "da", "db"},
            [](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); }, {rnd(a, 5), rnd(b, 6)}, {true, true},
            {kCpu32, kCpuBf16, kCpuF16, kCuda32, kCudaTf32, kCudaBf16, kCudaF16});
  }
}

void reduction_rows(bool quick) {
  const Shape s = quick ? Shape{64, 4096} : Shape{256, 16384};
  // Values with a mean far from zero, where a naive sum loses the most.
  const Tensor x = rnd(s, 7) + 3.0;
  const std::vector<Variant> all = {kCpu32, kCpuBf16, kCuda32, kCudaBf16};
  measure(
      "sum (all)", shape_str(s), {"y", "dx"}, [](const std::vector<Tensor>& v) { return sum(v[0]); }, {x}, {true}, all);
  measure(
      "sum (rows)", shape_str(s), {"y", "dx"}, [](const std::vector<Tensor>& v) { return sum(v[0], {1}); }, {x}, {true},
      all);
  measure(
      "sum (columns)", shape_str(s), {"y", "dx"}, [](const std::vector<Tensor>& v) { return sum(v[0], {0}); }, {x},
      {true}, all);
  measure(
      "var (rows)", shape_str(s), {"y", "dx"}, [](const std::vector<Tensor>& v) { return var(v[0], {1}); }, {x}, {true},
      all);
  const Shape rows = quick ? Shape{8, 5000} : Shape{32, 50257};  // GPT-2's vocabulary
  const Tensor logits = rnd(rows, 8, 3.0);
  measure(
      "softmax", shape_str(rows), {"y", "dx"}, [](const std::vector<Tensor>& v) { return softmax(v[0], -1); }, {logits},
      {true}, all);
  measure(
      "log_softmax", shape_str(rows), {"y", "dx"}, [](const std::vector<Tensor>& v) { return log_softmax(v[0], -1); },
      {logits}, {true}, all);
}

void attention_rows(bool quick) {
  for (int64_t d : {int64_t{64}, int64_t{128}}) {
    const Shape s = {2, 4, quick ? int64_t{64} : int64_t{512}, d};
    measure("attention causal", shape_str(s), {"y", "dq", "dk", "dv"},
            [](const std::vector<Tensor>& v) { return scaled_dot_product_attention(v[0], v[1], v[2], true); },
            {rnd(s, 9), rnd(s, 10), rnd(s, 11)}, {true, true, true}, {kCpu32, kCpuBf16, kCuda32, kCudaBf16});
    if (quick) break;
  }
}

void norm_rows(bool quick) {
  const Shape ln = quick ? Shape{64, 256} : Shape{1024, 768};
  measure("layer_norm", shape_str(ln), {"y", "dx", "dw", "db"},
          [](const std::vector<Tensor>& v) { return layer_norm(v[0], 1, v[1], v[2], 1e-5); },
          {rnd(ln, 12, 2.0) + 1.0, rnd({ln[1]}, 13), rnd({ln[1]}, 14)}, {true, true, true},
          {kCpu32, kCpuBf16, kCuda32, kCudaBf16});
  const Shape bn = quick ? Shape{4, 8, 14, 14} : Shape{32, 64, 28, 28};
  // 16-bit activations keep float32 statistics and parameters (as in
  // mixed precision); the table's 16-bit rows cast all inputs, so batch
  // norm gets float32 and bfloat16 rows only through its float32 weight.
  for (const Variant& v : {kCpu32, kCuda32}) {
    const Fn f = [](const std::vector<Tensor>& in) {
      Tensor rm = zeros({in[0].size(1)}, {in[0].dtype(), in[0].device()}), rv = ones_like(rm);
      Tensor y = batch_norm(in[0], in[1], in[2], rm, rv, true, 0.1);
      return y;
    };
    measure("batch_norm (train)", shape_str(bn), {"y", "dx", "dw", "db"}, f,
            {rnd(bn, 15) + 5.0, rnd({bn[1]}, 16), rnd({bn[1]}, 17)}, {true, true, true}, {v});
  }
}

// 100 fused steps of AdamW and of SGD with Nesterov momentum on one tensor,
// the same gradients each time, against the same steps in float64.
void optimizer_rows(bool quick) {
  const int64_t n = quick ? 10000 : 1 << 20;
  const int steps = quick ? 10 : 100;
  for (bool adam : {true, false}) {
    for (bool cuda : {false, true}) {
      if (cuda && !cuda_is_available()) continue;
      std::vector<Tensor> got;
      for (DType dt : {DType::Float64, DType::Float32}) {
        std::vector<Tensor> p = {rnd({n}, 20).to(dt)};
        if (cuda) p[0] = p[0].cuda();
        std::vector<Tensor> m = {zeros_like(p[0])}, v = {zeros_like(p[0])}, vmax = {zeros_like(p[0])}, buf = {Tensor()};
        for (int s = 0; s < steps; ++s) {
          std::vector<Tensor> g = {rnd({n}, 100 + s).to(dt)};
          if (cuda) g[0] = g[0].cuda();
          if (adam) {
            AdamArgs a;
            a.lr = 1e-3;
            a.weight_decay = 0.1;
            a.decoupled = true;
            a.step = s + 1;
            adam_step_(p, g, m, v, vmax, a);
          } else {
            SgdArgs a;
            a.lr = 0.05;
            a.momentum = 0.9;
            a.nesterov = true;
            a.weight_decay = 1e-4;
            sgd_step_(p, g, buf, a);
          }
        }
        got.push_back(p[0]);
      }
      std::printf("| %s | [%lld], %d steps | %s float32 | param %.1e |\n",
                  adam ? "AdamW step (fused)" : "SGD Nesterov step (fused)", static_cast<long long>(n), steps,
                  cuda ? "CUDA" : "CPU", rel_err(got[1], got[0]));
    }
  }
}

// A narrow ResNet-18 (the train_bench model) through SGD steps from one
// initialisation: the parameters' distance from the float64 run's after
// each step, with Winograd and with the direct algorithm.
void trajectory_rows(bool quick) {
  const int steps = quick ? 2 : 5;
  std::vector<std::vector<Tensor>> params(3);
  const char* names[] = {"float64", "float32 direct", "float32 Winograd"};
  std::vector<std::vector<double>> dist(3);
  for (int k = 0; k < 3; ++k) {
    manual_seed(0);
    auto model = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true, .width = 16});
    if (k == 0) model->to(DType::Float64);
    set_cpu_conv_algorithm(k == 2 ? ConvAlgorithm::Auto : ConvAlgorithm::Direct);
    model->train();
    optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < steps; ++s) {
      Tensor x = rnd({16, 1, 28, 28}, 300 + s).to(k == 0 ? DType::Float64 : DType::Float32);
      Generator g(400 + s);
      Tensor y = randint(0, 10, {16}, DType::Int64, &g);
      opt.zero_grad();
      nn::functional::cross_entropy((*model)(x), y).backward();
      opt.step();
      std::vector<Tensor> flat;
      for (const Tensor& p : model->parameters()) flat.push_back(p.detach().flatten().to(DType::Float64));
      params[k].push_back(cat(flat));
    }
  }
  for (int k = 1; k < 3; ++k) {
    std::string row;
    for (int s = 0; s < steps; ++s) {
      char buf[48];
      std::snprintf(buf, sizeof(buf), "%sstep %d %.1e", s ? ", " : "", s + 1, rel_err(params[k][s], params[0][s]));
      row += buf;
    }
    std::printf("| ResNet-18 (width 16) SGD | [16,1,28,28] | %s | params %s |\n", names[k], row.c_str());
  }
  set_cpu_conv_algorithm(ConvAlgorithm::Auto);
}

// Milliseconds per pass of the float32 CPU convolutions above, direct and
// Winograd, the median of 5 (after a warm-up that builds the plans).
void conv_speed_rows(bool quick) {
  const std::vector<ConvLayer> layers = quick
                                            ? std::vector<ConvLayer>{{{2, 16, 14, 14}, 16}}
                                            : std::vector<ConvLayer>{{{64, 64, 28, 28}, 64}, {{64, 128, 14, 14}, 128}};
  for (const ConvLayer& l : layers) {
    std::string row;
    for (ConvAlgorithm a : {ConvAlgorithm::Direct, ConvAlgorithm::Auto}) {
      set_cpu_conv_algorithm(a);
      Tensor x = rnd(l.x, 1).to(DType::Float32).requires_grad_(),
             w = rnd({l.o, l.x[1], 3, 3}, 2, 0.1).to(DType::Float32).requires_grad_();
      std::vector<double> ms;
      for (int i = 0; i < 6; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        Tensor y = conv2d(x, w, Tensor(), {1, 1}, {1, 1});
        sum(y).backward();
        const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (i > 0) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%s%s %.1f ms", row.empty() ? "" : ", ",
                    a == ConvAlgorithm::Direct ? "direct" : "Winograd", ms[ms.size() / 2]);
      row += buf;
    }
    std::printf("| conv2d 3x3 forward + backward, time | %s -> %lld | CPU float32 | %s |\n", shape_str(l.x).c_str(),
                static_cast<long long>(l.o), row.c_str());
  }
  set_cpu_conv_algorithm(ConvAlgorithm::Auto);
}

}  // namespace
}  // namespace ember

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "numerics: unknown flag '%s' (known: --quick)\n", argv[i]);
      return 2;
    }
  }
  using namespace ember;
  std::printf("numerics: max |got - ref| / max |ref| against float64 on the CPU; CUDA: %s\n\n",
              cuda_is_available() ? cuda_device_name().c_str() : "none");
  std::printf("| family | shape | variant | error per pass |\n|---|---|---|---|\n");
  conv_rows(quick);
  matmul_rows(quick);
  reduction_rows(quick);
  attention_rows(quick);
  norm_rows(quick);
  optimizer_rows(quick);
  trajectory_rows(quick);
  conv_speed_rows(quick);
  return 0;
}
