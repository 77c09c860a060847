// conv2d on CUDA through cuDNN's legacy convolution API: forward, backward
// data and backward filter, grouped, for float32/float64/float16/bfloat16.
// Tensor descriptors carry the tensors' real strides, so NHWC-strided
// (channels-last) tensors run without a layout copy; the filter descriptor's
// format follows the weight's layout (the op layer keeps the two matching).
//
// Precision: float32 may use TF32 tensor cores when cudnn_allow_tf32() (on
// by default, as PyTorch's torch.backends.cudnn.allow_tf32), else it runs
// with CUDNN_FMA_MATH and matches the CPU; 16-bit types use tensor cores with
// float accumulation; float64 computes in double.
// EMBER_CUDNN_LOG=1 prints one line per cached key: the pass, the geometry,
// the algorithm, its math type and its workspace, to set beside cuDNN's own
// log (CUDNN_LOGLEVEL_DBG) or PyTorch's choices on a GPU.
//
// Algorithms come from cuDNN's heuristics (Get*_v7, checked and completed by
// pick below) or, in benchmark mode (cudnn_benchmark(), PyTorch's
// cudnn.benchmark), from timing them all once (cudnnFind*Ex), once per
// (device, geometry, strides, dtype, layout, pass, math, mode) and cached
// with the descriptors and workspace size as a Plan:
// the query costs far more than a small convolution, and training repeats
// shapes every step.
// Workspaces come from our caching allocator, which is stream-ordered, so a
// workspace can be freed as soon as the call is queued. Bias add and bias
// gradient are our own small kernels: cuDNN's are deprecated and do not take
// every dtype.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <climits>
#include <compare>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

// ---- Handle, types, descriptors ----

struct CudnnSlot {
  std::once_flag once;
  cudnnHandle_t handle = nullptr;
  // Serializes cudnnSetStream + the calls that follow: the handle's stream is
  // shared state, as with the cuBLAS handle in matmul.cu.
  std::mutex mu;
};

CudnnSlot& cudnn_slot(int device) {
  EMBER_CHECK(device >= 0 && device < cuda::kMaxCudaDevices, "conv2d: CUDA device index ", device, " out of range");
  // Leaked on purpose: cudnnDestroy at static-destruction time can run after
  // the CUDA runtime has shut down.
  static CudnnSlot slots[cuda::kMaxCudaDevices];
  CudnnSlot& s = slots[device];
  std::call_once(s.once, [&] {
    cuda::DeviceGuard guard(device);
    EMBER_CUDNN_CHECK(cudnnCreate(&s.handle));
  });
  return s;
}

struct ConvTypes {
  cudnnDataType_t data, compute;
  cudnnMathType_t math;
};

// Read once per call, so every pass of one call agrees on the math.
ConvTypes conv_types(DType t) {
  switch (t) {
    case DType::Float32:
      return {CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, cudnn_allow_tf32() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH};
    case DType::Float64: return {CUDNN_DATA_DOUBLE, CUDNN_DATA_DOUBLE, CUDNN_DEFAULT_MATH};
    case DType::Float16: return {CUDNN_DATA_HALF, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH};
    case DType::BFloat16: return {CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH};
    default: break;
  }
  EMBER_CHECK(false, "conv2d: dtype ", t, " not supported on CUDA (use float32, float64, float16 or bfloat16)");
  return {};
}

int to_int(int64_t v) {
  EMBER_CHECK(v >= 0 && v <= INT_MAX, "conv2d: size or stride ", v, " exceeds cuDNN's 32-bit limit");
  return static_cast<int>(v);
}

class TensorDesc {
 public:
  TensorDesc(const Tensor& t, cudnnDataType_t dt) {
    EMBER_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d_));
    const Shape &s = t.sizes(), &st = t.strides();
    EMBER_CUDNN_CHECK(cudnnSetTensor4dDescriptorEx(d_, dt, to_int(s[0]), to_int(s[1]), to_int(s[2]), to_int(s[3]),
                                                   to_int(st[0]), to_int(st[1]), to_int(st[2]), to_int(st[3])));
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d_); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  cudnnTensorDescriptor_t get() const { return d_; }

 private:
  cudnnTensorDescriptor_t d_ = nullptr;
};

// A weight [O, C/g, KH, KW]: plain OIHW, or OHWI memory (channels-last).
// The format is the convolution's layout, not read off the weight: a 1x1 or
// depthwise weight is contiguous in both layouts, and cuDNN refuses every
// backward algorithm when the filter's format differs from the activations'
// (seen on an H100 with cuDNN 9: resnet50's 1x1 convolutions in channels-last).
class FilterDesc {
 public:
  FilterDesc(const Tensor& w, cudnnDataType_t dt, bool channels_last) {
    EMBER_CUDNN_CHECK(cudnnCreateFilterDescriptor(&d_));
    const cudnnTensorFormat_t format = channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    EMBER_CUDNN_CHECK(cudnnSetFilter4dDescriptor(d_, dt, format, to_int(w.size(0)), to_int(w.size(1)),
                                                 to_int(w.size(2)), to_int(w.size(3))));
  }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(d_); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
  cudnnFilterDescriptor_t get() const { return d_; }

 private:
  cudnnFilterDescriptor_t d_ = nullptr;
};

class ConvDesc {
 public:
  ConvDesc(const ConvGeom& g, const ConvTypes& ty) {
    EMBER_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d_));
    EMBER_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d_, to_int(g.ph), to_int(g.pw), to_int(g.sh), to_int(g.sw),
                                                      to_int(g.dh), to_int(g.dw), CUDNN_CROSS_CORRELATION,
                                                      ty.compute));
    EMBER_CUDNN_CHECK(cudnnSetConvolutionGroupCount(d_, to_int(g.groups)));
    set_math(ty.math);
  }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(d_); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
  void set_math(cudnnMathType_t m) { EMBER_CUDNN_CHECK(cudnnSetConvolutionMathType(d_, m)); }
  cudnnConvolutionDescriptor_t get() const { return d_; }

 private:
  cudnnConvolutionDescriptor_t d_ = nullptr;
};

// alpha = 1, beta = 0, typed as cuDNN wants: double for double compute.
struct Blend {
  double d1 = 1, d0 = 0;
  float f1 = 1, f0 = 0;
  bool dbl;
  explicit Blend(DType t) : dbl(t == DType::Float64) {}
  const void* one() const { return dbl ? static_cast<const void*>(&d1) : &f1; }
  const void* zero() const { return dbl ? static_cast<const void*>(&d0) : &f0; }
};

// ---- Algorithm cache ----

enum class Pass { Forward, BackwardData, BackwardFilter };

struct AlgoKey {
  int device;
  std::array<int64_t, 16> geom;
  DType dtype;
  bool channels_last;
  Pass pass;
  cudnnMathType_t math;  // the call's math: TF32 on and off pick apart
  bool benchmark;        // measured (cudnnFind*Ex) or heuristic choice
  auto operator<=>(const AlgoKey&) const = default;
};

struct Algo {
  int algo;  // -1: cuDNN has none for this key
  cudnnMathType_t math;
};

// The algorithm of one pass: cuDNN's heuristic candidates in their order,
// then every algorithm of the pass, the first that cuDNN accepts for this
// geometry under the math we need (`accepts` asks for its workspace size,
// which answers NOT_SUPPORTED otherwise). float32 without TF32 runs every
// candidate with FMA math, whatever math it was listed with. Both steps are
// needed: cuDNN's heuristics may list no FMA candidate for float32, and
// algorithm 0 does not take every layout.
template <typename Perf, typename Accepts>
Algo pick(const std::vector<Perf>& perf, int returned, int n_algos, DType dt, cudnnMathType_t want, Accepts&& accepts) {
  for (int i = 0; i < returned; ++i) {
    if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
    const cudnnMathType_t m = want == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : perf[i].mathType;
    if (accepts(static_cast<int>(perf[i].algo), m)) return {static_cast<int>(perf[i].algo), m};
  }
  for (int a = 0; a < n_algos; ++a)
    if (accepts(a, want)) return {a, want};
  return {-1, want};  // none: the caller names the error
}

// Everything a pass needs besides the data, made once per key: the
// descriptors (creating and setting four of them, and asking cuDNN for the
// workspace size, cost tens of microseconds a call, which at 16-bit speeds
// made the step wait on the host), the algorithm and its workspace size.
// The key holds the activations' strides, so a plan's descriptors describe
// exactly the tensors it is used with.
struct Plan {
  TensorDesc a, b;  // forward (x, y); backward data (dy, dx); backward filter (x, dy)
  FilterDesc f;
  ConvDesc c;
  Algo algo{-1, CUDNN_DEFAULT_MATH};
  size_t ws = 0;
  Plan(const Tensor& ta, const Tensor& tb, const Tensor& tw, const ConvGeom& g, const ConvTypes& ty, bool cl)
      : a(ta, ty.data), b(tb, ty.data), f(tw, ty.data, cl), c(g, ty) {}
};

struct PlanKey {
  AlgoKey algo;
  std::array<int64_t, 8> strides;
  auto operator<=>(const PlanKey&) const = default;
};

struct CachedPlan {
  const Plan* plan;
  bool fresh;  // this call made the entry (it is logged once)
};

// Plans live until exit (a handful per layer); a map node never moves, so
// the pointer stays valid while other threads add plans.
template <typename Make>
CachedPlan cached_plan(const PlanKey& key, Make&& make) {
  static std::mutex mu;
  static auto* cache = new std::map<PlanKey, std::unique_ptr<Plan>>;  // leaked: cuDNN may be gone at exit
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache->find(key);
    if (it != cache->end()) return {it->second.get(), false};
  }
  std::unique_ptr<Plan> made = make();  // outside the lock: a query on one device must not stall others
  std::lock_guard<std::mutex> lock(mu);
  auto [it, inserted] = cache->emplace(key, std::move(made));
  return {it->second.get(), inserted};
}

AlgoKey algo_key(const ConvGeom& g, bool channels_last, const Tensor& x, Pass pass, cudnnMathType_t math);

PlanKey plan_key(const ConvGeom& g, bool channels_last, const Tensor& t1, const Tensor& t2, Pass pass,
                 cudnnMathType_t math) {
  PlanKey k{algo_key(g, channels_last, t1, pass, math), {}};
  for (int d = 0; d < 4; ++d) {
    k.strides[d] = t1.stride(d);
    k.strides[4 + d] = t2.stride(d);
  }
  return k;
}

AlgoKey algo_key(const ConvGeom& g, bool channels_last, const Tensor& x, Pass pass, cudnnMathType_t math) {
  return {x.device().index,
          {g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.groups, g.oh, g.ow},
          x.dtype(),
          channels_last,
          pass,
          math,
          cudnn_benchmark()};
}

// Workspaces come from the caching allocator (stream-ordered).
DataPtr workspace(int device, size_t bytes) { return bytes > 0 ? cuda_allocator(device)->allocate(bytes) : DataPtr{}; }

// Benchmark mode's workspace cap: half the device's free memory, at most
// 4 GiB, so that timing the candidates never runs the step out of memory;
// an algorithm that needs more is skipped (cuDNN reports it as not run).
size_t benchmark_workspace_cap() {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return std::min<size_t>(free_b / 2, size_t{4} << 30);
}

// Benchmark mode: `find` (a cudnnFind*AlgorithmEx call given a workspace)
// times every algorithm; the fastest that fits and runs in the math we need
// wins. {-1}: nothing measured (no memory for the workspace, say), and the
// caller falls back to the heuristics.
template <typename Perf, typename Find, typename Accepts>
Algo find_algo(int dev, int n_algos, cudnnMathType_t want, Find&& find, Accepts&& accepts) {
  size_t cap = benchmark_workspace_cap();
  DataPtr ws;
  try {
    ws = workspace(dev, cap);
  } catch (const std::exception&) {
    cap = 0;  // measure the algorithms that need no workspace
  }
  std::vector<Perf> perf(n_algos);
  int returned = 0;
  if (find(n_algos, &returned, perf.data(), ws.get(), cap) != CUDNN_STATUS_SUCCESS) return {-1, want};
  for (int i = 0; i < returned; ++i) {  // sorted by time; failures last
    if (perf[i].status != CUDNN_STATUS_SUCCESS || perf[i].memory > cap) continue;
    const cudnnMathType_t m = want == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : perf[i].mathType;
    if (want == CUDNN_FMA_MATH && perf[i].mathType == CUDNN_TENSOR_OP_MATH) continue;
    if (accepts(static_cast<int>(perf[i].algo), m)) return {static_cast<int>(perf[i].algo), m};
  }
  return {-1, want};
}

const char* math_name(cudnnMathType_t m) {
  switch (m) {
    case CUDNN_DEFAULT_MATH:
      return "default";
    case CUDNN_TENSOR_OP_MATH:
      return "tensor_op";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
      return "tensor_op_allow_conversion";
    case CUDNN_FMA_MATH:
      return "fma";
  }
  return "?";
}

// One line per new cache entry under EMBER_CUDNN_LOG=1 (read once).
void log_choice(const CachedPlan& c, const char* pass, const ConvGeom& g, DType dt, bool cl) {
  static const bool on = [] {
    const char* e = std::getenv("EMBER_CUDNN_LOG");
    return e && std::string(e) == "1";
  }();
  if (!on || !c.fresh) return;
  std::fprintf(
      stderr,
      "[ember cudnn] %s x=[%lld,%lld,%lld,%lld] w=[%lld,%lld,%lld,%lld] stride=%lld pad=%lld groups=%lld %s%s: "
      "algo %d math %s workspace %zu\n",
      pass, (long long)g.n, (long long)g.c, (long long)g.h, (long long)g.w, (long long)g.o, (long long)(g.c / g.groups),
      (long long)g.kh, (long long)g.kw, (long long)g.sh, (long long)g.ph, (long long)g.groups, dtype_name(dt),
      cl ? " channels-last" : "", c.plan->algo.algo, math_name(c.plan->algo.math), c.plan->ws);
}

// The op layer lays x (dy, dx) and w out alike, so either one's strides
// tell the layout; when both are contiguous in both senses (1x1 filters on
// 1x1 images, say), the two layouts are the same memory and NCHW is right.
bool channels_last(const Tensor& x, const Tensor& w) { return !x.is_contiguous() || !w.is_contiguous(); }

// ---- Bias kernels ----

// y (in memory order) += b[channel]; channel = (i / inner) % c, where inner
// is H*W for NCHW and 1 for NHWC.
template <typename T>
__global__ void add_bias_kernel(T* __restrict__ y, const T* __restrict__ b, int64_t total, int64_t c, int64_t inner) {
  using A = acc_t<T>;
  cuda::grid_stride_loop(total, [&](int64_t i) {
    const int64_t ch = (i / inner) % c;
    y[i] = cuda::cast_value<T, A>(static_cast<A>(y[i]) + static_cast<A>(b[ch]));
  });
}

template <typename F>
void dispatch_conv_float(DType t, F&& f) {
  EMBER_DISPATCH_FLOAT(t, "conv2d", [&] { f(scalar_t{}); });
}

// The three passes differ only in which cuDNN entry points they call and
// in which order those take the operands; each is a table of those calls
// over a plan's descriptors (a, b: tensors; f: the filter) and the data
// (ta, tb, tf in the same roles), and run_pass below is the one procedure.
//   forward:          a = x,  b = y,  f = w   (y written)
//   backward data:    a = dy, b = dx, f = w   (dx written)
//   backward filter:  a = x,  b = dy, f = dw  (dw written)
struct ForwardApi {
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  using AlgoT = cudnnConvolutionFwdAlgo_t;
  static constexpr Pass kPass = Pass::Forward;
  static constexpr int kCount = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  static constexpr const char* kName = "forward";
  static cudnnStatus_t workspace(cudnnHandle_t h, const Plan& p, AlgoT algo, size_t* ws) {
    return cudnnGetConvolutionForwardWorkspaceSize(h, p.a.get(), p.f.get(), p.c.get(), p.b.get(), algo, ws);
  }
  static cudnnStatus_t max_count(cudnnHandle_t h, int* n) { return cudnnGetConvolutionForwardAlgorithmMaxCount(h, n); }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const Plan& p, int req, int* ret, Perf* perf) {
    return cudnnGetConvolutionForwardAlgorithm_v7(h, p.a.get(), p.f.get(), p.c.get(), p.b.get(), req, ret, perf);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const Plan& p, void* ta, void* tb, void* tf, int req, int* ret, Perf* perf,
                            void* ws, size_t cap) {
    return cudnnFindConvolutionForwardAlgorithmEx(h, p.a.get(), ta, p.f.get(), tf, p.c.get(), p.b.get(), tb, req, ret,
                                                  perf, ws, cap);
  }
  static cudnnStatus_t run(cudnnHandle_t h, const Plan& p, const Blend& bl, void* ta, void* tb, void* tf, AlgoT algo,
                           void* ws, size_t n) {
    return cudnnConvolutionForward(h, bl.one(), p.a.get(), ta, p.f.get(), tf, p.c.get(), algo, ws, n, bl.zero(),
                                   p.b.get(), tb);
  }
};

struct BackwardDataApi {
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  using AlgoT = cudnnConvolutionBwdDataAlgo_t;
  static constexpr Pass kPass = Pass::BackwardData;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  static constexpr const char* kName = "backward_data";
  static cudnnStatus_t workspace(cudnnHandle_t h, const Plan& p, AlgoT algo, size_t* ws) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.f.get(), p.a.get(), p.c.get(), p.b.get(), algo, ws);
  }
  static cudnnStatus_t max_count(cudnnHandle_t h, int* n) {
    return cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, n);
  }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const Plan& p, int req, int* ret, Perf* perf) {
    return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p.f.get(), p.a.get(), p.c.get(), p.b.get(), req, ret, perf);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const Plan& p, void* ta, void* tb, void* tf, int req, int* ret, Perf* perf,
                            void* ws, size_t cap) {
    return cudnnFindConvolutionBackwardDataAlgorithmEx(h, p.f.get(), tf, p.a.get(), ta, p.c.get(), p.b.get(), tb, req,
                                                       ret, perf, ws, cap);
  }
  static cudnnStatus_t run(cudnnHandle_t h, const Plan& p, const Blend& bl, void* ta, void* tb, void* tf, AlgoT algo,
                           void* ws, size_t n) {
    return cudnnConvolutionBackwardData(h, bl.one(), p.f.get(), tf, p.a.get(), ta, p.c.get(), algo, ws, n, bl.zero(),
                                        p.b.get(), tb);
  }
};

struct BackwardFilterApi {
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  using AlgoT = cudnnConvolutionBwdFilterAlgo_t;
  static constexpr Pass kPass = Pass::BackwardFilter;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  static constexpr const char* kName = "backward_filter";
  static cudnnStatus_t workspace(cudnnHandle_t h, const Plan& p, AlgoT algo, size_t* ws) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p.a.get(), p.b.get(), p.c.get(), p.f.get(), algo, ws);
  }
  static cudnnStatus_t max_count(cudnnHandle_t h, int* n) {
    return cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, n);
  }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const Plan& p, int req, int* ret, Perf* perf) {
    return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p.a.get(), p.b.get(), p.c.get(), p.f.get(), req, ret, perf);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const Plan& p, void* ta, void* tb, void* tf, int req, int* ret, Perf* perf,
                            void* ws, size_t cap) {
    return cudnnFindConvolutionBackwardFilterAlgorithmEx(h, p.a.get(), ta, p.b.get(), tb, p.c.get(), p.f.get(), tf, req,
                                                         ret, perf, ws, cap);
  }
  static cudnnStatus_t run(cudnnHandle_t h, const Plan& p, const Blend& bl, void* ta, void* tb, void* tf, AlgoT algo,
                           void* ws, size_t n) {
    return cudnnConvolutionBackwardFilter(h, bl.one(), p.a.get(), ta, p.b.get(), tb, p.c.get(), algo, ws, n, bl.zero(),
                                          p.f.get(), tf);
  }
};

// One pass on tensors in one layout; false when cuDNN has no algorithm for
// it. The plan (descriptors, algorithm, workspace size) is made once per
// key: the algorithm from benchmark mode when on and it measured one, else
// from cuDNN's heuristics. The caller holds the device's cuDNN slot.
template <typename Api>
bool run_pass(cudnnHandle_t h, int dev, const ConvGeom& g, const Tensor& ta, const Tensor& tb, const Tensor& tf,
              bool cl) {
  using AlgoT = typename Api::AlgoT;
  const ConvTypes ty = conv_types(ta.dtype());
  const CachedPlan cached = cached_plan(plan_key(g, cl, ta, tb, Api::kPass, ty.math), [&] {
    auto plan = std::make_unique<Plan>(ta, tb, tf, g, ty, cl);
    Plan& p = *plan;
    auto accepts = [&](int algo, cudnnMathType_t m) {
      p.c.set_math(m);
      size_t ws = 0;
      return Api::workspace(h, p, static_cast<AlgoT>(algo), &ws) == CUDNN_STATUS_SUCCESS;
    };
    p.algo = [&]() -> Algo {
      if (cudnn_benchmark()) {
        p.c.set_math(ty.math);
        const Algo f = find_algo<typename Api::Perf>(
            dev, Api::kCount, ty.math,
            [&](int req, int* ret, typename Api::Perf* perf, void* ws, size_t cap) {
              return Api::find(h, p, ta.raw_data(), tb.raw_data(), tf.raw_data(), req, ret, perf, ws, cap);
            },
            accepts);
        if (f.algo >= 0) return f;
      }
      int max_count = 0, returned = 0;
      EMBER_CUDNN_CHECK(Api::max_count(h, &max_count));
      std::vector<typename Api::Perf> perf(max_count);
      EMBER_CUDNN_CHECK(Api::heuristics(h, p, max_count, &returned, perf.data()));
      return pick(perf, returned, Api::kCount, ta.dtype(), ty.math, accepts);
    }();
    if (p.algo.algo >= 0) {
      p.c.set_math(p.algo.math);
      EMBER_CUDNN_CHECK(Api::workspace(h, p, static_cast<AlgoT>(p.algo.algo), &p.ws));
    }
    return plan;
  });
  const Plan& p = *cached.plan;
  if (p.algo.algo < 0) return false;
  log_choice(cached, Api::kName, g, ta.dtype(), cl);
  DataPtr ws = workspace(dev, p.ws);
  const Blend blend(ta.dtype());
  EMBER_CUDNN_CHECK(Api::run(h, p, blend, ta.raw_data(), tb.raw_data(), tf.raw_data(), static_cast<AlgoT>(p.algo.algo),
                             ws.get(), p.ws));
  return true;
}

// cuDNN has no algorithm for this pass (pick found none): a named error.
void check_found(bool found, const char* pass, const ConvGeom& g, DType dt, bool channels_last) {
  EMBER_CHECK(found, "conv2d ", pass, ": cuDNN has no algorithm for input [", g.n, ",", g.c, ",", g.h, ",", g.w,
              "], weight [", g.o, ",", g.c / g.groups, ",", g.kh, ",", g.kw, "], groups ", g.groups, ", dtype ", dt,
              channels_last ? ", channels-last" : "");
}

}  // namespace

void conv2d_forward_cuda(const ConvGeom& g, const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  const int dev = x.device().index;
  cuda::DeviceGuard guard(dev);
  cudaStream_t stream = cuda::stream_for(dev);
  CudnnSlot& slot = cudnn_slot(dev);
  std::lock_guard<std::mutex> lock(slot.mu);
  cudnnHandle_t h = slot.handle;
  EMBER_CUDNN_CHECK(cudnnSetStream(h, stream));
  const bool cl = channels_last(x, w);
  check_found(run_pass<ForwardApi>(h, dev, g, x, y, w, cl), "forward", g, x.dtype(), cl);
  if (bias.defined()) {
    const int64_t total = y.numel(), inner = y.is_contiguous() ? g.oh * g.ow : 1;
    dispatch_conv_float(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      add_bias_kernel<T><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
          static_cast<T*>(y.raw_data()), static_cast<const T*>(bias.raw_data()), total, g.o, inner);
    });
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
}

void conv2d_backward_cuda(const ConvGeom& g, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                          Tensor* dw) {
  const int dev = x.device().index;
  cuda::DeviceGuard guard(dev);
  cudaStream_t stream = cuda::stream_for(dev);
  CudnnSlot& slot = cudnn_slot(dev);
  std::lock_guard<std::mutex> lock(slot.mu);
  cudnnHandle_t h = slot.handle;
  EMBER_CUDNN_CHECK(cudnnSetStream(h, stream));
  const bool cl = channels_last(x, w);
  if (dx) check_found(run_pass<BackwardDataApi>(h, dev, g, dy, *dx, w, cl), "backward data", g, x.dtype(), cl);
  if (dw) check_found(run_pass<BackwardFilterApi>(h, dev, g, x, dy, *dw, cl), "backward filter", g, x.dtype(), cl);
}

}  // namespace ember
