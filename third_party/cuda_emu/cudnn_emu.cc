// cudnn_emu.cc: the cuDNN 9 legacy-API calls that core/ops/conv.cu makes
// (handle, tensor/filter/convolution descriptors, algorithm heuristics,
// workspace queries, forward / backward-data / backward-filter convolution),
// on host memory, so conv.cu's descriptor code runs in CI without a GPU.
//
// The point is to make mistakes in conv.cu visible, so this is strict where
// cuDNN is and honours every descriptor field: elements are read through the
// descriptor strides (never assuming contiguity), the filter format picks
// OIHW or OHWI memory, and pad, stride, dilation, groups, mode (a true
// convolution flips the kernel) and alpha/beta all take effect. Argument
// errors return cuDNN's status with one "[cudnn-emu] <function>: ..." line on
// stderr. Float data run with a math type other than CUDNN_FMA_MATH is
// rounded to TF32 first, as Ampere+ tensor cores do, so a caller that lets
// TF32 in sees TF32-sized errors here too. The arithmetic is a plain loop
// (double accumulation for double, float otherwise), queued on the handle's
// stream through emu::enqueue like a kernel launch; what a GPU would turn
// into an illegal access or silent garbage (a pointer outside its
// allocation, an output overlapping an input) is fatal instead.
#include <cudnn.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "third_party/cuda_emu/emu_runtime.h"

namespace {

// ---- Errors ----

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

// ---- Opaque objects ----
// Every live handle/descriptor is registered with its kind, so a destroyed,
// never-created or wrong-kind pointer is a clean BAD_PARAM rather than a read
// of freed memory.

enum class Kind { Handle, Tensor, Filter, Conv };

struct HandleObj {
  static constexpr Kind kKind = Kind::Handle;
  cudaStream_t stream = nullptr;  // the legacy default stream until cudnnSetStream
};
// `set` is false until the Set* call: using an unset descriptor is an error.
struct TensorObj {
  static constexpr Kind kKind = Kind::Tensor;
  bool set = false;
  cudnnDataType_t dt = CUDNN_DATA_FLOAT;
  int dim[4] = {}, stride[4] = {};  // n, c, h, w
};
struct FilterObj {
  static constexpr Kind kKind = Kind::Filter;
  bool set = false;
  cudnnDataType_t dt = CUDNN_DATA_FLOAT;
  cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW;
  int k = 0, c = 0, h = 0, w = 0;
};
struct ConvObj {
  static constexpr Kind kKind = Kind::Conv;
  bool set = false;
  int pad[2] = {}, stride[2] = {}, dil[2] = {};
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  int groups = 1;                             // cuDNN's defaults, changed by their own
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;  // Set* calls, not by the 2d descriptor's
};

std::mutex g_mu;
std::unordered_map<const void*, Kind> g_live;

template <typename T, typename P>
cudnnStatus_t create(P* out, const char* fn) {
  if (!out) return BAD(fn, "output pointer is null");
  T* obj = new T;
  std::lock_guard<std::mutex> lock(g_mu);
  g_live[obj] = T::kKind;
  *out = reinterpret_cast<P>(obj);
  return CUDNN_STATUS_SUCCESS;
}

template <typename T>
T* lookup(const void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_live.find(p);
  return it != g_live.end() && it->second == T::kKind ? static_cast<T*>(const_cast<void*>(p)) : nullptr;
}

template <typename T>
cudnnStatus_t destroy(const void* p, const char* fn) {
  if (!p) return CUDNN_STATUS_SUCCESS;  // cuDNN accepts destroying NULL
  std::unique_lock<std::mutex> lock(g_mu);
  auto it = g_live.find(p);
  if (it == g_live.end() || it->second != T::kKind) {
    lock.unlock();
    return BAD(fn, "%p is not a live object of this kind (destroyed twice?)", p);
  }
  g_live.erase(it);
  delete static_cast<const T*>(p);
  return CUDNN_STATUS_SUCCESS;
}

// ---- Types ----

bool emulated_type(cudnnDataType_t t) {
  return t == CUDNN_DATA_FLOAT || t == CUDNN_DATA_DOUBLE || t == CUDNN_DATA_HALF || t == CUDNN_DATA_BFLOAT16;
}
size_t elem_size(cudnnDataType_t t) { return t == CUDNN_DATA_DOUBLE ? 8 : t == CUDNN_DATA_FLOAT ? 4 : 2; }
const char* type_name(cudnnDataType_t t) {
  return t == CUDNN_DATA_FLOAT ? "FLOAT" : t == CUDNN_DATA_DOUBLE ? "DOUBLE" : t == CUDNN_DATA_HALF ? "HALF"
       : t == CUDNN_DATA_BFLOAT16 ? "BFLOAT16" : "(not emulated)";
}
// cuDNN's convolution configurations: FLOAT, DOUBLE, TRUE_HALF,
// PSEUDO_HALF and PSEUDO_BFLOAT16 (data type / compute type).
bool supported_config(cudnnDataType_t data, cudnnDataType_t compute) {
  switch (data) {
    case CUDNN_DATA_FLOAT: return compute == CUDNN_DATA_FLOAT;
    case CUDNN_DATA_DOUBLE: return compute == CUDNN_DATA_DOUBLE;
    case CUDNN_DATA_HALF: return compute == CUDNN_DATA_HALF || compute == CUDNN_DATA_FLOAT;
    case CUDNN_DATA_BFLOAT16: return compute == CUDNN_DATA_FLOAT;
    default: return false;
  }
}

// ---- The checked problem, captured by value into the queued work ----

// A 4-D operand in element strides. For the filter: k, c/groups, kh, kw.
struct View {
  int64_t dim[4], stride[4];
  int64_t extent() const {  // max offset + 1: the elements the descriptor addresses
    int64_t e = 1;
    for (int i = 0; i < 4; ++i) e += (dim[i] - 1) * stride[i];
    return e;
  }
  int64_t at(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3];
  }
};

struct Problem {
  cudnnDataType_t dt;
  View x, w, y;  // x, w, y for forward; dx, w, dy / x, dw, dy for the backward passes
  int pad[2], stride[2], dil[2], groups;
  bool flip;  // CUDNN_CONVOLUTION: the kernel is applied mirrored
  bool tf32;  // float data without CUDNN_FMA_MATH may run on TF32 tensor cores
};

enum Pass { kFwd, kBwdData, kBwdFilter };
// Descriptor names per pass, for messages: the x-like, filter and y-like operand.
const char* const kNames[3][3] = {{"xDesc", "wDesc", "yDesc"}, {"dxDesc", "wDesc", "dyDesc"},
                                  {"xDesc", "dwDesc", "dyDesc"}};

View tensor_view(const TensorObj& t) {
  View v;
  for (int i = 0; i < 4; ++i) v.dim[i] = t.dim[i], v.stride[i] = t.stride[i];
  return v;
}
// NCHW format is OIHW memory, NHWC is OHWI; the filter descriptor has no strides.
View filter_view(const FilterObj& f) {
  const int64_t k = f.k, c = f.c, h = f.h, w = f.w;
  if (f.format == CUDNN_TENSOR_NHWC) return {{k, c, h, w}, {h * w * c, 1, w * c, c}};
  return {{k, c, h, w}, {c * h * w, h * w, w, 1}};
}

// Checks descriptors the way cuDNN does for any convolution call and fills p.
cudnnStatus_t check_problem(const char* fn, Pass pass, cudnnHandle_t handle, cudnnTensorDescriptor_t xd,
                            cudnnFilterDescriptor_t wd, cudnnConvolutionDescriptor_t cd, cudnnTensorDescriptor_t yd,
                            Problem* p) {
  const char* const* nm = kNames[pass];
  if (!lookup<HandleObj>(handle)) return BAD(fn, "handle %p is null or not a live cudnnHandle_t", (void*)handle);
  const TensorObj* x = lookup<TensorObj>(xd);
  const FilterObj* w = lookup<FilterObj>(wd);
  const ConvObj* c = lookup<ConvObj>(cd);
  const TensorObj* y = lookup<TensorObj>(yd);
  if (!x || !x->set) return BAD(fn, "%s is null, not live or never set", nm[0]);
  if (!w || !w->set) return BAD(fn, "%s is null, not live or never set", nm[1]);
  if (!c || !c->set) return BAD(fn, "convDesc is null, not live or never set");
  if (!y || !y->set) return BAD(fn, "%s is null, not live or never set", nm[2]);
  if (x->dt != w->dt || x->dt != y->dt)
    return BAD(fn, "data types differ: %s %s, %s %s, %s %s", nm[0], type_name(x->dt), nm[1], type_name(w->dt), nm[2],
               type_name(y->dt));
  if (!supported_config(x->dt, c->compute))
    return UNSUPPORTED(fn, "data type %s with compute type %s is not a cuDNN convolution configuration",
                       type_name(x->dt), type_name(c->compute));
  const int g = c->groups;
  if (w->k % g != 0) return BAD(fn, "%s has K=%d output channels, not divisible by groupCount %d", nm[1], w->k, g);
  if (x->dim[1] != w->c * g)
    return BAD(fn, "%s has C=%d channels but %s C=%d times groupCount %d is %d", nm[0], x->dim[1], nm[1], w->c, g,
               w->c * g);
  // out = (in + 2p - d(k-1) - 1) / s + 1, as cudnnGetConvolution2dForwardOutputDim.
  int out[2];
  const int in[2] = {x->dim[2], x->dim[3]}, ker[2] = {w->h, w->w};
  for (int i = 0; i < 2; ++i) {
    const int64_t span = int64_t(in[i]) + 2 * c->pad[i] - int64_t(c->dil[i]) * (ker[i] - 1) - 1;
    if (span < 0)
      return BAD(fn, "dilated filter %dx%d (dilation %d,%d) exceeds the padded input %dx%d", w->h, w->w, c->dil[0],
                 c->dil[1], in[0] + 2 * c->pad[0], in[1] + 2 * c->pad[1]);
    out[i] = int(span / c->stride[i] + 1);
  }
  if (y->dim[0] != x->dim[0] || y->dim[1] != w->k || y->dim[2] != out[0] || y->dim[3] != out[1])
    return BAD(fn,
               "%s is [%d,%d,%d,%d] but %s [%d,%d,%d,%d], %s [%d,%d,%d,%d], pad %d,%d, stride %d,%d, dilation "
               "%d,%d give [%d,%d,%d,%d]",
               nm[2], y->dim[0], y->dim[1], y->dim[2], y->dim[3], nm[0], x->dim[0], x->dim[1], x->dim[2], x->dim[3],
               nm[1], w->k, w->c, w->h, w->w, c->pad[0], c->pad[1], c->stride[0], c->stride[1], c->dil[0], c->dil[1],
               x->dim[0], w->k, out[0], out[1]);
  // Real cuDNN 9 (H100, 2026-11) has no backward algorithm when the filter's
  // format differs from the activations' layout, though forward takes it:
  // conv.cu once described 1x1 and depthwise channels-last weights as NCHW.
  // Only a layout the strides show unambiguously counts (C > 1 and H*W > 1).
  if (pass != kFwd && x->dim[1] > 1 && int64_t(x->dim[2]) * x->dim[3] > 1) {
    const bool data_nhwc = x->stride[1] == 1;
    if (data_nhwc != (w->format == CUDNN_TENSOR_NHWC))
      return UNSUPPORTED(fn, "%s is %s but %s has format %s: no backward algorithm mixes layouts", nm[0],
                         data_nhwc ? "NHWC" : "NCHW", nm[1], w->format == CUDNN_TENSOR_NHWC ? "NHWC" : "NCHW");
  }
  *p = Problem{x->dt, tensor_view(*x), filter_view(*w), tensor_view(*y), {c->pad[0], c->pad[1]},
               {c->stride[0], c->stride[1]}, {c->dil[0], c->dil[1]}, g, c->mode == CUDNN_CONVOLUTION,
               x->dt == CUDNN_DATA_FLOAT && c->math != CUDNN_FMA_MATH};
  return CUDNN_STATUS_SUCCESS;
}

// ---- Algorithms and workspaces ----

const int kAlgoCount[3] = {CUDNN_CONVOLUTION_FWD_ALGO_COUNT, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                           CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT};
// Heuristic preference order (GEMM-based first, as cuDNN ranks them for
// small problems); the unsupported ones end up last with NOT_SUPPORTED.
const int kOrder[3][8] = {{1, 0, 2, 6, 7, 4, 5, 3}, {1, 0, 4, 5, 2, 3}, {1, 0, 3, 5, 2, 6, 4}};

// Each algorithm's family, indexed [pass][algo] as the enums in cudnn_ops.h.
enum class Family { Gemm, Fft, Wino, WinoNonfused, None };
Family family(Pass pass, int algo) {
  using F = Family;
  static const F f[3][8] = {{F::Gemm, F::Gemm, F::Gemm, F::None, F::Fft, F::Fft, F::Wino, F::WinoNonfused},
                            {F::Gemm, F::Gemm, F::Fft, F::Fft, F::Wino, F::WinoNonfused},
                            {F::Gemm, F::Gemm, F::Fft, F::Gemm, F::None, F::WinoNonfused, F::Fft}};
  return f[pass][algo];
}

// cuDNN's documented algorithm restrictions, simplified: FFT and Winograd
// need unit stride and dilation and 16/32-bit data, Winograd a 3x3 kernel
// (nonfused also 5x5). Forward DIRECT and backward-filter WINOGRAD are not
// implemented by cuDNN at all.
bool algo_supported(Pass pass, int algo, const Problem& p) {
  const Family f = family(pass, algo);
  if (f == Family::Gemm) return true;
  if (f == Family::None || p.dt == CUDNN_DATA_DOUBLE) return false;
  if (p.stride[0] != 1 || p.stride[1] != 1 || p.dil[0] != 1 || p.dil[1] != 1) return false;
  const int64_t kh = p.w.dim[2], kw = p.w.dim[3];
  if (f == Family::Wino) return kh == 3 && kw == 3;
  return f == Family::Fft || (kh == kw && (kh == 3 || kh == 5));
}

// A deterministic stand-in for cuDNN's workspace needs: none for algorithm 0
// of each pass (implicit GEMM) and fused Winograd, otherwise one image's
// im2col matrix (GEMM), or four of them (FFT and Winograd transforms), so
// that a caller must really query and pass a workspace.
size_t workspace_bytes(Pass pass, int algo, const Problem& p) {
  const Family f = family(pass, algo);
  if (algo == 0 || f == Family::Wino || f == Family::None) return 0;
  const int64_t column = p.w.dim[1] * p.w.dim[2] * p.w.dim[3] * p.y.dim[2] * p.y.dim[3];
  return size_t(column) * elem_size(p.dt) * (f == Family::Gemm ? 1 : 4);
}

cudnnStatus_t check_algo(const char* fn, Pass pass, int algo, const Problem& p) {
  if (algo < 0 || algo >= kAlgoCount[pass])
    return BAD(fn, "algorithm %d is out of range [0, %d)", algo, kAlgoCount[pass]);
  if (!algo_supported(pass, algo, p))
    return UNSUPPORTED(fn, "algorithm %d does not support this geometry/data type", algo);
  return CUDNN_STATUS_SUCCESS;
}

// The algorithms cuDNN documents as nondeterministic (split reductions
// added with atomics): backward data 0, backward filter 0 and 3. A run of
// one flips the lowest bit (one unit in the last place, little-endian) of
// output element r % n at the r-th such run (next_nondeterministic_run), so
// consecutive runs differ, as atomics' order makes a GPU's last bits differ,
// and a caller that needs the same bits twice must skip them.
bool nondeterministic(Pass pass, int algo) {
  return (pass == kBwdData && algo == 0) || (pass == kBwdFilter && (algo == 0 || algo == 3));
}

// The Get*Algorithm_v7 heuristics. For 16/32-bit floats the top entry is a
// tensor-op (TF32 for float) variant, as cuDNN ranks them on Ampere+, so a
// caller that needs exact float math must skip it; the rest use FMA math for
// float and default math otherwise.
template <typename Perf, typename Algo>
cudnnStatus_t heuristics(const char* fn, Pass pass, const Problem& p, int requested, int* returned, Perf* perf) {
  if (requested < 1) return BAD(fn, "requestedAlgoCount %d < 1", requested);
  if (!returned || !perf) return BAD(fn, "returnedAlgoCount or perfResults is null");
  const cudnnMathType_t base = p.dt == CUDNN_DATA_FLOAT ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH;
  Perf list[16];
  int count = 0;
  auto add = [&](int algo, cudnnMathType_t math) {
    Perf r{};
    r.algo = static_cast<Algo>(algo);
    r.status = algo_supported(pass, algo, p) ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_NOT_SUPPORTED;
    r.time = -1;  // a heuristic, not a measurement
    r.memory = r.status == CUDNN_STATUS_SUCCESS ? workspace_bytes(pass, algo, p) : 0;
    r.determinism = nondeterministic(pass, algo) ? CUDNN_NON_DETERMINISTIC : CUDNN_DETERMINISTIC;
    r.mathType = math;
    list[count++] = r;
  };
  if (p.dt != CUDNN_DATA_DOUBLE) add(kOrder[pass][0], CUDNN_TENSOR_OP_MATH);
  for (int i = 0; i < kAlgoCount[pass]; ++i) add(kOrder[pass][i], base);
  std::stable_partition(list, list + count, [](const Perf& r) { return r.status == CUDNN_STATUS_SUCCESS; });
  *returned = std::min({requested, count, kAlgoCount[pass]});
  std::copy(list, list + *returned, perf);
  return CUDNN_STATUS_SUCCESS;
}

// ---- Arithmetic ----

template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
struct Conv {
  using A = Acc<T>;
  const Problem& p;
  A alpha, beta;
  static A load(T v) {
    if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) return v;
    else return static_cast<float>(v);  // Half / BFloat16
  }
  A in(const T* a, int64_t i) const {  // a product operand
    if constexpr (std::is_same_v<T, float>) return p.tf32 ? emu::round_tf32(a[i]) : a[i];
    else return load(a[i]);
  }
  void out(T* a, int64_t i, A acc) const {
    A v = alpha * acc;
    if (beta != 0) v += beta * load(a[i]);  // beta == 0 must not read a: it may be garbage
    if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) a[i] = v;
    else a[i] = T(v);
  }

  // One loop nest for all passes: every (output pixel, kernel tap) pair of
  // the forward convolution contributes one product to the pass's output,
  // summed in A and then blended into the strided output.
  void run(Pass pass, void* xp, void* wp, void* yp) const {
    T *x = static_cast<T*>(xp), *w = static_cast<T*>(wp), *y = static_cast<T*>(yp);
    const View& o = pass == kFwd ? p.y : pass == kBwdData ? p.x : p.w;
    std::vector<A> acc(size_t(o.dim[0] * o.dim[1] * o.dim[2] * o.dim[3]), A(0));
    auto dense = [&](int64_t a, int64_t b, int64_t c, int64_t d) {
      return ((a * o.dim[1] + b) * o.dim[2] + c) * o.dim[3] + d;
    };
    const int64_t cg = p.w.dim[1], kpg = p.w.dim[0] / p.groups, kh = p.w.dim[2], kw = p.w.dim[3];
    for (int64_t n = 0; n < p.y.dim[0]; ++n)
      for (int64_t k = 0; k < p.y.dim[1]; ++k)
        for (int64_t oy = 0; oy < p.y.dim[2]; ++oy)
          for (int64_t ox = 0; ox < p.y.dim[3]; ++ox)
            for (int64_t c = 0; c < cg; ++c)
              for (int64_t r = 0; r < kh; ++r)
                for (int64_t s = 0; s < kw; ++s) {
                  const int64_t iy = oy * p.stride[0] - p.pad[0] + r * p.dil[0];
                  const int64_t ix = ox * p.stride[1] - p.pad[1] + s * p.dil[1];
                  if (iy < 0 || iy >= p.x.dim[2] || ix < 0 || ix >= p.x.dim[3]) continue;  // zero padding
                  const int64_t ci = k / kpg * cg + c;  // k's group reads its own slice of x's channels
                  const int64_t fr = p.flip ? kh - 1 - r : r, fs = p.flip ? kw - 1 - s : s;
                  const int64_t xi = p.x.at(n, ci, iy, ix), wi = p.w.at(k, c, fr, fs), yi = p.y.at(n, k, oy, ox);
                  if (pass == kFwd) acc[dense(n, k, oy, ox)] += in(x, xi) * in(w, wi);
                  if (pass == kBwdData) acc[dense(n, ci, iy, ix)] += in(y, yi) * in(w, wi);
                  if (pass == kBwdFilter) acc[dense(k, c, fr, fs)] += in(x, xi) * in(y, yi);
                }
    T* dst = pass == kFwd ? y : pass == kBwdData ? x : w;
    for (int64_t a = 0; a < o.dim[0]; ++a)
      for (int64_t b = 0; b < o.dim[1]; ++b)
        for (int64_t c = 0; c < o.dim[2]; ++c)
          for (int64_t d = 0; d < o.dim[3]; ++d) out(dst, o.at(a, b, c, d), acc[dense(a, b, c, d)]);
  }
};

// The three convolution calls: validate now, compute in stream order.
// x, w, y are the x-like, filter and y-like operands (the pass's output is
// one of them).
cudnnStatus_t execute(const char* fn, Pass pass, cudnnHandle_t handle, const void* alpha, const void* beta,
                      cudnnTensorDescriptor_t xd, const void* x, cudnnFilterDescriptor_t wd, const void* w,
                      cudnnConvolutionDescriptor_t cd, cudnnTensorDescriptor_t yd, const void* y, int algo,
                      void* ws, size_t ws_bytes) {
  Problem p;
  TRY(check_problem(fn, pass, handle, xd, wd, cd, yd, &p));
  if (!alpha || !beta) return BAD(fn, "alpha or beta is null");
  TRY(check_algo(fn, pass, algo, p));
  const size_t need = workspace_bytes(pass, algo, p);
  if (ws_bytes < need)
    return BAD(fn, "workSpaceSizeInBytes %zu is less than the %zu bytes algorithm %d needs", ws_bytes, need, algo);
  if (ws_bytes > 0 && !ws) return BAD(fn, "workSpace is null but workSpaceSizeInBytes is %zu", ws_bytes);
  const char* const* nm = kNames[pass];
  const void* ptrs[3] = {x, w, y};
  const View* views[3] = {&p.x, &p.w, &p.y};
  const size_t es = elem_size(p.dt);
  for (int i = 0; i < 3; ++i) {
    if (!ptrs[i]) return BAD(fn, "data pointer for %s is null", nm[i]);
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % es)
      return BAD(fn, "data pointer %p for %s is not aligned to its %zu-byte elements", ptrs[i], nm[i], es);
    // Out-of-allocation addresses are illegal memory accesses on a GPU: fatal.
    emu::check_device_range(ptrs[i], views[i]->extent() * es, (std::string(fn) + " data of " + nm[i]).c_str());
  }
  if (ws_bytes > 0) emu::check_device_range(ws, ws_bytes, (std::string(fn) + " workSpace").c_str());
  // cuDNN has no in-place convolution: an output overlapping an input (or
  // the workspace) silently computes garbage on a GPU, so it is fatal here.
  const int o = pass == kFwd ? 2 : pass == kBwdData ? 0 : 1;
  auto lo = [&](int i) { return static_cast<const char*>(ptrs[i]); };
  auto hi = [&](int i) { return lo(i) + views[i]->extent() * es; };
  for (int i = 0; i < 3; ++i)
    if (i != o && lo(i) < hi(o) && lo(o) < hi(i)) emu::die(std::string(fn) + ": the output overlaps " + nm[i]);
  if (need > 0 && static_cast<const char*>(ws) < hi(o) && lo(o) < static_cast<const char*>(ws) + need)
    emu::die(std::string(fn) + ": the output overlaps the workspace");

  // alpha/beta are host scalars read at call time: double for double data,
  // float for everything else.
  const bool dbl = p.dt == CUDNN_DATA_DOUBLE;
  const double a = dbl ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double b = dbl ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  void *px = const_cast<void*>(x), *pw = const_cast<void*>(w), *py = const_cast<void*>(y);
  void* out = pass == kFwd ? py : pass == kBwdData ? px : pw;
  const View out_view = *views[o];
  const bool nondet = nondeterministic(pass, algo);
  cudaStream_t stream = lookup<HandleObj>(handle)->stream;
  emu::enqueue(
      stream,
      [=] {
        // Clobber the part of the workspace the algorithm owns, as a real
        // kernel does: a workspace reused too early shows up as corruption.
        if (need > 0) std::memset(ws, 0xa5, need);
        switch (p.dt) {
          case CUDNN_DATA_FLOAT: Conv<float>{p, float(a), float(b)}.run(pass, px, pw, py); break;
          case CUDNN_DATA_DOUBLE: Conv<double>{p, a, b}.run(pass, px, pw, py); break;
          case CUDNN_DATA_HALF: Conv<ember::Half>{p, float(a), float(b)}.run(pass, px, pw, py); break;
          default: Conv<ember::BFloat16>{p, float(a), float(b)}.run(pass, px, pw, py); break;
        }
        if (nondet) {  // one element of the output, another each run, by its coordinates (views may have gaps)
          const int64_t* d = out_view.dim;
          int64_t r = static_cast<int64_t>(emu::next_nondeterministic_run() % uint64_t(d[0] * d[1] * d[2] * d[3]));
          int64_t c[4];
          for (int i = 3; i >= 0; --i) c[i] = r % d[i], r /= d[i];
          static_cast<unsigned char*>(out)[out_view.at(c[0], c[1], c[2], c[3]) * int64_t(es)] ^= 1u;
        }
      },
      fn);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t max_count(const char* fn, cudnnHandle_t handle, int* count, Pass pass) {
  if (!lookup<HandleObj>(handle)) return BAD(fn, "handle %p is null or not live", (void*)handle);
  if (!count) return BAD(fn, "count is null");
  *count = kAlgoCount[pass];
  return CUDNN_STATUS_SUCCESS;
}

template <typename Perf, typename Algo>
cudnnStatus_t algo_query(const char* fn, Pass pass, cudnnHandle_t handle, cudnnTensorDescriptor_t xd,
                         cudnnFilterDescriptor_t wd, cudnnConvolutionDescriptor_t cd, cudnnTensorDescriptor_t yd,
                         int requested, int* returned, Perf* perf) {
  Problem p;
  TRY(check_problem(fn, pass, handle, xd, wd, cd, yd, &p));
  return heuristics<Perf, Algo>(fn, pass, p, requested, returned, perf);
}

// The Find*AlgorithmEx calls: every candidate "timed" (the heuristics'
// order stands in for measured times, 1 ms apart, except that the
// nondeterministic algorithms come first, as cuDNN often measures its
// atomics-based ones fastest), those that need more workspace than given
// reported as CUDNN_STATUS_ALLOC_FAILED, tensor-op candidates dropped when
// the descriptor asks for FMA math, failures last.
template <typename Perf, typename Algo>
cudnnStatus_t find_query(const char* fn, Pass pass, cudnnHandle_t handle, cudnnTensorDescriptor_t xd,
                         cudnnFilterDescriptor_t wd, cudnnConvolutionDescriptor_t cd, cudnnTensorDescriptor_t yd,
                         int requested, int* returned, Perf* perf, void* ws, size_t ws_bytes) {
  Problem p;
  TRY(check_problem(fn, pass, handle, xd, wd, cd, yd, &p));
  if (ws_bytes > 0) emu::check_device_range(ws, ws_bytes, fn);
  Perf list[16];
  int n = 0;
  TRY((heuristics<Perf, Algo>(fn, pass, p, 16, &n, list)));
  const bool fma = p.dt == CUDNN_DATA_FLOAT && !p.tf32;
  std::stable_partition(list, list + n, [](const Perf& r) { return r.determinism == CUDNN_NON_DETERMINISTIC; });
  int kept = 0;
  for (int i = 0; i < n; ++i) {
    Perf r = list[i];
    if (fma && r.mathType == CUDNN_TENSOR_OP_MATH) continue;
    if (r.status == CUDNN_STATUS_SUCCESS && r.memory > ws_bytes) r.status = CUDNN_STATUS_ALLOC_FAILED;
    r.time = static_cast<float>(kept);
    list[kept++] = r;
  }
  std::stable_partition(list, list + kept, [](const Perf& r) { return r.status == CUDNN_STATUS_SUCCESS; });
  *returned = std::min(requested, kept);
  std::copy(list, list + *returned, perf);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t ws_query(const char* fn, Pass pass, cudnnHandle_t handle, cudnnTensorDescriptor_t xd,
                       cudnnFilterDescriptor_t wd, cudnnConvolutionDescriptor_t cd, cudnnTensorDescriptor_t yd,
                       int algo, size_t* sizeInBytes) {
  Problem p;
  TRY(check_problem(fn, pass, handle, xd, wd, cd, yd, &p));
  if (!sizeInBytes) return BAD(fn, "sizeInBytes is null");
  TRY(check_algo(fn, pass, algo, p));
  *sizeInBytes = workspace_bytes(pass, algo, p);
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace

// ---- The API (prototypes exactly as in cudnn_graph.h / cudnn_ops.h / cudnn_cnn.h) ----

extern "C" {

cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) { return create<HandleObj>(handle, "cudnnCreate"); }
cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) { return destroy<HandleObj>(handle, "cudnnDestroy"); }
cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId) {
  HandleObj* h = lookup<HandleObj>(handle);
  if (!h) return BAD("cudnnSetStream", "handle %p is null or not a live cudnnHandle_t", (void*)handle);
  h->stream = streamId;
  return CUDNN_STATUS_SUCCESS;
}

const char* cudnnGetErrorString(cudnnStatus_t status) {
  switch (status) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    case CUDNN_STATUS_INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
    default: return "CUDNN_STATUS_UNKNOWN (not produced by the emulator)";
  }
}

// -- Descriptors --

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d) { return create<TensorObj>(d, __func__); }
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) { return destroy<TensorObj>(d, __func__); }
cudnnStatus_t cudnnSetTensor4dDescriptorEx(cudnnTensorDescriptor_t tensorDesc, cudnnDataType_t dataType, int n, int c,
                                           int h, int w, int nStride, int cStride, int hStride, int wStride) {
  const char* fn = "cudnnSetTensor4dDescriptorEx";
  TensorObj* t = lookup<TensorObj>(tensorDesc);
  if (!t) return BAD(fn, "tensorDesc %p is null or not live", (void*)tensorDesc);
  if (!emulated_type(dataType)) return UNSUPPORTED(fn, "data type %d is not emulated", int(dataType));
  const int dim[4] = {n, c, h, w}, stride[4] = {nStride, cStride, hStride, wStride};
  int64_t extent = 1;
  for (int i = 0; i < 4; ++i) {
    if (dim[i] <= 0 || stride[i] <= 0)
      return BAD(fn, "dims [%d,%d,%d,%d] and strides [%d,%d,%d,%d] must be positive", n, c, h, w, nStride, cStride,
                 hStride, wStride);
    extent += int64_t(dim[i] - 1) * stride[i];
  }
  if (extent > INT_MAX) return UNSUPPORTED(fn, "tensor spans %lld elements, over 2^31", (long long)extent);
  t->dt = dataType;
  std::memcpy(t->dim, dim, sizeof dim);
  std::memcpy(t->stride, stride, sizeof stride);
  t->set = true;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d) { return create<FilterObj>(d, __func__); }
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) { return destroy<FilterObj>(d, __func__); }
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t filterDesc, cudnnDataType_t dataType,
                                         cudnnTensorFormat_t format, int k, int c, int h, int w) {
  const char* fn = "cudnnSetFilter4dDescriptor";
  FilterObj* f = lookup<FilterObj>(filterDesc);
  if (!f) return BAD(fn, "filterDesc %p is null or not live", (void*)filterDesc);
  if (!emulated_type(dataType)) return UNSUPPORTED(fn, "data type %d is not emulated", int(dataType));
  if (format == CUDNN_TENSOR_NCHW_VECT_C) return UNSUPPORTED(fn, "format NCHW_VECT_C is not emulated");
  if (format != CUDNN_TENSOR_NCHW && format != CUDNN_TENSOR_NHWC) return BAD(fn, "format %d is invalid", int(format));
  if (k <= 0 || c <= 0 || h <= 0 || w <= 0) return BAD(fn, "dims [%d,%d,%d,%d] must be positive", k, c, h, w);
  if (int64_t(k) * c * h * w > INT_MAX) return UNSUPPORTED(fn, "filter over cuDNN's 2^31-element limit");
  f->dt = dataType, f->format = format, f->k = k, f->c = c, f->h = h, f->w = w, f->set = true;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d) { return create<ConvObj>(d, __func__); }
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) {
  return destroy<ConvObj>(d, __func__);
}
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t convDesc, int pad_h, int pad_w, int u,
                                              int v, int dilation_h, int dilation_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t computeType) {
  const char* fn = "cudnnSetConvolution2dDescriptor";
  ConvObj* c = lookup<ConvObj>(convDesc);
  if (!c) return BAD(fn, "convDesc %p is null or not live", (void*)convDesc);
  if (pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0 || dilation_h <= 0 || dilation_w <= 0)
    return BAD(fn, "pad %d,%d must be >= 0 and stride %d,%d, dilation %d,%d positive", pad_h, pad_w, u, v, dilation_h,
               dilation_w);
  if (mode != CUDNN_CONVOLUTION && mode != CUDNN_CROSS_CORRELATION) return BAD(fn, "mode %d is invalid", int(mode));
  if (!emulated_type(computeType) && computeType != CUDNN_DATA_INT32)
    return BAD(fn, "computeType %d is invalid", int(computeType));
  // Group count and math type are separate settings and are kept.
  c->pad[0] = pad_h, c->pad[1] = pad_w, c->stride[0] = u, c->stride[1] = v;
  c->dil[0] = dilation_h, c->dil[1] = dilation_w, c->mode = mode, c->compute = computeType, c->set = true;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t convDesc, int groupCount) {
  ConvObj* c = lookup<ConvObj>(convDesc);
  if (!c) return BAD("cudnnSetConvolutionGroupCount", "convDesc %p is null or not live", (void*)convDesc);
  if (groupCount < 1) return BAD("cudnnSetConvolutionGroupCount", "groupCount %d < 1", groupCount);
  c->groups = groupCount;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t convDesc, cudnnMathType_t mathType) {
  ConvObj* c = lookup<ConvObj>(convDesc);
  if (!c) return BAD("cudnnSetConvolutionMathType", "convDesc %p is null or not live", (void*)convDesc);
  if (mathType < CUDNN_DEFAULT_MATH || mathType > CUDNN_FMA_MATH)
    return BAD("cudnnSetConvolutionMathType", "mathType %d is invalid", int(mathType));
  c->math = mathType;
  return CUDNN_STATUS_SUCCESS;
}

// -- Algorithm heuristics and workspace sizes --

cudnnStatus_t cudnnGetConvolutionForwardAlgorithmMaxCount(cudnnHandle_t handle, int* count) {
  return max_count("cudnnGetConvolutionForwardAlgorithmMaxCount", handle, count, kFwd);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithmMaxCount(cudnnHandle_t handle, int* count) {
  return max_count("cudnnGetConvolutionBackwardDataAlgorithmMaxCount", handle, count, kBwdData);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(cudnnHandle_t handle, int* count) {
  return max_count("cudnnGetConvolutionBackwardFilterAlgorithmMaxCount", handle, count, kBwdFilter);
}

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc, const cudnnFilterDescriptor_t filterDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t destDesc, const int requestedAlgoCount,
    int* returnedAlgoCount, cudnnConvolutionFwdAlgoPerf_t* perfResults) {
  return algo_query<cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t>(
      "cudnnGetConvolutionForwardAlgorithm_v7", kFwd, handle, srcDesc, filterDesc, convDesc, destDesc,
      requestedAlgoCount, returnedAlgoCount, perfResults);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t filterDesc, const cudnnTensorDescriptor_t diffDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t gradDesc, const int requestedAlgoCount,
    int* returnedAlgoCount, cudnnConvolutionBwdDataAlgoPerf_t* perfResults) {
  return algo_query<cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t>(
      "cudnnGetConvolutionBackwardDataAlgorithm_v7", kBwdData, handle, gradDesc, filterDesc, convDesc, diffDesc,
      requestedAlgoCount, returnedAlgoCount, perfResults);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc, const cudnnTensorDescriptor_t diffDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t gradDesc, const int requestedAlgoCount,
    int* returnedAlgoCount, cudnnConvolutionBwdFilterAlgoPerf_t* perfResults) {
  return algo_query<cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t>(
      "cudnnGetConvolutionBackwardFilterAlgorithm_v7", kBwdFilter, handle, srcDesc, gradDesc, convDesc, diffDesc,
      requestedAlgoCount, returnedAlgoCount, perfResults);
}

cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc,
                                                     const void*, const cudnnFilterDescriptor_t wDesc, const void*,
                                                     const cudnnConvolutionDescriptor_t convDesc,
                                                     const cudnnTensorDescriptor_t yDesc, void*,
                                                     const int requestedAlgoCount, int* returnedAlgoCount,
                                                     cudnnConvolutionFwdAlgoPerf_t* perfResults, void* workSpace,
                                                     size_t workSpaceSizeInBytes) {
  return find_query<cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t>(
      "cudnnFindConvolutionForwardAlgorithmEx", kFwd, handle, xDesc, wDesc, convDesc, yDesc, requestedAlgoCount,
      returnedAlgoCount, perfResults, workSpace, workSpaceSizeInBytes);
}
cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithmEx(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const void*, const cudnnTensorDescriptor_t dyDesc,
    const void*, const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t dxDesc, void*,
    const int requestedAlgoCount, int* returnedAlgoCount, cudnnConvolutionBwdDataAlgoPerf_t* perfResults,
    void* workSpace, size_t workSpaceSizeInBytes) {
  return find_query<cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t>(
      "cudnnFindConvolutionBackwardDataAlgorithmEx", kBwdData, handle, dxDesc, wDesc, convDesc, dyDesc,
      requestedAlgoCount, returnedAlgoCount, perfResults, workSpace, workSpaceSizeInBytes);
}
cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const void*, const cudnnTensorDescriptor_t dyDesc,
    const void*, const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t dwDesc, void*,
    const int requestedAlgoCount, int* returnedAlgoCount, cudnnConvolutionBwdFilterAlgoPerf_t* perfResults,
    void* workSpace, size_t workSpaceSizeInBytes) {
  return find_query<cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t>(
      "cudnnFindConvolutionBackwardFilterAlgorithmEx", kBwdFilter, handle, xDesc, dwDesc, convDesc, dyDesc,
      requestedAlgoCount, returnedAlgoCount, perfResults, workSpace, workSpaceSizeInBytes);
}

cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc,
                                                      const cudnnFilterDescriptor_t wDesc,
                                                      const cudnnConvolutionDescriptor_t convDesc,
                                                      const cudnnTensorDescriptor_t yDesc,
                                                      cudnnConvolutionFwdAlgo_t algo, size_t* sizeInBytes) {
  return ws_query("cudnnGetConvolutionForwardWorkspaceSize", kFwd, handle, xDesc, wDesc, convDesc, yDesc, algo,
                  sizeInBytes);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc,
                                                           const cudnnTensorDescriptor_t dyDesc,
                                                           const cudnnConvolutionDescriptor_t convDesc,
                                                           const cudnnTensorDescriptor_t dxDesc,
                                                           cudnnConvolutionBwdDataAlgo_t algo, size_t* sizeInBytes) {
  return ws_query("cudnnGetConvolutionBackwardDataWorkspaceSize", kBwdData, handle, dxDesc, wDesc, convDesc, dyDesc,
                  algo, sizeInBytes);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t gradDesc,
    cudnnConvolutionBwdFilterAlgo_t algo, size_t* sizeInBytes) {
  return ws_query("cudnnGetConvolutionBackwardFilterWorkspaceSize", kBwdFilter, handle, xDesc, gradDesc, convDesc,
                  dyDesc, algo, sizeInBytes);
}

// -- Convolutions: output = alpha * op(inputs) + beta * output --

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t handle, const void* alpha, const cudnnTensorDescriptor_t xDesc,
                                      const void* x, const cudnnFilterDescriptor_t wDesc, const void* w,
                                      const cudnnConvolutionDescriptor_t convDesc, cudnnConvolutionFwdAlgo_t algo,
                                      void* workSpace, size_t workSpaceSizeInBytes, const void* beta,
                                      const cudnnTensorDescriptor_t yDesc, void* y) {
  return execute("cudnnConvolutionForward", kFwd, handle, alpha, beta, xDesc, x, wDesc, w, convDesc, yDesc, y, algo,
                 workSpace, workSpaceSizeInBytes);
}
cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t handle, const void* alpha, const cudnnFilterDescriptor_t wDesc,
                                           const void* w, const cudnnTensorDescriptor_t dyDesc, const void* dy,
                                           const cudnnConvolutionDescriptor_t convDesc,
                                           cudnnConvolutionBwdDataAlgo_t algo, void* workSpace,
                                           size_t workSpaceSizeInBytes, const void* beta,
                                           const cudnnTensorDescriptor_t dxDesc, void* dx) {
  return execute("cudnnConvolutionBackwardData", kBwdData, handle, alpha, beta, dxDesc, dx, wDesc, w, convDesc, dyDesc,
                 dy, algo, workSpace, workSpaceSizeInBytes);
}
cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t handle, const void* alpha,
                                             const cudnnTensorDescriptor_t xDesc, const void* x,
                                             const cudnnTensorDescriptor_t dyDesc, const void* dy,
                                             const cudnnConvolutionDescriptor_t convDesc,
                                             cudnnConvolutionBwdFilterAlgo_t algo, void* workSpace,
                                             size_t workSpaceSizeInBytes, const void* beta,
                                             const cudnnFilterDescriptor_t dwDesc, void* dw) {
  return execute("cudnnConvolutionBackwardFilter", kBwdFilter, handle, alpha, beta, xDesc, x, dwDesc, dw, convDesc,
                 dyDesc, dy, algo, workSpace, workSpaceSizeInBytes);
}

}  // extern "C"

namespace emu {
uint64_t next_nondeterministic_run() {
  static std::atomic<uint64_t> runs{0};
  return runs.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace emu
