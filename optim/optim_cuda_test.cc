// The CUDA multi-tensor optimizer steps against the CPU ones: every float
// dtype, tensors spanning several chunks, misaligned views (scalar path),
// more tensors than fit in the kernel-parameter table (device-buffer path),
// the optimizer classes on CUDA parameters, checkpoints moved across devices,
// clipping, and a channels-last ResNet's training steps. Skips (with the reason) when no GPU is present.
#include <gtest/gtest.h>

#include <limits>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/ops_optim.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "optim/clip_grad.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

class CudaOptim : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  }
};

double tol(DType t) {
  return t == DType::Float16 ? 4e-3 : t == DType::BFloat16 ? 3e-2 : t == DType::Float32 ? 1e-5 : 1e-12;
}

void expect_close(const Tensor& cpu, const Tensor& gpu, double t, const std::string& what) {
  ASSERT_TRUE(gpu.is_cuda()) << what;
  ASSERT_EQ(cpu.sizes(), gpu.sizes()) << what;
  EXPECT_TRUE(allclose(gpu.cpu(), cpu, t, t)) << what;
}

std::vector<Tensor> to_cuda(const std::vector<Tensor>& v) {
  std::vector<Tensor> out;
  for (const Tensor& t : v) out.push_back(t.defined() ? t.cuda() : Tensor());
  return out;
}

// Parameters of awkward sizes: one element, odd lengths, several 16384-element
// chunks, and a view at offset 1 of a flat buffer (contiguous but not
// 16-byte aligned, so the kernel takes its scalar path).
std::vector<Tensor> make_params(DType dt, Device d, uint64_t seed) {
  Generator gen(seed);
  std::vector<Tensor> ps;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4099}, int64_t{40000}, int64_t{32768}})
    ps.push_back(randn({n}, DType::Float64, &gen).to(d, dt));
  Tensor flat = randn({1001}, DType::Float64, &gen).to(d, dt);
  ps.push_back(flat.narrow(0, 1, 1000));
  return ps;
}

TEST_F(CudaOptim, FusedSgdMatchesCpu) {
  const std::vector<SgdArgs> configs = {
      {{.lr = 0.1}},
      {{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01}},
      {{.lr = 0.05, .momentum = 0.8, .weight_decay = 0.1, .nesterov = true, .maximize = true}},
  };
  for (DType dt : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16})
    for (size_t c = 0; c < configs.size(); ++c) {
      std::vector<Tensor> p = make_params(dt, kCPU, 1), pg = make_params(dt, cuda_device(), 1);
      std::vector<Tensor> b(p.size()), bg(p.size());
      for (int step = 0; step < 3; ++step) {
        std::vector<Tensor> g = make_params(dt, kCPU, 100 + step), gg = make_params(dt, cuda_device(), 100 + step);
        sgd_step_(p, g, b, configs[c]);
        sgd_step_(pg, gg, bg, configs[c]);
      }
      const std::string what = std::string("sgd config ") + std::to_string(c) + " " + dtype_name(dt);
      for (size_t i = 0; i < p.size(); ++i) {
        expect_close(p[i], pg[i], tol(dt), what + " param " + std::to_string(i));
        if (configs[c].momentum != 0) expect_close(b[i], bg[i], tol(dt), what + " buf " + std::to_string(i));
      }
    }
}

TEST_F(CudaOptim, FusedAdamMatchesCpu) {
  const std::vector<AdamArgs> configs = {
      {.lr = 0.01},
      {.lr = 0.01, .beta1 = 0.8, .weight_decay = 0.1, .amsgrad = true},
      {.lr = 0.01, .weight_decay = 0.05, .decoupled = true, .amsgrad = true, .maximize = true},
  };
  for (DType dt : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16})
    for (size_t c = 0; c < configs.size(); ++c) {
      std::vector<Tensor> p = make_params(dt, kCPU, 1), pg = make_params(dt, cuda_device(), 1);
      std::vector<Tensor> m, v, x;
      for (const Tensor& t : p) {
        m.push_back(zeros_like(t));
        v.push_back(zeros_like(t));
        x.push_back(zeros_like(t));
      }
      std::vector<Tensor> mg = to_cuda(m), vg = to_cuda(v), xg = to_cuda(x);
      for (int64_t step = 1; step <= 3; ++step) {
        std::vector<Tensor> g = make_params(dt, kCPU, 200 + step), gg = make_params(dt, cuda_device(), 200 + step);
        AdamArgs a = configs[c];
        a.step = step;
        adam_step_(p, g, m, v, x, a);
        adam_step_(pg, gg, mg, vg, xg, a);
      }
      const std::string what = std::string("adam config ") + std::to_string(c) + " " + dtype_name(dt);
      for (size_t i = 0; i < p.size(); ++i) {
        expect_close(p[i], pg[i], tol(dt), what + " param " + std::to_string(i));
        expect_close(m[i], mg[i], tol(dt), what + " exp_avg " + std::to_string(i));
        expect_close(v[i], vg[i], tol(dt), what + " exp_avg_sq " + std::to_string(i));
      }
    }
}

TEST_F(CudaOptim, DeviceLearningRateStepCountsAndSkipMatchCpu) {
  // lr, the step counts and found_inf as device tensors: the same values as
  // the CPU kernel with the same tensors on the CPU; a set found_inf moves
  // nothing, step counts included.
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    std::vector<Tensor> p = make_params(dt, kCPU, 1), pg = make_params(dt, cuda_device(), 1);
    std::vector<Tensor> m, v, x, steps, stepsg;
    for (const Tensor& t : p) {
      m.push_back(zeros_like(t));
      v.push_back(zeros_like(t));
      x.push_back(zeros_like(t));
      steps.push_back(zeros({}, DType::Float32));
    }
    std::vector<Tensor> mg = to_cuda(m), vg = to_cuda(v), xg = to_cuda(x);
    for (const Tensor& s : steps) stepsg.push_back(s.cuda());
    for (int64_t step = 1; step <= 4; ++step) {
      std::vector<Tensor> g = make_params(dt, kCPU, 200 + step), gg = make_params(dt, cuda_device(), 200 + step);
      const bool skip = step == 3;
      AdamArgs a{.lr = 1.0, .weight_decay = 0.1, .decoupled = true, .amsgrad = true};
      AdamArgs ag = a;
      a.lr_tensor = full({}, 0.01 * step, DType::Float32);
      ag.lr_tensor = a.lr_tensor.cuda();
      a.found_inf = full({}, skip ? 1.0 : 0.0, DType::Float32);
      ag.found_inf = a.found_inf.cuda();
      a.steps = steps;
      ag.steps = stepsg;
      std::vector<double> before = pg[3].cpu().to_vector();
      adam_step_(p, g, m, v, x, a);
      adam_step_(pg, gg, mg, vg, xg, ag);
      if (skip) EXPECT_EQ(pg[3].cpu().to_vector(), before) << "a skipped step moved a parameter";
    }
    for (size_t i = 0; i < p.size(); ++i) {
      const std::string what = std::string(dtype_name(dt)) + " param " + std::to_string(i);
      expect_close(p[i], pg[i], tol(dt), what);
      expect_close(m[i], mg[i], tol(dt), what + " exp_avg");
      EXPECT_EQ(stepsg[i].cpu().item(), 3.0) << what << ": 4 steps, one skipped";
      EXPECT_EQ(steps[i].item(), 3.0) << what;
    }
    // SGD with a device learning rate and skip.
    std::vector<Tensor> b, bg;
    for (int64_t step = 1; step <= 3; ++step) {
      std::vector<Tensor> g = make_params(dt, kCPU, 300 + step), gg = make_params(dt, cuda_device(), 300 + step);
      SgdArgs a{{.lr = 1.0, .momentum = 0.9}};
      SgdArgs ag = a;
      a.lr_tensor = full({}, 0.05, DType::Float32);
      ag.lr_tensor = a.lr_tensor.cuda();
      a.found_inf = full({}, step == 2 ? 1.0 : 0.0, DType::Float32);
      ag.found_inf = a.found_inf.cuda();
      if (b.empty()) {
        b.resize(p.size());
        bg.resize(p.size());
        a.found_inf = Tensor();  // a first step must run: it creates the buffers
        ag.found_inf = Tensor();
      }
      sgd_step_(p, g, b, a);
      sgd_step_(pg, gg, bg, ag);
    }
    for (size_t i = 0; i < p.size(); ++i) {
      expect_close(p[i], pg[i], tol(dt), std::string("sgd ") + dtype_name(dt) + " param " + std::to_string(i));
      expect_close(b[i], bg[i], tol(dt), std::string("sgd ") + dtype_name(dt) + " buf " + std::to_string(i));
    }
  }
}

// Every dtype's every operand depth on the device table: amp_unscale_ (the
// gradients alone), SGD without and with momentum, Adam without and with
// amsgrad (tools/emu_coverage.py --instances found 24 of the device-table
// kernel's 28 instantiations run by no test: every dtype's but float32's
// Adam and SGD with momentum, which this test ran alone).
TEST_F(CudaOptim, ManyTensorsUseTheDeviceTable) {
  // More tensors than the kernel-parameter table's 384: still one launch.
  constexpr int kTensors = 400;
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
    manual_seed(5);
    std::vector<Tensor> p, g, m, v, x, p2, g2, m2, v2, un;
    for (int i = 0; i < kTensors; ++i) {
      const int64_t n = 1 + (i * 37) % 300;
      for (std::vector<Tensor>* l : {&p, &g, &p2, &g2, &un}) l->push_back(randn({n}, DType::Float64).to(dt));
      for (std::vector<Tensor>* l : {&m, &v, &x, &m2, &v2}) l->push_back(zeros({n}, dt));
    }
    // The last tensor's inf: found_inf set from the table's last entry.
    un.back().narrow(0, 0, 1).fill_(std::numeric_limits<double>::infinity());
    std::vector<Tensor> pg = to_cuda(p), gg = to_cuda(g), mg = to_cuda(m), vg = to_cuda(v), xg = to_cuda(x),
                        p2g = to_cuda(p2), g2g = to_cuda(g2), m2g = to_cuda(m2), v2g = to_cuda(v2), ung = to_cuda(un),
                        bufs(p.size()), bufs_g(p.size()), none, none_g;
    Tensor inf = zeros({1}), inf_g = zeros({1}).cuda(), inv = full({1}, 0.5), inv_g = inv.cuda();
    for (int64_t step = 1; step <= 2; ++step) {
      adam_step_(p, g, m, v, x, {.lr = 0.01, .amsgrad = true, .step = step});
      adam_step_(pg, gg, mg, vg, xg, {.lr = 0.01, .amsgrad = true, .step = step});
      adam_step_(p2, g2, m2, v2, none, {.lr = 0.01, .step = step});
      adam_step_(p2g, g2g, m2g, v2g, none_g, {.lr = 0.01, .step = step});
      sgd_step_(p, g, bufs, {{.lr = 0.1, .momentum = 0.9}});
      sgd_step_(pg, gg, bufs_g, {{.lr = 0.1, .momentum = 0.9}});
      sgd_step_(p2, g2, none, {{.lr = 0.1}});
      sgd_step_(p2g, g2g, none_g, {{.lr = 0.1}});
    }
    amp_unscale_(un, inf, inv);
    amp_unscale_(ung, inf_g, inv_g);
    const double t = tol(dt) * (dt == DType::Float32 ? 1 : 4);
    for (size_t i = 0; i < p.size(); ++i) {
      const std::string what = std::string(dtype_name(dt)) + " tensor " + std::to_string(i);
      expect_close(p[i], pg[i], t, what);
      expect_close(x[i], xg[i], t, what + " max_exp_avg_sq");
      expect_close(p2[i], p2g[i], t, what + " (no amsgrad, no momentum)");
      if (i + 1 < p.size()) expect_close(un[i], ung[i], 0, what + " unscaled");
    }
    EXPECT_EQ(inf_g.cpu().item<float>(), 1.0f) << dtype_name(dt) << ": the last tensor's inf not found";
  }
}

// Float32 masters of 16-bit parameters (model_params) in the one kernel:
// the same masters, state and parameters as the CPU's pass, elements
// written from outside re-seeded on both; awkward sizes and 16-bit views
// off alignment (scalar path) in one call with bfloat16 and float16, then
// more tensors than the parameter table holds (device-buffer path) in
// bfloat16 and float16; each with AdamW with amsgrad and SGD with momentum
// and with neither (every depth of both kernels with masters).
// (The emulation reads a misaligned 8-byte vector as x86 does, so it cannot
// show a missing alignment check's fault; a GPU can.)
TEST_F(CudaOptim, MastersMatchCpu) {
  for (int round = 0; round < 6; ++round) {
    // Rounds 0 and 1: the small case; 2 and 3: bfloat16 past the table; 4
    // and 5: float16 past it. Even rounds with amsgrad and momentum.
    const bool many = round >= 2, full = round % 2 == 0;
    const DType many_dt = round <= 3 ? DType::BFloat16 : DType::Float16;
    std::vector<Tensor> low, master;
    if (many) {
      manual_seed(6);
      for (int i = 0; i < 400; ++i) low.push_back(randn({1 + (i * 37) % 300}).to(many_dt));
    } else {
      for (DType dt : {DType::BFloat16, DType::Float16})
        for (const Tensor& t : make_params(dt, kCPU, 1)) low.push_back(t);
    }
    for (const Tensor& l : low) master.push_back(l.to(DType::Float32) * (1.0 + 1e-4));
    // On the device the 16-bit parameters are made there, so the last of
    // each dtype's is a view 2 bytes into its buffer (as ZeRO's shards can
    // be) beside an aligned master: the 16-bit operands' own alignment check.
    std::vector<Tensor> low_g;
    if (many) {
      low_g = to_cuda(low);
    } else {
      for (DType dt : {DType::BFloat16, DType::Float16})
        for (const Tensor& t : make_params(dt, cuda_device(), 1)) low_g.push_back(t);
    }
    const std::vector<Tensor> master_g = to_cuda(master);
    std::vector<Tensor> lc = low, mc = master, lg = low_g, mg = master_g;
    auto zeros_for = [](const std::vector<Tensor>& v) {
      std::vector<Tensor> z;
      for (const Tensor& t : v) z.push_back(zeros_like(t));
      return z;
    };
    std::vector<Tensor> m = zeros_for(mc), v = zeros_for(mc), x = zeros_for(mc), b(mc.size());
    std::vector<Tensor> m_g = zeros_for(mg), v_g = zeros_for(mg), x_g = zeros_for(mg), b_g(mg.size());
    for (int64_t step = 1; step <= 3; ++step) {
      if (step == 2)
        for (std::vector<Tensor>* l : {&lc, &lg})
          for (Tensor& t : *l) t.narrow(0, 0, 1).fill_(0.375);
      std::vector<Tensor> g, g_g;
      for (size_t i = 0; i < lc.size(); ++i) {
        g.push_back(randn(lc[i].sizes(), DType::Float64).to(lc[i].dtype()));
        g_g.push_back(g.back().cuda());
      }
      AdamArgs a{.lr = 0.01, .weight_decay = 0.05, .decoupled = true, .amsgrad = full, .step = step};
      AdamArgs ag = a;
      a.model_params = lc;
      ag.model_params = lg;
      std::vector<Tensor> no_x, no_x_g;
      adam_step_(mc, g, m, v, full ? x : no_x, a);
      adam_step_(mg, g_g, m_g, v_g, full ? x_g : no_x_g, ag);
      SgdArgs s{{.lr = 0.01, .momentum = full ? 0.9 : 0.0}};
      SgdArgs sg = s;
      s.model_params = lc;
      sg.model_params = lg;
      sgd_step_(mc, g, b, s);
      sgd_step_(mg, g_g, b_g, sg);
    }
    for (size_t i = 0; i < lc.size(); ++i) {
      const std::string what = std::string(many ? "many " : "") + (full ? "" : "plain ") + "tensor " +
                               std::to_string(i) + " " + dtype_name(lc[i].dtype());
      expect_close(mc[i], mg[i], 1e-5, what + " master");
      expect_close(lc[i], lg[i], tol(lc[i].dtype()), what + " parameter");
      expect_close(v[i], v_g[i], 1e-5, what + " exp_avg_sq");
      if (full) expect_close(b[i], b_g[i], 1e-5, what + " momentum");
    }
  }
}

TEST_F(CudaOptim, OptimizersOnCudaParamsAndCrossDeviceCheckpoint) {
  auto fresh = [](Device d) {
    Generator gen(9);
    return std::vector<Tensor>{randn({64, 33}, {}, &gen).to(d).requires_grad_(),
                               randn({33}, {}, &gen).to(d).requires_grad_()};
  };
  auto set_grads = [](const std::vector<Tensor>& ps, int step) {
    Generator gen(50 + step);
    for (const Tensor& p : ps) p.set_grad(randn(p.sizes(), {}, &gen).to(p.device()));
  };
  std::vector<Tensor> pc = fresh(kCPU), pg = fresh(cuda_device());
  optim::AdamW oc(pc, {.lr = 0.01, .amsgrad = true}), og(pg, {.lr = 0.01, .amsgrad = true});
  for (int s = 0; s < 3; ++s) {
    set_grads(pc, s);
    set_grads(pg, s);
    oc.step();
    og.step();
  }
  for (size_t i = 0; i < pc.size(); ++i) expect_close(pc[i].detach(), pg[i].detach(), 1e-5, "adamw param");
  // A CUDA checkpoint resumes on CPU parameters: state follows the parameter.
  std::vector<Tensor> pc2;
  for (const Tensor& p : pg) pc2.push_back(p.detach().cpu().requires_grad_());
  optim::AdamW oc2(pc2, {.lr = 0.01, .amsgrad = true});
  oc2.load_state_dict(og.state_dict());
  EXPECT_TRUE(oc2.state(pc2[0]).at("exp_avg").device().is_cpu());
  set_grads(pc2, 3);
  set_grads(pg, 3);
  oc2.step();
  og.step();
  for (size_t i = 0; i < pc2.size(); ++i) expect_close(pc2[i].detach(), pg[i].detach(), 1e-5, "resumed param");
}

TEST_F(CudaOptim, ClipGradNormMatchesCpu) {
  for (double norm_type : {2.0, 1.0, 3.0, static_cast<double>(INFINITY)}) {
    Generator gen(7);
    std::vector<Tensor> pc, pg;
    for (int64_t n : {5, 1000, 77}) {
      Tensor g = randn({n}, {}, &gen);
      pc.push_back(zeros({n}).requires_grad_());
      pg.push_back(zeros({n}, cuda_device()).requires_grad_());
      pc.back().set_grad(g);
      pg.back().set_grad(g.cuda());
    }
    const double nc = optim::clip_grad_norm_(pc, 1.0, norm_type), ng = optim::clip_grad_norm_(pg, 1.0, norm_type);
    EXPECT_NEAR(nc, ng, 1e-5 * nc) << norm_type;
    for (size_t i = 0; i < pc.size(); ++i) expect_close(pc[i].grad(), pg[i].grad(), 1e-5, "clipped grad");
  }
}

// A channels-last ResNet (OHWI weights, NHWC activations, native NHWC
// pooling and batch norm) trains on the device as the NCHW model does on
// the CPU: three SGD steps with momentum and weight decay give the same
// losses and parameters within float32 tolerance, its weights, gradients
// and momentum buffers stay channels-last, and the steps convert no layouts.
TEST_F(CudaOptim, ChannelsLastResNetTrainsAsNchwOnCpu) {
  std::vector<std::shared_ptr<nn::ResNet>> nets;
  for (MemoryFormat f : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
    manual_seed(7);
    nets.push_back(nn::resnet18({.num_classes = 5, .width = 8, .memory_format = f}));
  }
  // float32 as the CPU computes it: TF32 convolutions (the default) would
  // round every product to 10 mantissa bits.
  const bool tf32 = cudnn_allow_tf32();
  set_cudnn_allow_tf32(false);
  nets[1]->to(cuda_device(0));
  optim::SGDOptions o{.lr = 0.01, .momentum = 0.9, .weight_decay = 1e-3};
  optim::SGD cpu_opt(nets[0]->parameters(), o), gpu_opt(nets[1]->parameters(), o);
  Generator gen(8);
  Tensor x = randn({4, 3, 64, 64}, {}, &gen), y = Tensor::from_vector({0, 3, 1, 4}, {4}, DType::Int64);
  Tensor xg = x.cuda().contiguous(MemoryFormat::ChannelsLast), yg = y.cuda();
  auto step = [](nn::Module& net, optim::Optimizer& opt, const Tensor& in, const Tensor& target) {
    opt.zero_grad();
    Tensor loss = nn::functional::cross_entropy(net(in), target);
    loss.backward();
    opt.step();
    return loss.detach();
  };
  // The first step makes the momentum buffers.
  EXPECT_NEAR(step(*nets[0], cpu_opt, x, y).item(), step(*nets[1], gpu_opt, xg, yg).item(), 1e-4) << "step 0";
  for (int s = 1; s < 3; ++s) {
    const uint64_t before = cuda_layout_copies();
    const double lg = step(*nets[1], gpu_opt, xg, yg).item();
    EXPECT_EQ(cuda_layout_copies() - before, 0u) << "step " << s;
    const double lc = step(*nets[0], cpu_opt, x, y).item();
    EXPECT_NEAR(lc, lg, 1e-4) << "step " << s;
  }
  const auto cpu_params = nets[0]->named_parameters(), gpu_params = nets[1]->named_parameters();
  ASSERT_EQ(cpu_params.size(), gpu_params.size());
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    const auto& [name, p] = gpu_params[i];
    expect_close(cpu_params[i].second, p, 2e-4, name);
    if (p.dim() != 4) continue;
    EXPECT_TRUE(p.is_contiguous(MemoryFormat::ChannelsLast)) << name;
    EXPECT_TRUE(p.grad().is_contiguous(MemoryFormat::ChannelsLast)) << name;
    EXPECT_TRUE(gpu_opt.state(p).at("momentum_buffer").is_contiguous(MemoryFormat::ChannelsLast)) << name;
  }
  set_cudnn_allow_tf32(tf32);
}

}  // namespace
}  // namespace ember
