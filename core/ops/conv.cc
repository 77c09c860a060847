// conv2d: CPU kernels and the op layer (conv.cu has the cuDNN launchers).
//
// float32 runs on oneDNN. Creating a oneDNN primitive (a JIT compile) costs
// far more than running a small one, and a training loop repeats the same
// shapes every step, so each (geometry, pass) gets a plan built once and
// cached. Plans let oneDNN pick its own blocked layouts (format_tag::any) and
// reorder our plain NCHW/OIHW tensors in and out around each call. Measured
// through conv2d on a ResNet-like 64->64 3x3 conv (28x28, batch 64, float32,
// 2 AVX-512 cores, best of 4): plain layouts get GEMM-based kernels, 21 ms
// forward + 60 ms backward; blocked layouts get the direct JIT kernels, 16 ms
// + 33 ms, reorders included. Forward is about even (the reorders eat the
// kernel's gain); both backward passes are ~2x faster.
//
// oneDNN 2.6 has no float64 convolution, and float64 is what the gradient
// checker uses, so float64 runs direct loops written to be obviously right,
// not fast. bfloat16/float16 run on oneDNN's native 16-bit kernels where the
// CPU has them (bfloat16 on AVX512-BF16 or AMX: 1.4x the float32 ResNet step
// on 2 Zen 5 cores, see bench/README.md); a plan oneDNN cannot build, or would run
// with its slow reference implementation, falls back to widening to float32.
#include "core/autocast.h"

#include <array>
#include <atomic>
#include <compare>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/kernels.h"
#include "core/ops/onednn.h"
#include "core/ops_nn.h"

namespace ember {

// ---- Reference loops (float64) ----
namespace {
// y[n, o] = b[o] + sum over the group's input channels and the kernel.
template <typename T>
void conv_forward_ref(const ConvGeom& g, const T* x, const T* w, const T* b, T* y) {
  const int64_t cg = g.c / g.groups, og = g.o / g.groups;
  parallel_for(g.n * g.o, 1, [&](int64_t begin, int64_t end) {
    for (int64_t no = begin; no < end; ++no) {
      const int64_t n = no / g.o, o = no % g.o, c0 = (o / og) * cg;
      for (int64_t oh = 0; oh < g.oh; ++oh)
        for (int64_t ow = 0; ow < g.ow; ++ow) {
          T acc = b ? b[o] : T(0);
          for (int64_t ci = 0; ci < cg; ++ci)
            for (int64_t kh = 0; kh < g.kh; ++kh) {
              const int64_t ih = oh * g.sh - g.ph + kh * g.dh;
              if (ih < 0 || ih >= g.h) continue;
              for (int64_t kw = 0; kw < g.kw; ++kw) {
                const int64_t iw = ow * g.sw - g.pw + kw * g.dw;
                if (iw < 0 || iw >= g.w) continue;
                acc += x[((n * g.c + c0 + ci) * g.h + ih) * g.w + iw] * w[((o * cg + ci) * g.kh + kh) * g.kw + kw];
              }
            }
          y[(no * g.oh + oh) * g.ow + ow] = acc;
        }
    }
  });
}

// Gathers into each dx element from the outputs whose windows cover it, so
// threads own disjoint dx planes and nothing races.
template <typename T>
void conv_backward_data_ref(const ConvGeom& g, const T* dy, const T* w, T* dx) {
  const int64_t cg = g.c / g.groups, og = g.o / g.groups;
  parallel_for(g.n * g.c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nc = begin; nc < end; ++nc) {
      const int64_t n = nc / g.c, c = nc % g.c, ci = c % cg, o0 = (c / cg) * og;
      for (int64_t ih = 0; ih < g.h; ++ih)
        for (int64_t iw = 0; iw < g.w; ++iw) {
          T acc = 0;
          for (int64_t o = o0; o < o0 + og; ++o)
            for (int64_t kh = 0; kh < g.kh; ++kh) {
              const int64_t th = ih + g.ph - kh * g.dh;  // = oh * sh
              if (th < 0 || th % g.sh != 0 || th / g.sh >= g.oh) continue;
              for (int64_t kw = 0; kw < g.kw; ++kw) {
                const int64_t tw = iw + g.pw - kw * g.dw;
                if (tw < 0 || tw % g.sw != 0 || tw / g.sw >= g.ow) continue;
                acc += dy[((n * g.o + o) * g.oh + th / g.sh) * g.ow + tw / g.sw] *
                       w[((o * cg + ci) * g.kh + kh) * g.kw + kw];
              }
            }
          dx[(nc * g.h + ih) * g.w + iw] = acc;
        }
    }
  });
}

// Threads own output channels: dw[o] and db[o].
template <typename T>
void conv_backward_weights_ref(const ConvGeom& g, const T* x, const T* dy, T* dw, T* db) {
  const int64_t cg = g.c / g.groups, og = g.o / g.groups;
  parallel_for(g.o, 1, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const int64_t c0 = (o / og) * cg;
      if (dw) {
        for (int64_t ci = 0; ci < cg; ++ci)
          for (int64_t kh = 0; kh < g.kh; ++kh)
            for (int64_t kw = 0; kw < g.kw; ++kw) {
              T acc = 0;
              for (int64_t n = 0; n < g.n; ++n)
                for (int64_t oh = 0; oh < g.oh; ++oh) {
                  const int64_t ih = oh * g.sh - g.ph + kh * g.dh;
                  if (ih < 0 || ih >= g.h) continue;
                  for (int64_t ow = 0; ow < g.ow; ++ow) {
                    const int64_t iw = ow * g.sw - g.pw + kw * g.dw;
                    if (iw < 0 || iw >= g.w) continue;
                    acc += dy[((n * g.o + o) * g.oh + oh) * g.ow + ow] * x[((n * g.c + c0 + ci) * g.h + ih) * g.w + iw];
                  }
                }
              dw[((o * cg + ci) * g.kh + kh) * g.kw + kw] = acc;
            }
      }
      if (db) {
        T acc = 0;
        for (int64_t n = 0; n < g.n; ++n)
          for (int64_t i = 0; i < g.oh * g.ow; ++i) acc += dy[(n * g.o + o) * g.oh * g.ow + i];
        db[o] = acc;
      }
    }
  });
}

}  // namespace

// ---- oneDNN plans (float32) ----
namespace {
using dnnl::memory;
using Tag = memory::format_tag;

using onednn::cpu_engine;
using onednn::cpu_stream;

enum class Pass { Forward, BackwardData, BackwardWeights };

// float32, and bfloat16/float16 where the CPU has native kernels for them.
struct PlanKey {
  std::array<int64_t, 16> geom;
  bool bias;
  Pass pass;
  memory::data_type dt;
  bool winograd;
  auto operator<=>(const PlanKey&) const = default;
};

// One primitive argument: our plain layout, the one the primitive chose, and
// the reorder between them (plain -> chosen for inputs, back for outputs).
struct ArgPlan {
  int arg;
  memory::desc plain, chosen;
  bool output;
  bool reordered;
  dnnl::reorder reorder;
};

struct Plan {
  std::string impl;  // oneDNN's implementation name ("brg:avx512_core_bf16", "ref:any", ...)
  dnnl::primitive prim;
  memory::desc scratchpad;
  std::vector<ArgPlan> args;
};

ArgPlan arg_plan(int arg, const memory::desc& plain, const memory::desc& chosen, bool output) {
  ArgPlan a{arg, plain, chosen, output, plain != chosen, {}};
  if (a.reordered) {
    auto& e = cpu_engine();
    a.reorder = output ? dnnl::reorder(dnnl::reorder::primitive_desc(e, chosen, e, plain))
                       : dnnl::reorder(dnnl::reorder::primitive_desc(e, plain, e, chosen));
  }
  return a;
}

std::unique_ptr<Plan> make_plan(const ConvGeom& g, bool bias, Pass pass, memory::data_type f32, bool winograd) {
  const memory::dims xd{g.n, g.c, g.h, g.w}, yd{g.n, g.o, g.oh, g.ow};
  // Grouped weights are 5-D for oneDNN; goihw is the same memory as our OIHW.
  const memory::dims wd = g.groups == 1 ? memory::dims{g.o, g.c, g.kh, g.kw}
                                        : memory::dims{g.groups, g.o / g.groups, g.c / g.groups, g.kh, g.kw};
  const memory::desc x_plain(xd, f32, Tag::nchw), y_plain(yd, f32, Tag::nchw), b_plain({g.o}, f32, Tag::x);
  const memory::desc w_plain(wd, f32, g.groups == 1 ? Tag::oihw : Tag::goihw);
  const memory::desc x_any(xd, f32, Tag::any), y_any(yd, f32, Tag::any), w_any(wd, f32, Tag::any);
  // oneDNN counts dilation from 0 and pads right explicitly; with symmetric
  // padding its floor formula gives exactly PyTorch's output size.
  const memory::dims strides{g.sh, g.sw}, dil{g.dh - 1, g.dw - 1}, pad{g.ph, g.pw};
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // per-call scratch: plans run concurrently
  // The three passes of one convolution use one algorithm: the backward
  // descriptors take the forward's as their hint.
  const auto algo = winograd ? dnnl::algorithm::convolution_winograd : dnnl::algorithm::convolution_direct;
  using Fwd = dnnl::convolution_forward;
  const bool fwd_bias = bias && pass != Pass::BackwardData;
  auto fdesc = fwd_bias ? Fwd::desc(dnnl::prop_kind::forward_training, algo, x_any, w_any, b_plain, y_any, strides,
                                    dil, pad, pad)
                        : Fwd::desc(dnnl::prop_kind::forward_training, algo, x_any, w_any, y_any, strides, dil, pad,
                                    pad);
  Fwd::primitive_desc fwd_pd(fdesc, attr, cpu_engine());
  auto p = std::make_unique<Plan>();
  switch (pass) {
    case Pass::Forward:
      p->prim = Fwd(fwd_pd);
      p->impl = fwd_pd.impl_info_str();
      p->scratchpad = fwd_pd.scratchpad_desc();
      p->args = {arg_plan(DNNL_ARG_SRC, x_plain, fwd_pd.src_desc(), false),
                 arg_plan(DNNL_ARG_WEIGHTS, w_plain, fwd_pd.weights_desc(), false),
                 arg_plan(DNNL_ARG_DST, y_plain, fwd_pd.dst_desc(), true)};
      if (bias) p->args.push_back(arg_plan(DNNL_ARG_BIAS, b_plain, b_plain, false));
      break;
    case Pass::BackwardData: {
      using Bwd = dnnl::convolution_backward_data;
      Bwd::primitive_desc pd(Bwd::desc(algo, x_any, w_any, y_any, strides, dil, pad, pad), attr, cpu_engine(), fwd_pd);
      p->prim = Bwd(pd);
      p->impl = pd.impl_info_str();
      p->scratchpad = pd.scratchpad_desc();
      p->args = {arg_plan(DNNL_ARG_DIFF_DST, y_plain, pd.diff_dst_desc(), false),
                 arg_plan(DNNL_ARG_WEIGHTS, w_plain, pd.weights_desc(), false),
                 arg_plan(DNNL_ARG_DIFF_SRC, x_plain, pd.diff_src_desc(), true)};
      break;
    }
    case Pass::BackwardWeights: {
      using Bwd = dnnl::convolution_backward_weights;
      auto desc = bias ? Bwd::desc(algo, x_any, w_any, b_plain, y_any, strides, dil, pad, pad)
                       : Bwd::desc(algo, x_any, w_any, y_any, strides, dil, pad, pad);
      Bwd::primitive_desc pd(desc, attr, cpu_engine(), fwd_pd);
      p->prim = Bwd(pd);
      p->impl = pd.impl_info_str();
      p->scratchpad = pd.scratchpad_desc();
      p->args = {arg_plan(DNNL_ARG_SRC, x_plain, pd.src_desc(), false),
                 arg_plan(DNNL_ARG_DIFF_DST, y_plain, pd.diff_dst_desc(), false),
                 arg_plan(DNNL_ARG_DIFF_WEIGHTS, w_plain, pd.diff_weights_desc(), true)};
      if (bias) p->args.push_back(arg_plan(DNNL_ARG_DIFF_BIAS, b_plain, pd.diff_bias_desc(), true));
      break;
    }
  }
  return p;
}

// The algorithm setting, read from EMBER_CONV_ALGO at the first use (not
// at load time, where a bad value could only terminate the process): a bad
// value is then an error from the first convolution, naming the variable.
std::atomic<int>& conv_algorithm_setting() {
  static std::atomic<int> setting{[] {
    const char* e = std::getenv("EMBER_CONV_ALGO");
    if (e == nullptr || std::string(e) == "auto" || std::string(e).empty()) return static_cast<int>(ConvAlgorithm::Auto);
    EMBER_CHECK(std::string(e) == "direct", "EMBER_CONV_ALGO must be 'auto' or 'direct', got '", e, "'");
    return static_cast<int>(ConvAlgorithm::Direct);
  }()};
  return setting;
}

// Winograd F(4x4, 3x3): 3x3 windows, stride 1, no dilation, no groups, and
// at least 8 input and output channels: oneDNN's Winograd works on blocks of
// 16 channels, so a 1-channel stem (Fashion-MNIST's) padded to 16 took 10x
// the direct kernel's time (1.1 against 0.1 ms, batch 64 at 28x28).
bool winograd_eligible(const ConvGeom& g) {
  return conv_algorithm_setting().load(std::memory_order_relaxed) == static_cast<int>(ConvAlgorithm::Auto) && g.kh == 3 &&
         g.kw == 3 && g.sh == 1 && g.sw == 1 && g.dh == 1 && g.dw == 1 && g.groups == 1 && g.c >= 8 && g.o >= 8;
}

// Plans live for the process: a model has a handful of distinct shapes.
// A 16-bit plan the CPU cannot run (no native kernel: oneDNN refuses it, or
// picks its slow reference implementation) is cached as null, and the caller
// widens to float32 instead.
const Plan* plan_for(const ConvGeom& g, bool bias, Pass pass,
                     memory::data_type dt = memory::data_type::f32) {
  static std::mutex mu;
  static std::map<PlanKey, std::unique_ptr<Plan>> cache;
  const bool f32 = dt == memory::data_type::f32;
  const bool winograd = f32 && winograd_eligible(g);
  const PlanKey key{{g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.groups, g.oh, g.ow},
                    bias,
                    pass,
                    dt,
                    winograd};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    std::unique_ptr<Plan> plan;
    if (winograd) {
      try {
        plan = make_plan(g, bias, pass, dt, true);
      } catch (const dnnl::error&) {
        // No Winograd kernel on this CPU (oneDNN has it for AVX-512 only): direct.
      }
    }
    try {
      if (!plan) plan = make_plan(g, bias, pass, dt, false);
    } catch (const dnnl::error&) {
      if (f32) throw;
    }
    if (plan && !f32 && onednn::is_reference_impl(plan->impl.c_str())) plan.reset();
    it = cache.emplace(key, std::move(plan)).first;
  }
  return it->second.get();
}

// Inputs already reordered in this call of an op (buffer, layout): the two
// backward passes both read dy, usually in the same blocked layout, so the
// second reuses the first's copy (a bfloat16 ResNet step spends ~15% of its
// time in reorders).
struct Reordered {
  std::vector<std::tuple<const void*, memory::desc, memory>> entries;
  std::vector<Tensor> temps;  // their buffers
  const memory* find(const void* data, const memory::desc& d) const {
    for (const auto& [p, desc, m] : entries)
      if (p == data && desc == d) return &m;
    return nullptr;
  }
};

// Runs a plan on our buffers (`ptrs`: DNNL_ARG_* -> data), reordering
// through temporaries where the plan chose other layouts; `shared` (may be
// null) keeps reordered inputs for a later plan of the same op.
void run_plan(const Plan& p, std::initializer_list<std::pair<int, void*>> ptrs, Reordered* shared = nullptr) {
  auto& engine = cpu_engine();
  auto& stream = cpu_stream();
  std::vector<Tensor> temps;  // reorder targets and scratchpad, until the stream is done
  std::unordered_map<int, memory> args;
  std::vector<std::pair<const ArgPlan*, memory>> outputs;  // (plan, our buffer) to reorder back into
  for (const ArgPlan& a : p.args) {
    void* data = nullptr;
    for (const auto& [id, ptr] : ptrs)
      if (id == a.arg) data = ptr;
    EMBER_INTERNAL_ASSERT(data != nullptr, "conv2d: no buffer for oneDNN argument ", a.arg);
    memory ours(a.plain, engine, data);
    if (!a.reordered) {
      args.emplace(a.arg, ours);
      continue;
    }
    if (!a.output && shared) {
      if (const memory* m = shared->find(data, a.chosen)) {
        args.emplace(a.arg, *m);
        continue;
      }
    }
    memory tmp = onednn::scratch_memory(a.chosen, shared && !a.output ? shared->temps : temps);
    if (a.output) outputs.emplace_back(&a, ours);
    else a.reorder.execute(stream, ours, tmp);
    if (!a.output && shared) shared->entries.emplace_back(data, a.chosen, tmp);
    args.emplace(a.arg, tmp);
  }
  if (p.scratchpad.get_size() > 0) args.emplace(DNNL_ARG_SCRATCHPAD, onednn::scratch_memory(p.scratchpad, temps));
  p.prim.execute(stream, args);
  for (auto& [a, ours] : outputs) a->reorder.execute(stream, args.at(a->arg), ours);
  stream.wait();
}

bool is_half_like(DType t) { return t == DType::Float16 || t == DType::BFloat16; }
Tensor to_f32(const Tensor& t) { return t.defined() ? t.to(DType::Float32) : t; }
}  // namespace

void set_cpu_conv_algorithm(ConvAlgorithm algorithm) {
  conv_algorithm_setting().store(static_cast<int>(algorithm), std::memory_order_relaxed);
}
ConvAlgorithm cpu_conv_algorithm() { return static_cast<ConvAlgorithm>(conv_algorithm_setting().load(std::memory_order_relaxed)); }

// One oneDNN path for float32 and the 16-bit types; a 16-bit type without a
// native plan widens to float32; float64 runs the reference loops.
void conv2d_forward_cpu(const ConvGeom& g, const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  if (x.dtype() == DType::Float64) {
    conv_forward_ref<double>(g, x.data<double>(), w.data<double>(), data_or_null<double>(&bias), y.data<double>());
    return;
  }
  EMBER_CHECK(x.dtype() == DType::Float32 || is_half_like(x.dtype()), "conv2d: unsupported dtype ", x.dtype());
  const Plan* p = plan_for(g, bias.defined(), Pass::Forward, onednn::data_type(x.dtype()));
  if (!p) {  // only a 16-bit type can lack a plan
    Tensor y32 = Tensor::empty(y.sizes(), DType::Float32);
    conv2d_forward_cpu(g, to_f32(x), to_f32(w), to_f32(bias), y32);
    y.copy_(y32);
    return;
  }
  // The bias has x's dtype (conv_geom checks); a plan without bias never
  // asks for DNNL_ARG_BIAS.
  run_plan(*p, {{DNNL_ARG_SRC, x.raw_data()}, {DNNL_ARG_WEIGHTS, w.raw_data()}, {DNNL_ARG_DST, y.raw_data()},
                {DNNL_ARG_BIAS, bias.defined() ? bias.raw_data() : nullptr}});
}

void conv2d_backward_cpu(const ConvGeom& g, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                         Tensor* dw, Tensor* db) {
  if (x.dtype() == DType::Float64) {
    if (dx) conv_backward_data_ref<double>(g, dy.data<double>(), w.data<double>(), dx->data<double>());
    if (dw || db)
      conv_backward_weights_ref<double>(g, x.data<double>(), dy.data<double>(), data_or_null<double>(dw),
                                        data_or_null<double>(db));
    return;
  }
  EMBER_CHECK(x.dtype() == DType::Float32 || is_half_like(x.dtype()), "conv2d: unsupported dtype ", x.dtype());
  const auto dt = onednn::data_type(x.dtype());
  const Plan* pd = dx ? plan_for(g, false, Pass::BackwardData, dt) : nullptr;
  const Plan* pw = (dw || db) ? plan_for(g, db != nullptr, Pass::BackwardWeights, dt) : nullptr;
  if ((dx && !pd) || ((dw || db) && !pw)) {  // a 16-bit type without native plans: through float32
    Tensor dx32 = dx ? Tensor::empty(dx->sizes(), DType::Float32) : Tensor();
    Tensor dw32 = dw ? Tensor::empty(dw->sizes(), DType::Float32) : Tensor();
    Tensor db32 = db ? Tensor::empty(db->sizes(), DType::Float32) : Tensor();
    conv2d_backward_cpu(g, to_f32(x), to_f32(w), to_f32(dy), dx ? &dx32 : nullptr, dw ? &dw32 : nullptr,
                        db ? &db32 : nullptr);
    if (dx) dx->copy_(dx32);
    if (dw) dw->copy_(dw32);
    if (db) db->copy_(db32);
    return;
  }
  Reordered shared;  // dy, reordered once for both passes
  if (pd)
    run_plan(*pd, {{DNNL_ARG_DIFF_DST, dy.raw_data()}, {DNNL_ARG_WEIGHTS, w.raw_data()},
                   {DNNL_ARG_DIFF_SRC, dx->raw_data()}}, &shared);
  if (pw) {
    // oneDNN computes both in one pass; dw needs a buffer even if unwanted.
    Tensor dw_buf = dw ? *dw : Tensor::empty(w.sizes(), w.options());
    run_plan(*pw, {{DNNL_ARG_SRC, x.raw_data()}, {DNNL_ARG_DIFF_DST, dy.raw_data()},
                   {DNNL_ARG_DIFF_WEIGHTS, dw_buf.raw_data()}, {DNNL_ARG_DIFF_BIAS, db ? db->raw_data() : nullptr}},
             &shared);
  }
}

// ---- Op layer ----
namespace {
using Dims = std::array<int64_t, 2>;

bool is_channels_last(const Tensor& t) { return t.suggest_memory_format() == MemoryFormat::ChannelsLast; }
// cuDNN reads NCHW or NHWC strides; anything else is copied to one of them.
Tensor to_layout(const Tensor& t, bool channels_last) {
  return channels_last ? t.permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2}) : t.contiguous();
}
Tensor empty_layout(const Shape& s, TensorOptions opts, bool channels_last) {
  return channels_last ? Tensor::empty({s[0], s[2], s[3], s[1]}, opts).permute({0, 3, 1, 2}) : Tensor::empty(s, opts);
}

ConvGeom conv_geom(const Tensor& x, const Tensor& w, const Tensor& b, Dims stride, Dims padding, Dims dilation,
                   int64_t groups) {
  EMBER_CHECK(x.defined() && w.defined(), "conv2d: input and weight must be defined");
  EMBER_CHECK(x.dim() == 4, "conv2d: expected a 4-D input [N, C, H, W], got ", shape_str(x.sizes()));
  EMBER_CHECK(w.dim() == 4, "conv2d: expected a 4-D weight [O, C/groups, KH, KW], got ", shape_str(w.sizes()),
              " for input ", shape_str(x.sizes()));
  EMBER_CHECK(is_floating(x.dtype()), "conv2d: expected a floating input, got ", x.dtype());
  EMBER_CHECK(w.dtype() == x.dtype() && (!b.defined() || b.dtype() == x.dtype()), "conv2d: input (", x.dtype(),
              "), weight (", w.dtype(), ") and bias must have the same dtype");
  EMBER_CHECK(w.device() == x.device() && (!b.defined() || b.device() == x.device()), "conv2d: input is on ",
              x.device(), " but weight is on ", w.device(), b.defined() ? " and bias on " : "",
              b.defined() ? b.device().str() : "");
  EMBER_CHECK(groups > 0, "conv2d: groups must be positive, got ", groups);
  EMBER_CHECK(x.size(1) % groups == 0 && w.size(0) % groups == 0, "conv2d: groups=", groups,
              " must divide both the input channels of ", shape_str(x.sizes()), " and the output channels of weight ",
              shape_str(w.sizes()));
  EMBER_CHECK(w.size(1) * groups == x.size(1), "conv2d: input ", shape_str(x.sizes()), " has ", x.size(1),
              " channels, but weight ", shape_str(w.sizes()), " with groups=", groups, " expects ",
              w.size(1) * groups);
  EMBER_CHECK(x.size(1) > 0 && w.size(2) > 0 && w.size(3) > 0, "conv2d: empty channels or kernel: input ",
              shape_str(x.sizes()), ", weight ", shape_str(w.sizes()));
  // As PyTorch: only the batch may be empty. An empty H or W with enough
  // padding would give a non-empty output of bias values on the CPU, but
  // cuDNN rejects the descriptor (found by the emulated cuDNN), so the two
  // backends would disagree.
  EMBER_CHECK(x.size(2) > 0 && x.size(3) > 0, "conv2d: input ", shape_str(x.sizes()),
              " has an empty spatial dimension; only the batch dimension may be 0");
  EMBER_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0)), "conv2d: bias ",
              shape_str(b.defined() ? b.sizes() : Shape{}), " must be [", w.size(0), "] for weight ",
              shape_str(w.sizes()));
  for (int i = 0; i < 2; ++i)
    EMBER_CHECK(stride[i] > 0 && dilation[i] > 0 && padding[i] >= 0, "conv2d: stride [", stride[0], ",", stride[1],
                "] and dilation [", dilation[0], ",", dilation[1], "] must be positive and padding [", padding[0],
                ",", padding[1], "] non-negative");
  ConvGeom g{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3), stride[0], stride[1],
             padding[0], padding[1], dilation[0], dilation[1], groups, 0, 0};
  const int64_t eh = (g.kh - 1) * g.dh + 1, ew = (g.kw - 1) * g.dw + 1;  // dilated kernel extent
  EMBER_CHECK(g.h + 2 * g.ph >= eh && g.w + 2 * g.pw >= ew, "conv2d: kernel ", g.kh, "x", g.kw, " (", eh, "x", ew,
              " dilated) is larger than the padded input ", g.h + 2 * g.ph, "x", g.w + 2 * g.pw, " of input ",
              shape_str(x.sizes()), ", weight ", shape_str(w.sizes()));
  g.oh = (g.h + 2 * g.ph - eh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - ew) / g.sw + 1;
  return g;
}
}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, Dims stride, Dims padding, Dims dilation,
              int64_t groups) {
  // Under autocast (autocast.h): the inputs in low precision, then again.
  // On CUDA the input also goes channels-last, the layout of cuDNN's
  // tensor-core kernels: the output stays channels-last, and so do the
  // batch norm, ReLU, pooling and residual adds after it, so only the first
  // convolution of a network pays for the layout copy.
  if (Tensor lx = autocast::low(x), lw = autocast::low(weight), lb = autocast::low(bias);
      !lx.is_same(x) || !lw.is_same(weight) || (bias.defined() && !lb.is_same(bias))) {
    if (lx.is_cuda() && lx.dim() == 4 && is_floating(lx.dtype()) && lx.dtype() != DType::Float64 &&
        !is_channels_last(lx))
      lx = lx.contiguous(MemoryFormat::ChannelsLast);
    return conv2d(lx, lw, lb, stride, padding, dilation, groups);
  }
  const ConvGeom g = conv_geom(x, weight, bias, stride, padding, dilation, groups);
  // Channels-last input stays channels-last on CUDA (cuDNN is fastest in
  // NHWC with tensor cores), except float64, for which cuDNN has few NHWC
  // kernels; the CPU kernels want plain NCHW. As PyTorch's
  // cudnn_conv_suggest_memory_format, a channels-last weight also decides:
  // a 1x1 activation is both layouts, and its OHWI weight stays as it is.
  const bool cl_in = x.is_cuda() && x.dtype() != DType::Float64 && (is_channels_last(x) || is_channels_last(weight));
  // Channels-last float32 without TF32 may compute in NCHW (device.h): the
  // result and dx go back to channels-last, so only this op sees NCHW.
  const bool via_nchw =
      cl_in && x.dtype() == DType::Float32 && !cudnn_allow_tf32() && cudnn_fp32_channels_last_via_nchw();
  const bool cl = cl_in && !via_nchw;
  Tensor xc, wc, bc;
  {
    NoGradGuard no_grad;  // the layout copies are kernel inputs, not graph nodes
    xc = to_layout(x, cl).detach();
    wc = to_layout(weight, cl).detach();
    if (bias.defined()) bc = bias.contiguous().detach();
  }
  return differentiable(
      "conv2d", {x, weight, bias},
      [&] {
        Tensor y = empty_layout({g.n, g.o, g.oh, g.ow}, x.options(), cl);
        if (y.numel() == 0) return y;
        if (x.is_cuda())
          conv2d_forward_cuda(g, xc, wc, bc, y);
        else
          conv2d_forward_cpu(g, xc, wc, bc, y);
        return via_nchw ? to_layout(y, true) : y;
      },
      [&](const Tensor&) {
        const bool need_x_ = x.requires_grad(), need_w_ = weight.requires_grad();
        const bool need_b_ = bias.defined() && bias.requires_grad();
        BackwardFn fn = [=](const Tensor& gy) {
          const bool need_x = need_x_ && grad_wanted(0), need_w = need_w_ && grad_wanted(1);
          const bool need_b = need_b_ && grad_wanted(2);
          Tensor dy = to_layout(gy, cl);
          Tensor dx = need_x ? empty_layout(xc.sizes(), xc.options(), cl) : Tensor();
          Tensor dw = need_w ? empty_layout(wc.sizes(), wc.options(), cl) : Tensor();
          Tensor db = need_b ? Tensor::empty({g.o}, bc.options()) : Tensor();
          if (dy.numel() == 0 || xc.numel() == 0) {  // empty batch: nothing flows back
            for (Tensor* t : {&dx, &dw, &db})
              if (t->defined()) t->zero_();
          } else if (xc.is_cuda()) {
            conv2d_backward_cuda(g, xc, wc, dy, need_x ? &dx : nullptr, need_w ? &dw : nullptr);
            // The bias gradient is a plain reduction: the reduction kernels' job
            // (strided over N, H, W in either layout), not a kernel of its own.
            if (need_b) db = sum(dy, {0, 2, 3}).to(bc.dtype());
          } else {
            conv2d_backward_cpu(g, xc, wc, dy, need_x ? &dx : nullptr, need_w ? &dw : nullptr, need_b ? &db : nullptr);
          }
          if (via_nchw && dx.defined()) dx = to_layout(dx, true);
          return std::vector<Tensor>{dx, dw, db};
        };
        return Recorded{fn, {xc, wc}};
      });
}

}  // namespace ember
