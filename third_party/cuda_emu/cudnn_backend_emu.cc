// cudnn_backend_emu.cc: cuDNN's graph (backend) API as core/ops/conv.cu's
// graph path uses it (tensors, a convolution, one convolution operation per
// operation graph, engine heuristics, engine configurations and engines,
// execution plans, variant packs, execute), on host memory, on top of the
// emulated legacy API (cudnn_emu.cc), which checks the problem and computes.
//
// Strict where cuDNN is: every attribute must have its documented type, a
// descriptor is finalized only with its required attributes, a finalized one
// no longer changes, and execute checks the variant pack against the graph
// (every operand's unique id present, each pointer as aligned as its tensor
// promised). Errors return cuDNN's status with one
// "[cudnn-emu] <function>: ..." line on stderr.
//
// The emulated engines, with the numerical notes cuDNN reports for engines
// of these kinds, in instant mode's order:
//   engine 2  TENSOR_CORE + DOWN_CONVERT_INPUTS (float data only): float
//             inputs converted to a 16-bit type. A caller must filter it
//             out, as PyTorch does; running it is fatal here.
//   engine 1  TENSOR_CORE (not for double): float data rounded to TF32 (the
//             legacy API's default math), 16-bit data as the legacy API.
//   engine 0  no notes: exact float math (the legacy API's FMA math).
//   engine 3  TENSOR_CORE + NONDETERMINISTIC, for weight gradients only,
//             listed before engine 1 (cuDNN's fastest weight-gradient
//             kernels add split partial sums with atomics): runs as the
//             legacy algorithm 0, whose results change in the last bit from
//             run to run here (cudnn_emu.cc), so a caller needing the same
//             bits twice must filter it out (deterministic algorithms).
// The fallback mode lists engine 0 alone. Engines 0 to 2 run as the legacy
// implicit-GEMM algorithm 1, so a plan has a workspace to pass.
#include <cudnn.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "third_party/cuda_emu/emu_runtime.h"

namespace {

__attribute__((format(printf, 3, 4))) cudnnStatus_t fail(cudnnStatus_t s, const char* fn, const char* fmt, ...) {
  std::fprintf(stderr, "[cudnn-emu] %s: ", fn);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
  return s;
}
#define BAD(...) fail(CUDNN_STATUS_BAD_PARAM, __VA_ARGS__)
#define UNSUPPORTED(...) fail(CUDNN_STATUS_NOT_SUPPORTED, __VA_ARGS__)
#define TRY(expr) \
  if (const cudnnStatus_t s_ = (expr); s_ != CUDNN_STATUS_SUCCESS) return s_

using Type = cudnnBackendDescriptorType_t;
using Name = cudnnBackendAttributeName_t;
using AType = cudnnBackendAttributeType_t;

size_t type_size(AType t) {
  switch (t) {
    case CUDNN_TYPE_HANDLE:
      return sizeof(cudnnHandle_t);
    case CUDNN_TYPE_DATA_TYPE:
      return sizeof(cudnnDataType_t);
    case CUDNN_TYPE_INT64:
      return sizeof(int64_t);
    case CUDNN_TYPE_FLOAT:
      return sizeof(float);
    case CUDNN_TYPE_DOUBLE:
      return sizeof(double);
    case CUDNN_TYPE_VOID_PTR:
      return sizeof(void*);
    case CUDNN_TYPE_CONVOLUTION_MODE:
      return sizeof(cudnnConvolutionMode_t);
    case CUDNN_TYPE_HEUR_MODE:
      return sizeof(cudnnBackendHeurMode_t);
    case CUDNN_TYPE_NUMERICAL_NOTE:
      return sizeof(cudnnBackendNumericalNote_t);
    case CUDNN_TYPE_BACKEND_DESCRIPTOR:
      return sizeof(cudnnBackendDescriptor_t);
    default:
      return 0;
  }
}

struct Attr {
  AType type;
  int64_t count;
  std::vector<char> bytes;
  template <typename T>
  T at(int64_t i) const {
    T v;
    std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
    return v;
  }
};

// What each descriptor type takes: the attribute, its type (a FLOAT entry
// also accepts DOUBLE: alpha and beta) and whether finalize needs it.
struct Rule {
  Type desc;
  Name name;
  AType type;
  bool required;
};
const Rule kRules[] = {
    {CUDNN_BACKEND_TENSOR_DESCRIPTOR, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, true},
    {CUDNN_BACKEND_TENSOR_DESCRIPTOR, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_TENSOR_DESCRIPTOR, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_TENSOR_DESCRIPTOR, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_TENSOR_DESCRIPTOR, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, true},
    {CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, true},
    {CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, true},
#define EMU_CONV_OP(T, P, X, W, Y)                                                                \
  {T, CUDNN_ATTR_OPERATION_CONVOLUTION_##P##_##X, CUDNN_TYPE_BACKEND_DESCRIPTOR, true},           \
      {T, CUDNN_ATTR_OPERATION_CONVOLUTION_##P##_##W, CUDNN_TYPE_BACKEND_DESCRIPTOR, true},       \
      {T, CUDNN_ATTR_OPERATION_CONVOLUTION_##P##_##Y, CUDNN_TYPE_BACKEND_DESCRIPTOR, true},       \
      {T, CUDNN_ATTR_OPERATION_CONVOLUTION_##P##_CONV_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, true}, \
      {T, CUDNN_ATTR_OPERATION_CONVOLUTION_##P##_ALPHA, CUDNN_TYPE_FLOAT, true}, {                \
    T, CUDNN_ATTR_OPERATION_CONVOLUTION_##P##_BETA, CUDNN_TYPE_FLOAT, true                        \
  }
    EMU_CONV_OP(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, FORWARD, X, W, Y),
    EMU_CONV_OP(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, BWD_DATA, DX, W, DY),
    EMU_CONV_OP(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, BWD_FILTER, X, DW, DY),
#undef EMU_CONV_OP
    {CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, true},
    {CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, true},
    {CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, true},
    {CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, true},
    {CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, true},
    {CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR,
     true},
    {CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, true},
    {CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, true},
    {CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, true},
};
const Rule* rule(Type t, Name n) {
  for (const Rule& r : kRules)
    if (r.desc == t && r.name == n) return &r;
  return nullptr;
}

enum Pass { kFwd, kBwdData, kBwdFilter };
constexpr int kNondeterministic = 3, kDownConvert = 2, kTensorCore = 1, kExact = 0;

struct Obj {
  Type type;
  bool finalized = false;
  std::map<Name, Attr> attrs;
  std::vector<int> engines;  // an engine heuristic's results
  int engine = -1;           // an engine configuration's or engine's
  const Obj* graph = nullptr;
  // An execution plan: the operation and the legacy problem it runs.
  const Obj* op = nullptr;
  Pass pass = kFwd;
  cudnnTensorDescriptor_t xd = nullptr, yd = nullptr;  // x-like (x, dx) and y-like (y, dy) operands
  cudnnFilterDescriptor_t wd = nullptr;
  cudnnConvolutionDescriptor_t cd = nullptr;
  size_t ws = 0;
  ~Obj() {
    if (xd) cudnnDestroyTensorDescriptor(xd);
    if (yd) cudnnDestroyTensorDescriptor(yd);
    if (wd) cudnnDestroyFilterDescriptor(wd);
    if (cd) cudnnDestroyConvolutionDescriptor(cd);
  }
  const Attr* get(Name n) const {
    auto it = attrs.find(n);
    return it == attrs.end() ? nullptr : &it->second;
  }
  const Obj* ref(Name n) const;  // a descriptor-valued attribute
};

std::mutex g_mu;
std::set<const Obj*> g_live;

Obj* live(const void* d) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_live.find(static_cast<const Obj*>(d));
  return it == g_live.end() ? nullptr : const_cast<Obj*>(*it);
}
const Obj* Obj::ref(Name n) const {
  const Attr* a = get(n);
  return a ? live(a->at<cudnnBackendDescriptor_t>(0)) : nullptr;
}

// The roles of a convolution operation's attributes, per pass.
struct OpNames {
  Type type;
  Pass pass;
  Name x, w, y, conv, alpha, beta;  // x-like, filter, y-like
};
const OpNames kOps[] = {
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, kFwd, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA},
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, kBwdData,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA},
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, kBwdFilter,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA},
};
const OpNames* op_names(Type t) {
  for (const OpNames& o : kOps)
    if (o.type == t) return &o;
  return nullptr;
}

const Obj* graph_op(const Obj& graph) { return graph.ref(CUDNN_ATTR_OPERATIONGRAPH_OPS); }
cudnnDataType_t tensor_type(const Obj& t) { return t.get(CUDNN_ATTR_TENSOR_DATA_TYPE)->at<cudnnDataType_t>(0); }

// ---- Finalize, per descriptor type ----

cudnnStatus_t finalize_tensor(const char* fn, Obj& t) {
  const Attr& dims = *t.get(CUDNN_ATTR_TENSOR_DIMENSIONS);
  const Attr& strides = *t.get(CUDNN_ATTR_TENSOR_STRIDES);
  if (dims.count != 4 || strides.count != 4)
    return UNSUPPORTED(fn, "tensor has %lld dimensions and %lld strides: the emulation takes 4-D tensors",
                       (long long)dims.count, (long long)strides.count);
  for (int i = 0; i < 4; ++i)
    if (dims.at<int64_t>(i) < 1 || strides.at<int64_t>(i) < 1)
      return BAD(fn, "tensor dimension %d is %lld with stride %lld", i, (long long)dims.at<int64_t>(i),
                 (long long)strides.at<int64_t>(i));
  const int64_t al = t.get(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT)->at<int64_t>(0);
  if (al < 1 || (al & (al - 1)) != 0) return BAD(fn, "tensor byte alignment %lld is not a power of two", (long long)al);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalize_conv(const char* fn, Obj& c) {
  if (c.get(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS)->at<int64_t>(0) != 2)
    return UNSUPPORTED(fn, "convolution of %lld spatial dimensions: the emulation takes 2",
                       (long long)c.get(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS)->at<int64_t>(0));
  for (Name n : {CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
                 CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS})
    if (c.get(n)->count != 2)
      return BAD(fn, "convolution attribute %d has %lld values, not 2", n, (long long)c.get(n)->count);
  const Attr &pre = *c.get(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS), &post = *c.get(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS);
  if (pre.at<int64_t>(0) != post.at<int64_t>(0) || pre.at<int64_t>(1) != post.at<int64_t>(1))
    return UNSUPPORTED(fn, "padding before and after differ: the emulation pads symmetrically");
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalize_op(const char* fn, Obj& op) {
  const OpNames& on = *op_names(op.type);
  for (Name n : {on.x, on.w, on.y}) {
    const Obj* t = op.ref(n);
    if (!t || t->type != CUDNN_BACKEND_TENSOR_DESCRIPTOR || !t->finalized)
      return BAD(fn, "operand attribute %d is not a finalized tensor descriptor", n);
  }
  const Obj* c = op.ref(on.conv);
  if (!c || c->type != CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR || !c->finalized)
    return BAD(fn, "the convolution attribute is not a finalized convolution descriptor");
  return CUDNN_STATUS_SUCCESS;
}

// The engines heuristics list for a graph, best first.
std::vector<int> engines_for(const Obj& graph, cudnnBackendHeurMode_t mode) {
  const Obj& op = *graph_op(graph);
  const cudnnDataType_t dt = tensor_type(*op.ref(op_names(op.type)->x));
  if (mode == CUDNN_HEUR_MODE_FALLBACK || dt == CUDNN_DATA_DOUBLE) return {kExact};
  const bool wgrad = op_names(op.type)->pass == kBwdFilter;
  if (dt == CUDNN_DATA_FLOAT && wgrad) return {kDownConvert, kNondeterministic, kTensorCore, kExact};
  if (dt == CUDNN_DATA_FLOAT) return {kDownConvert, kTensorCore, kExact};
  if (wgrad) return {kNondeterministic, kTensorCore, kExact};
  return {kTensorCore, kExact};
}

cudnnStatus_t legacy_tensor(const Obj& t, cudnnTensorDescriptor_t* out) {
  const Attr &d = *t.get(CUDNN_ATTR_TENSOR_DIMENSIONS), &s = *t.get(CUDNN_ATTR_TENSOR_STRIDES);
  TRY(cudnnCreateTensorDescriptor(out));
  return cudnnSetTensor4dDescriptorEx(*out, tensor_type(t), int(d.at<int64_t>(0)), int(d.at<int64_t>(1)),
                                      int(d.at<int64_t>(2)), int(d.at<int64_t>(3)), int(s.at<int64_t>(0)),
                                      int(s.at<int64_t>(1)), int(s.at<int64_t>(2)), int(s.at<int64_t>(3)));
}

// The legacy problem of a plan: descriptors from the graph's tensors (the
// filter's strides must be OIHW or OHWI, the legacy formats; where both fit,
// the activations' layout decides), the math from the engine.
cudnnStatus_t finalize_plan(const char* fn, Obj& plan) {
  const Obj* cfg = plan.ref(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG);
  if (!cfg || cfg->type != CUDNN_BACKEND_ENGINECFG_DESCRIPTOR || cfg->engine < 0 || !cfg->graph)
    return BAD(fn, "the engine configuration is not one an engine heuristic returned");
  const Obj& op = *graph_op(*cfg->graph);
  const OpNames& on = *op_names(op.type);
  const Obj &x = *op.ref(on.x), &w = *op.ref(on.w), &y = *op.ref(on.y), &c = *op.ref(on.conv);
  plan.op = &op;
  plan.pass = on.pass;
  plan.engine = cfg->engine;
  TRY(legacy_tensor(x, &plan.xd));
  TRY(legacy_tensor(y, &plan.yd));
  const Attr &wd = *w.get(CUDNN_ATTR_TENSOR_DIMENSIONS), &wst = *w.get(CUDNN_ATTR_TENSOR_STRIDES);
  const int64_t k = wd.at<int64_t>(0), ci = wd.at<int64_t>(1), kh = wd.at<int64_t>(2), kw = wd.at<int64_t>(3);
  const int64_t oihw[4] = {ci * kh * kw, kh * kw, kw, 1}, ohwi[4] = {kh * kw * ci, 1, kw * ci, ci};
  bool is_oihw = true, is_ohwi = true;
  for (int i = 0; i < 4; ++i) {
    const int64_t s = wst.at<int64_t>(i), d = wd.at<int64_t>(i);
    if (d > 1 && s != oihw[i]) is_oihw = false;
    if (d > 1 && s != ohwi[i]) is_ohwi = false;
  }
  if (!is_oihw && !is_ohwi) return UNSUPPORTED(fn, "filter strides are neither OIHW nor OHWI (the legacy formats)");
  const Attr &xd = *x.get(CUDNN_ATTR_TENSOR_DIMENSIONS), &xs = *x.get(CUDNN_ATTR_TENSOR_STRIDES);
  const bool x_nhwc = xs.at<int64_t>(1) == 1 && xd.at<int64_t>(1) > 1 && xd.at<int64_t>(2) * xd.at<int64_t>(3) > 1;
  const bool nhwc = is_ohwi && (!is_oihw || x_nhwc);
  TRY(cudnnCreateFilterDescriptor(&plan.wd));
  TRY(cudnnSetFilter4dDescriptor(plan.wd, tensor_type(w), nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW, int(k), int(ci),
                                 int(kh), int(kw)));
  if (xd.at<int64_t>(1) % ci != 0)
    return BAD(fn, "x has %lld channels, not a multiple of the filter's %lld", (long long)xd.at<int64_t>(1),
               (long long)ci);
  auto arr = [&](Name n, int i) { return int(c.get(n)->at<int64_t>(i)); };
  TRY(cudnnCreateConvolutionDescriptor(&plan.cd));
  TRY(cudnnSetConvolution2dDescriptor(
      plan.cd, arr(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, 0), arr(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, 1),
      arr(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, 0), arr(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, 1),
      arr(CUDNN_ATTR_CONVOLUTION_DILATIONS, 0), arr(CUDNN_ATTR_CONVOLUTION_DILATIONS, 1),
      c.get(CUDNN_ATTR_CONVOLUTION_CONV_MODE)->at<cudnnConvolutionMode_t>(0),
      c.get(CUDNN_ATTR_CONVOLUTION_COMP_TYPE)->at<cudnnDataType_t>(0)));
  TRY(cudnnSetConvolutionGroupCount(plan.cd, int(xd.at<int64_t>(1) / ci)));
  TRY(cudnnSetConvolutionMathType(plan.cd, plan.engine == kExact ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH));
  const cudnnHandle_t h = plan.get(CUDNN_ATTR_EXECUTION_PLAN_HANDLE)->at<cudnnHandle_t>(0);
  switch (plan.pass) {  // also checks the problem: a plan the engine cannot run does not finalize
    case kFwd:
      return cudnnGetConvolutionForwardWorkspaceSize(h, plan.xd, plan.wd, plan.cd, plan.yd,
                                                     CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, &plan.ws);
    case kBwdData:
      return cudnnGetConvolutionBackwardDataWorkspaceSize(h, plan.wd, plan.yd, plan.cd, plan.xd,
                                                          CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, &plan.ws);
    default:
      return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, plan.xd, plan.yd, plan.cd, plan.wd,
                                                            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, &plan.ws);
  }
}

cudnnStatus_t finalize(const char* fn, Obj& d) {
  for (const Rule& r : kRules)
    if (r.desc == d.type && r.required && !d.get(r.name))
      return BAD(fn, "descriptor type %d finalized without its attribute %d", d.type, r.name);
  switch (d.type) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR:
      return finalize_tensor(fn, d);
    case CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR:
      return finalize_conv(fn, d);
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR:
      return finalize_op(fn, d);
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR: {
      const Obj* op = graph_op(d);
      if (d.get(CUDNN_ATTR_OPERATIONGRAPH_OPS)->count != 1 || !op || !op_names(op->type) || !op->finalized)
        return UNSUPPORTED(fn, "the emulation's graphs hold one finalized convolution operation");
      return CUDNN_STATUS_SUCCESS;
    }
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR: {
      const Obj* g = d.ref(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH);
      if (!g || g->type != CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR || !g->finalized)
        return BAD(fn, "the engine heuristic's graph is not a finalized operation graph");
      d.graph = g;
      d.engines = engines_for(*g, d.get(CUDNN_ATTR_ENGINEHEUR_MODE)->at<cudnnBackendHeurMode_t>(0));
      return CUDNN_STATUS_SUCCESS;
    }
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:
      return finalize_plan(fn, d);
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR:
      if (d.get(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS)->count != d.get(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS)->count)
        return BAD(fn, "the variant pack has %lld unique ids but %lld data pointers",
                   (long long)d.get(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS)->count,
                   (long long)d.get(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS)->count);
      return CUDNN_STATUS_SUCCESS;
    default:
      return UNSUPPORTED(fn, "descriptor type %d is not emulated", d.type);
  }
}

template <typename T>
cudnnStatus_t put(const char* fn, AType want, AType type, int64_t requested, int64_t* count, void* out,
                  const std::vector<T>& values) {
  if (type != want) return BAD(fn, "attribute read as type %d, but it is type %d", type, want);
  if (!count) return BAD(fn, "elementCount is null");
  const int64_t n = std::min<int64_t>(requested, int64_t(values.size()));
  if (n > 0 && !out) return BAD(fn, "arrayOfElements is null");
  if (n > 0) std::memcpy(out, values.data(), size_t(n) * sizeof(T));
  *count = requested == 0 ? int64_t(values.size()) : n;
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t* d) {
  if (!d) return BAD(__func__, "descriptor pointer is null");
  Obj* o = new Obj;
  o->type = type;
  std::lock_guard<std::mutex> lock(g_mu);
  g_live.insert(o);
  *d = o;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t d) {
  if (!d) return CUDNN_STATUS_SUCCESS;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_live.erase(static_cast<const Obj*>(d)))
      return BAD(__func__, "%p is not a live backend descriptor (destroyed twice?)", d);
  }
  delete static_cast<Obj*>(d);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                                       cudnnBackendAttributeType_t type, int64_t count, const void* values) {
  Obj* o = live(d);
  if (!o) return BAD(__func__, "%p is not a live backend descriptor", d);
  if (o->finalized) return BAD(__func__, "descriptor type %d is finalized: attribute %d cannot change", o->type, name);
  const Rule* r = rule(o->type, name);
  if (!r) return UNSUPPORTED(__func__, "attribute %d of descriptor type %d is not emulated", name, o->type);
  const bool ok = type == r->type || (r->type == CUDNN_TYPE_FLOAT && type == CUDNN_TYPE_DOUBLE);
  if (!ok)
    return BAD(__func__, "attribute %d of descriptor type %d set as type %d, expected %d", name, o->type, type,
               r->type);
  if (count < 1 || !values)
    return BAD(__func__, "attribute %d set with %lld elements from %p", name, (long long)count, values);
  const size_t bytes = type_size(type) * size_t(count);
  o->attrs[name] =
      Attr{type, count, std::vector<char>(static_cast<const char*>(values), static_cast<const char*>(values) + bytes)};
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t d) {
  Obj* o = live(d);
  if (!o) return BAD(__func__, "%p is not a live backend descriptor", d);
  if (o->finalized) return BAD(__func__, "descriptor type %d is already finalized", o->type);
  TRY(finalize(__func__, *o));
  o->finalized = true;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const d, cudnnBackendAttributeName_t name,
                                       cudnnBackendAttributeType_t type, int64_t requested, int64_t* count, void* out) {
  const char* fn = __func__;
  Obj* o = live(d);
  if (!o) return BAD(fn, "%p is not a live backend descriptor", d);
  if (requested < 0) return BAD(fn, "requestedElementCount %lld < 0", (long long)requested);
  // Results fill descriptors the caller created, of the right type.
  auto fill = [&](Type want, int64_t n, auto&& each) -> cudnnStatus_t {
    if (type != CUDNN_TYPE_BACKEND_DESCRIPTOR) return BAD(fn, "attribute %d is read as descriptors", name);
    if (!count) return BAD(fn, "elementCount is null");
    if (requested == 0) {
      *count = n;
      return CUDNN_STATUS_SUCCESS;
    }
    if (!out) return BAD(fn, "arrayOfElements is null");
    const int64_t k = std::min(requested, n);
    for (int64_t i = 0; i < k; ++i) {
      Obj* r = live(static_cast<cudnnBackendDescriptor_t*>(out)[i]);
      if (!r || r->type != want) return BAD(fn, "element %lld is not a live descriptor of type %d", (long long)i, want);
      each(i, *r);
      r->finalized = true;
    }
    *count = k;
    return CUDNN_STATUS_SUCCESS;
  };
  if (o->type == CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR && name == CUDNN_ATTR_ENGINEHEUR_RESULTS) {
    if (!o->finalized) return BAD(fn, "engine heuristic read before it is finalized");
    return fill(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, int64_t(o->engines.size()), [&](int64_t i, Obj& cfg) {
      cfg.engine = o->engines[size_t(i)];
      cfg.graph = o->graph;
    });
  }
  if (o->type == CUDNN_BACKEND_ENGINECFG_DESCRIPTOR && name == CUDNN_ATTR_ENGINECFG_ENGINE) {
    if (o->engine < 0) return BAD(fn, "engine configuration not filled by an engine heuristic");
    return fill(CUDNN_BACKEND_ENGINE_DESCRIPTOR, 1, [&](int64_t, Obj& e) {
      e.engine = o->engine;
      e.graph = o->graph;
    });
  }
  if (o->type == CUDNN_BACKEND_ENGINE_DESCRIPTOR && o->engine >= 0) {
    if (name == CUDNN_ATTR_ENGINE_GLOBAL_INDEX)
      return put<int64_t>(fn, CUDNN_TYPE_INT64, type, requested, count, out, {o->engine});
    if (name == CUDNN_ATTR_ENGINE_NUMERICAL_NOTE) {
      std::vector<cudnnBackendNumericalNote_t> notes;
      if (o->engine != kExact) notes.push_back(CUDNN_NUMERICAL_NOTE_TENSOR_CORE);
      if (o->engine == kDownConvert) notes.push_back(CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS);
      if (o->engine == kNondeterministic) notes.push_back(CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC);
      return put(fn, CUDNN_TYPE_NUMERICAL_NOTE, type, requested, count, out, notes);
    }
  }
  if (o->type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR && name == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE) {
    if (!o->finalized) return BAD(fn, "execution plan read before it is finalized");
    return put<int64_t>(fn, CUDNN_TYPE_INT64, type, requested, count, out, {int64_t(o->ws)});
  }
  return UNSUPPORTED(fn, "reading attribute %d of descriptor type %d is not emulated", name, o->type);
}

cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t plan_d,
                                  cudnnBackendDescriptor_t pack_d) {
  const char* fn = __func__;
  const Obj* plan = live(plan_d);
  const Obj* pack = live(pack_d);
  if (!plan || plan->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR || !plan->finalized)
    return BAD(fn, "executionPlan is not a finalized execution plan");
  if (!pack || pack->type != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR || !pack->finalized)
    return BAD(fn, "variantPack is not a finalized variant pack");
  if (plan->engine == kDownConvert)
    emu::die(
        "cudnnBackendExecute: engine 2 converts float inputs to a 16-bit type "
        "(CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS); a float32 convolution must not run on it");
  const OpNames& on = *op_names(plan->op->type);
  const Attr &uids = *pack->get(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS),
             &ptrs = *pack->get(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS);
  void* data[3];
  const Name roles[3] = {on.x, on.w, on.y};
  for (int r = 0; r < 3; ++r) {
    const Obj& t = *plan->op->ref(roles[r]);
    const int64_t uid = t.get(CUDNN_ATTR_TENSOR_UNIQUE_ID)->at<int64_t>(0);
    const int64_t al = t.get(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT)->at<int64_t>(0);
    int64_t i = 0;
    while (i < uids.count && uids.at<int64_t>(i) != uid) ++i;
    if (i == uids.count) return BAD(fn, "the variant pack has no pointer for tensor uid %lld", (long long)uid);
    data[r] = ptrs.at<void*>(i);
    if (!data[r]) return BAD(fn, "the pointer for tensor uid %lld is null", (long long)uid);
    if (reinterpret_cast<uintptr_t>(data[r]) % uintptr_t(al) != 0)
      return BAD(fn, "the pointer %p for tensor uid %lld is not aligned to the %lld bytes its tensor promised", data[r],
                 (long long)uid, (long long)al);
  }
  void* ws = pack->get(CUDNN_ATTR_VARIANT_PACK_WORKSPACE)->at<void*>(0);
  if (plan->ws > 0 && !ws) return BAD(fn, "the plan needs %zu workspace bytes but the workspace is null", plan->ws);
  const Attr& alpha = *plan->op->get(on.alpha);
  const Attr& beta = *plan->op->get(on.beta);
  auto scalar = [](const Attr& a) { return a.type == CUDNN_TYPE_DOUBLE ? a.at<double>(0) : double(a.at<float>(0)); };
  // The legacy API reads double scalars for double data, float otherwise.
  const bool dbl = tensor_type(*plan->op->ref(on.x)) == CUDNN_DATA_DOUBLE;
  const double da = scalar(alpha), db = scalar(beta);
  const float fa = float(da), fb = float(db);
  const void* pa = dbl ? static_cast<const void*>(&da) : &fa;
  const void* pb = dbl ? static_cast<const void*>(&db) : &fb;
  switch (plan->pass) {
    case kFwd:
      return cudnnConvolutionForward(handle, pa, plan->xd, data[0], plan->wd, data[1], plan->cd,
                                     CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, ws, plan->ws, pb, plan->yd,
                                     data[2]);
    case kBwdData:
      return cudnnConvolutionBackwardData(handle, pa, plan->wd, data[1], plan->yd, data[2], plan->cd,
                                          CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, ws, plan->ws, pb, plan->xd, data[0]);
    default:
      return cudnnConvolutionBackwardFilter(
          handle, pa, plan->xd, data[0], plan->yd, data[2], plan->cd,
          plan->engine == kNondeterministic ? CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 : CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
          ws, plan->ws, pb, plan->wd, data[1]);
  }
}

}  // extern "C"
