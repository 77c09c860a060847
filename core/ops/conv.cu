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
// Under cudnn_graph_api() (on by default; EMBER_CUDNN_GRAPH=0 turns it off)
// a pass runs through cuDNN's graph (backend) API, as PyTorch's Conv_v8.cpp
// does: see "The graph API" below. Otherwise, or where the graph API has no
// engine,
// algorithms come from cuDNN's heuristics (Get*_v7, checked and completed by
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
#include <atomic>
#include <climits>
#include <compare>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

// ---- Handle, types, descriptors ----

using CudnnSlot = cuda::HandleSlot<cudnnHandle_t>;

CudnnSlot& cudnn_slot(int device) {
  return cuda::handle_slot<cudnnHandle_t>("conv2d", device,
                                          [](cudnnHandle_t* h) { EMBER_CUDNN_CHECK(cudnnCreate(h)); });
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
  bool graph;            // the graph API's engine (when it has one) or the legacy API's algorithm
  bool deterministic;    // deterministic_algorithms(): only what cuDNN marks deterministic
  auto operator<=>(const AlgoKey&) const = default;
};

struct Algo {
  int algo;  // -1: cuDNN has none for this key
  cudnnMathType_t math;
};

// The legacy algorithms cuDNN documents as nondeterministic (they add
// partial results with atomics): backward data's algorithm 0, backward
// filter's 0 and 3. Every forward algorithm is deterministic.
bool nondeterministic_algo(Pass pass, int algo) {
  return (pass == Pass::BackwardData && algo == 0) || (pass == Pass::BackwardFilter && (algo == 0 || algo == 3));
}

// The algorithm of one pass: cuDNN's heuristic candidates in their order,
// then every algorithm of the pass, the first that cuDNN accepts for this
// geometry under the math we need (`accepts` asks for its workspace size,
// which answers NOT_SUPPORTED otherwise). float32 without TF32 runs every
// candidate with FMA math, whatever math it was listed with. Both steps are
// needed: cuDNN's heuristics may list no FMA candidate for float32, and
// algorithm 0 does not take every layout. Under deterministic_algorithms()
// a candidate cuDNN marks nondeterministic is skipped.
template <typename Perf, typename Accepts>
Algo pick(const std::vector<Perf>& perf, int returned, int n_algos, Pass pass, bool deterministic, cudnnMathType_t want,
          Accepts&& accepts) {
  for (int i = 0; i < returned; ++i) {
    if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
    if (deterministic && perf[i].determinism == CUDNN_NON_DETERMINISTIC) continue;
    const cudnnMathType_t m = want == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : perf[i].mathType;
    if (accepts(static_cast<int>(perf[i].algo), m)) return {static_cast<int>(perf[i].algo), m};
  }
  for (int a = 0; a < n_algos; ++a)
    if (!(deterministic && nondeterministic_algo(pass, a)) && accepts(a, want)) return {a, want};
  return {-1, want};  // none: the caller names the error
}

// Everything a pass needs besides the data, made once per key: the
// descriptors (creating and setting four of them, and asking cuDNN for the
// workspace size, cost tens of microseconds a call, which at 16-bit speeds
// made the step wait on the host), the algorithm and its workspace size.
// The key holds the activations' strides, so a plan's descriptors describe
// exactly the tensors it is used with.
struct GraphPlan;

struct Plan {
  TensorDesc a, b;  // forward (x, y); backward data (dy, dx); backward filter (x, dy)
  FilterDesc f;
  ConvDesc c;
  Algo algo{-1, CUDNN_DEFAULT_MATH};
  size_t ws = 0;
  std::shared_ptr<const GraphPlan> graph;  // set: the pass runs through the graph API
  Plan(const Tensor& ta, const Tensor& tb, const Tensor& tw, const ConvGeom& g, const ConvTypes& ty, bool cl)
      : a(ta, ty.data), b(tb, ty.data), f(tw, ty.data, cl), c(g, ty) {}
};

struct PlanKey {
  AlgoKey algo;
  std::array<int64_t, 8> strides;
  std::array<int64_t, 3> align;  // the operands' address alignment: a graph plan is built for it
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

// The largest power of two up to 16 that divides the address: what a graph
// plan promises cuDNN about its operands (CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT).
int64_t byte_alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int64_t al = 16;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

PlanKey plan_key(const ConvGeom& g, bool channels_last, const Tensor& t1, const Tensor& t2, const Tensor& tf, Pass pass,
                 cudnnMathType_t math) {
  PlanKey k{algo_key(g, channels_last, t1, pass, math), {}, {}};
  for (int d = 0; d < 4; ++d) {
    k.strides[d] = t1.stride(d);
    k.strides[4 + d] = t2.stride(d);
  }
  if (k.algo.graph)
    k.align = {byte_alignment(t1.raw_data()), byte_alignment(t2.raw_data()), byte_alignment(tf.raw_data())};
  return k;
}

AlgoKey algo_key(const ConvGeom& g, bool channels_last, const Tensor& x, Pass pass, cudnnMathType_t math) {
  return {x.device().index,
          {g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.groups, g.oh, g.ow},
          x.dtype(),
          channels_last,
          pass,
          math,
          cudnn_benchmark(),
          cudnn_graph_api() && !cudnn_benchmark(),
          deterministic_algorithms()};
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
Algo find_algo(int dev, int n_algos, bool deterministic, cudnnMathType_t want, Find&& find, Accepts&& accepts) {
  check_not_capturing("cuDNN benchmark mode timing a convolution's algorithms",
                      "timing runs and waits for kernels; run a step before capture so each geometry's choice "
                      "is cached (a warm-up)");
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
    if (deterministic && perf[i].determinism == CUDNN_NON_DETERMINISTIC) continue;
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
// The legacy calls of a pass, the same for the three: each Api gives its
// entry points (kWorkspace, kMaxCount, kHeuristics, kFind, kRun) and
// `operands`, its descriptors and data in the order those take them (two
// inputs, then the output; the convolution descriptor stands between).
template <typename Api>
struct LegacyCalls {
  template <typename AlgoT>
  static cudnnStatus_t workspace(cudnnHandle_t h, const Plan& p, AlgoT algo, size_t* ws) {
    const auto [d0, x0, d1, x1, d2, x2] = Api::operands(p, nullptr, nullptr, nullptr);
    return Api::kWorkspace(h, d0, d1, p.c.get(), d2, algo, ws);
  }
  static cudnnStatus_t max_count(cudnnHandle_t h, int* n) { return Api::kMaxCount(h, n); }
  template <typename Perf>
  static cudnnStatus_t heuristics(cudnnHandle_t h, const Plan& p, int req, int* ret, Perf* perf) {
    const auto [d0, x0, d1, x1, d2, x2] = Api::operands(p, nullptr, nullptr, nullptr);
    return Api::kHeuristics(h, d0, d1, p.c.get(), d2, req, ret, perf);
  }
  template <typename Perf>
  static cudnnStatus_t find(cudnnHandle_t h, const Plan& p, void* ta, void* tb, void* tf, int req, int* ret, Perf* perf,
                            void* ws, size_t cap) {
    const auto [d0, x0, d1, x1, d2, x2] = Api::operands(p, ta, tb, tf);
    return Api::kFind(h, d0, x0, d1, x1, p.c.get(), d2, x2, req, ret, perf, ws, cap);
  }
  template <typename AlgoT>
  static cudnnStatus_t run(cudnnHandle_t h, const Plan& p, const Blend& bl, void* ta, void* tb, void* tf, AlgoT algo,
                           void* ws, size_t n) {
    const auto [d0, x0, d1, x1, d2, x2] = Api::operands(p, ta, tb, tf);
    return Api::kRun(h, bl.one(), d0, x0, d1, x1, p.c.get(), algo, ws, n, bl.zero(), d2, x2);
  }
};

struct ForwardApi : LegacyCalls<ForwardApi> {
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  using AlgoT = cudnnConvolutionFwdAlgo_t;
  static constexpr Pass kPass = Pass::Forward;
  static constexpr int kCount = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  static constexpr const char* kName = "forward";
  // The graph API's operation and the attributes of its operands a, b, f.
  static constexpr cudnnBackendDescriptorType_t kOp = CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR;
  static constexpr cudnnBackendAttributeName_t kAttrA = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                                               kAttrB = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                                               kAttrF = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                                               kAttrConv = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                                               kAttrAlpha = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                                               kAttrBeta = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA;
  static constexpr auto kWorkspace = &cudnnGetConvolutionForwardWorkspaceSize;
  static constexpr auto kMaxCount = &cudnnGetConvolutionForwardAlgorithmMaxCount;
  static constexpr auto kHeuristics = &cudnnGetConvolutionForwardAlgorithm_v7;
  static constexpr auto kFind = &cudnnFindConvolutionForwardAlgorithmEx;
  static constexpr auto kRun = &cudnnConvolutionForward;
  static auto operands(const Plan& p, void* ta, void* tb, void* tf) {
    return std::tuple(p.a.get(), ta, p.f.get(), tf, p.b.get(), tb);  // x, w -> y
  }
};

struct BackwardDataApi : LegacyCalls<BackwardDataApi> {
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  using AlgoT = cudnnConvolutionBwdDataAlgo_t;
  static constexpr Pass kPass = Pass::BackwardData;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  static constexpr const char* kName = "backward_data";
  static constexpr cudnnBackendDescriptorType_t kOp = CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR;
  static constexpr cudnnBackendAttributeName_t kAttrA = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                                               kAttrB = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                                               kAttrF = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                                               kAttrConv = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                                               kAttrAlpha = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                                               kAttrBeta = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA;
  static constexpr auto kWorkspace = &cudnnGetConvolutionBackwardDataWorkspaceSize;
  static constexpr auto kMaxCount = &cudnnGetConvolutionBackwardDataAlgorithmMaxCount;
  static constexpr auto kHeuristics = &cudnnGetConvolutionBackwardDataAlgorithm_v7;
  static constexpr auto kFind = &cudnnFindConvolutionBackwardDataAlgorithmEx;
  static constexpr auto kRun = &cudnnConvolutionBackwardData;
  static auto operands(const Plan& p, void* ta, void* tb, void* tf) {
    return std::tuple(p.f.get(), tf, p.a.get(), ta, p.b.get(), tb);  // w, dy -> dx
  }
};

struct BackwardFilterApi : LegacyCalls<BackwardFilterApi> {
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  using AlgoT = cudnnConvolutionBwdFilterAlgo_t;
  static constexpr Pass kPass = Pass::BackwardFilter;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  static constexpr const char* kName = "backward_filter";
  static constexpr cudnnBackendDescriptorType_t kOp = CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR;
  static constexpr cudnnBackendAttributeName_t kAttrA = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                                               kAttrB = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                                               kAttrF = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                                               kAttrConv = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                                               kAttrAlpha = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                                               kAttrBeta = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA;
  static constexpr auto kWorkspace = &cudnnGetConvolutionBackwardFilterWorkspaceSize;
  static constexpr auto kMaxCount = &cudnnGetConvolutionBackwardFilterAlgorithmMaxCount;
  static constexpr auto kHeuristics = &cudnnGetConvolutionBackwardFilterAlgorithm_v7;
  static constexpr auto kFind = &cudnnFindConvolutionBackwardFilterAlgorithmEx;
  static constexpr auto kRun = &cudnnConvolutionBackwardFilter;
  static auto operands(const Plan& p, void* ta, void* tb, void* tf) {
    return std::tuple(p.a.get(), ta, p.b.get(), tb, p.f.get(), tf);  // x, dy -> dw
  }
};

// ---- The graph API ----
// cuDNN's backend API, as PyTorch calls it (Conv_v8.cpp): the pass is an
// operation graph of one convolution node over tensors that carry their real
// strides; cuDNN's engine heuristics rank the engines that can run it
// (instant mode, then the fallback list), and the first one our numerics
// allow and that builds into an execution plan is kept with the plan. The
// filter is PyTorch's: no engine that down-converts its inputs, for float32
// without TF32 no tensor-core engine, and under deterministic_algorithms()
// none that cuDNN notes as nondeterministic. Why not only the legacy API:
// its algorithms map onto a few engines, and for float32 channels-last
// without TF32 those ran our ResNet-50 step 1.25x PyTorch's on an H100
// (bench/results/gpu_resnet50.json).

class BackendDesc {
 public:
  explicit BackendDesc(cudnnBackendDescriptorType_t t) { EMBER_CUDNN_CHECK(cudnnBackendCreateDescriptor(t, &d_)); }
  ~BackendDesc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  BackendDesc(BackendDesc&& o) noexcept : d_(o.d_) { o.d_ = nullptr; }
  BackendDesc(const BackendDesc&) = delete;
  BackendDesc& operator=(const BackendDesc&) = delete;
  BackendDesc& operator=(BackendDesc&&) = delete;
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const void* v) {
    EMBER_CUDNN_CHECK(cudnnBackendSetAttribute(d_, name, type, count, v));
  }
  void set(cudnnBackendAttributeName_t name, const BackendDesc& other) {
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &other.d_);
  }
  void finalize() { EMBER_CUDNN_CHECK(cudnnBackendFinalize(d_)); }
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// The operands' unique ids in the graph and in each call's variant pack.
constexpr int64_t kUidA = 'a', kUidB = 'b', kUidF = 'f';

BackendDesc backend_tensor(const Tensor& t, cudnnDataType_t dt, int64_t uid) {
  BackendDesc d(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  int64_t dims[4], strides[4];
  for (int i = 0; i < 4; ++i) dims[i] = t.size(i), strides[i] = t.stride(i);
  const int64_t align = byte_alignment(t.raw_data());
  d.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
  d.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
  d.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides);
  d.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  d.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
  d.finalize();
  return d;
}

// A built plan and everything it was built from (kept alive with it).
struct GraphPlan {
  std::vector<BackendDesc> parts;
  std::unique_ptr<BackendDesc> plan;
  int64_t engine = -1;  // cuDNN's global engine index, for the log
  int64_t ws = 0;
  bool tensor_core = false;
};

// The engine of a heuristic result, and whether our numerics allow it.
struct EngineInfo {
  int64_t index = -1;
  bool allowed = false, tensor_core = false;
};
EngineInfo engine_info(cudnnBackendDescriptor_t cfg, const ConvTypes& ty, bool deterministic) {
  EngineInfo info;
  BackendDesc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t n = 0;
  if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) !=
          CUDNN_STATUS_SUCCESS ||
      n != 1)
    return info;
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  int64_t n_notes = 0;
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n_notes, notes) != CUDNN_STATUS_SUCCESS)
    return info;
  cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &info.index);
  info.allowed = true;
  for (int64_t i = 0; i < std::min<int64_t>(n_notes, CUDNN_NUMERICAL_NOTE_TYPE_COUNT); ++i) {
    if (notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS) info.allowed = false;
    if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC && deterministic) info.allowed = false;
    if (notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE) {
      info.tensor_core = true;
      if (ty.data == CUDNN_DATA_FLOAT && ty.math == CUDNN_FMA_MATH) info.allowed = false;
    }
  }
  return info;
}

// The graph plan of one pass, or null when no engine that our numerics
// allow builds for it (the caller then takes the legacy API).
template <typename Api>
std::shared_ptr<const GraphPlan> make_graph_plan(cudnnHandle_t h, const ConvGeom& g, const Tensor& ta, const Tensor& tb,
                                                 const Tensor& tf, const ConvTypes& ty, bool deterministic) {
  auto gp = std::make_shared<GraphPlan>();
  auto& parts = gp->parts;
  parts.reserve(8);
  const BackendDesc& a = parts.emplace_back(backend_tensor(ta, ty.data, kUidA));
  const BackendDesc& b = parts.emplace_back(backend_tensor(tb, ty.data, kUidB));
  const BackendDesc& f = parts.emplace_back(backend_tensor(tf, ty.data, kUidF));
  BackendDesc& conv = parts.emplace_back(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t dims = 2, dil[2] = {g.dh, g.dw}, stride[2] = {g.sh, g.sw}, pad[2] = {g.ph, g.pw};
  conv.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &ty.compute);
  conv.set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  conv.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims);
  conv.set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dil);
  conv.set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, stride);
  conv.set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  conv.set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  conv.finalize();
  // Groups are implied: the filter's input channels times the groups are x's.
  BackendDesc& op = parts.emplace_back(Api::kOp);
  op.set(Api::kAttrA, a);
  op.set(Api::kAttrB, b);
  op.set(Api::kAttrF, f);
  op.set(Api::kAttrConv, conv);
  const double d1 = 1, d0 = 0;
  const float f1 = 1, f0 = 0;
  const bool dbl = ty.compute == CUDNN_DATA_DOUBLE;
  op.set(Api::kAttrAlpha, dbl ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT, 1, dbl ? static_cast<const void*>(&d1) : &f1);
  op.set(Api::kAttrBeta, dbl ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT, 1, dbl ? static_cast<const void*>(&d0) : &f0);
  op.finalize();
  BackendDesc& graph = parts.emplace_back(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, op);
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
  graph.finalize();
  for (const cudnnBackendHeurMode_t heur_mode : {CUDNN_HEUR_MODE_INSTANT, CUDNN_HEUR_MODE_FALLBACK}) {
    BackendDesc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &heur_mode);
    if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) continue;
    int64_t count = 0;
    if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                 nullptr) != CUDNN_STATUS_SUCCESS)
      continue;
    std::vector<BackendDesc> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) raw.push_back(cfgs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR).get());
    if (count == 0 || cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                               count, &count, raw.data()) != CUDNN_STATUS_SUCCESS)
      continue;
    for (int64_t i = 0; i < count; ++i) {
      const EngineInfo info = engine_info(raw[i], ty, deterministic);
      if (!info.allowed) continue;
      auto plan = std::make_unique<BackendDesc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[i]);
      if (cudnnBackendFinalize(plan->get()) != CUDNN_STATUS_SUCCESS) continue;  // this engine cannot run it
      int64_t n = 0;
      EMBER_CUDNN_CHECK(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                 CUDNN_TYPE_INT64, 1, &n, &gp->ws));
      gp->plan = std::move(plan);
      gp->engine = info.index;
      gp->tensor_core = info.tensor_core;
      parts.push_back(std::move(cfgs[i]));
      return gp;
    }
  }
  return nullptr;
}

// Runs a graph plan on the operands' data (a, b, f as in the plan).
void run_graph(cudnnHandle_t h, int dev, const GraphPlan& gp, void* a, void* b, void* f) {
  DataPtr ws = workspace(dev, static_cast<size_t>(gp.ws));
  void* wsp = ws.get();
  const int64_t uids[3] = {kUidA, kUidB, kUidF};
  void* ptrs[3] = {a, b, f};
  BackendDesc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, ptrs);
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &wsp);
  pack.finalize();
  EMBER_CUDNN_CHECK(cudnnBackendExecute(h, gp.plan->get(), pack.get()));
}

std::atomic<int64_t> g_graph_plans{0}, g_legacy_plans{0};

// One line per new cache entry under EMBER_CUDNN_LOG=1 (read once).
void log_choice(const CachedPlan& c, const char* pass, const ConvGeom& g, DType dt, bool cl) {
  static const bool on = [] {
    const char* e = std::getenv("EMBER_CUDNN_LOG");
    return e && std::string(e) == "1";
  }();
  if (!on || !c.fresh) return;
  char choice[96];
  if (const GraphPlan* gp = c.plan->graph.get())
    std::snprintf(choice, sizeof choice, "graph engine %lld math %s workspace %lld", (long long)gp->engine,
                  gp->tensor_core ? "tensor_core" : "no_tensor_core", (long long)gp->ws);
  else
    std::snprintf(choice, sizeof choice, "algo %d math %s workspace %zu", c.plan->algo.algo,
                  math_name(c.plan->algo.math), c.plan->ws);
  std::fprintf(
      stderr,
      "[ember cudnn] %s x=[%lld,%lld,%lld,%lld] w=[%lld,%lld,%lld,%lld] stride=%lld pad=%lld groups=%lld %s%s: "
      "%s\n",
      pass, (long long)g.n, (long long)g.c, (long long)g.h, (long long)g.w, (long long)g.o, (long long)(g.c / g.groups),
      (long long)g.kh, (long long)g.kw, (long long)g.sh, (long long)g.ph, (long long)g.groups, dtype_name(dt),
      cl ? " channels-last" : "", choice);
}

// One pass on tensors in one layout; false when cuDNN has no algorithm for
// it. The plan (descriptors, algorithm, workspace size) is made once per
// key: the algorithm from benchmark mode when on and it measured one, else
// from cuDNN's heuristics. The caller holds the device's cuDNN slot.
template <typename Api>
bool run_pass(cudnnHandle_t h, int dev, const ConvGeom& g, const Tensor& ta, const Tensor& tb, const Tensor& tf,
              bool cl) {
  using AlgoT = typename Api::AlgoT;
  const ConvTypes ty = conv_types(ta.dtype());
  const PlanKey key = plan_key(g, cl, ta, tb, tf, Api::kPass, ty.math);
  const CachedPlan cached = cached_plan(key, [&] {
    auto plan = std::make_unique<Plan>(ta, tb, tf, g, ty, cl);
    Plan& p = *plan;
    if (key.algo.graph) {
      p.graph = make_graph_plan<Api>(h, g, ta, tb, tf, ty, key.algo.deterministic);
      if (p.graph) {
        g_graph_plans.fetch_add(1, std::memory_order_relaxed);
        return plan;
      }
    }
    g_legacy_plans.fetch_add(1, std::memory_order_relaxed);
    auto accepts = [&](int algo, cudnnMathType_t m) {
      p.c.set_math(m);
      size_t ws = 0;
      return Api::workspace(h, p, static_cast<AlgoT>(algo), &ws) == CUDNN_STATUS_SUCCESS;
    };
    p.algo = [&]() -> Algo {
      if (cudnn_benchmark()) {
        p.c.set_math(ty.math);
        const Algo f = find_algo<typename Api::Perf>(
            dev, Api::kCount, key.algo.deterministic, ty.math,
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
      return pick(perf, returned, Api::kCount, Api::kPass, key.algo.deterministic, ty.math, accepts);
    }();
    if (p.algo.algo >= 0) {
      p.c.set_math(p.algo.math);
      EMBER_CUDNN_CHECK(Api::workspace(h, p, static_cast<AlgoT>(p.algo.algo), &p.ws));
    }
    return plan;
  });
  const Plan& p = *cached.plan;
  log_choice(cached, Api::kName, g, ta.dtype(), cl);
  if (p.graph) {
    run_graph(h, dev, *p.graph, ta.raw_data(), tb.raw_data(), tf.raw_data());
    return true;
  }
  if (p.algo.algo < 0) return false;
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

ConvPlanCounts conv_plan_counts_cuda() {
  return {g_graph_plans.load(std::memory_order_relaxed), g_legacy_plans.load(std::memory_order_relaxed)};
}

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
