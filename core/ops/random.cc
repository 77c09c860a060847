// Seeded random tensors: uniform, normal, bernoulli, randint. Every element
// is a pure function of (seed, offset, index) through Philox (philox.h), so
// the CPU kernel here and random.cu produce the same values for a seed.
#include <cmath>

#include "core/autograd_hook.h"
#include "core/cuda_graph.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/philox.h"

namespace ember {

// ---- CPU kernel ----
void random_cpu(RandomKind kind, Tensor& out, double a, double b, uint64_t seed, uint64_t offset, const Tensor& p) {
  EMBER_DISPATCH_ALL(out.dtype(), "random", [&] {
    using T = scalar_t;
    T* y = static_cast<T*>(out.raw_data());
    const int64_t n = out.numel();
    auto prob = [&](int64_t i) -> double {
      if (kind != RandomKind::Bernoulli_Tensor) return a;
      double v = 0;
      EMBER_DISPATCH_FLOAT(p.dtype(), "bernoulli", [&] {
        v = static_cast<double>(static_cast<acc_t<scalar_t>>(static_cast<const scalar_t*>(p.raw_data())[i]));
      });
      return v;
    };
    const bool bern = is_bernoulli(kind);
    parallel_for(n, 4096, [&](int64_t s, int64_t e) {
      BernoulliDraws draws{seed, offset};  // one Philox call for each four elements
      for (int64_t i = s; i < e; ++i) {
        const double v = bern ? (draws.word(i) < keep_threshold(prob(i)) ? 1.0 : 0.0)
                              : random_value(kind, i, a, b, 0.0, seed, offset);
        T t = cast_value<T, double>(v);
        if constexpr (std::is_floating_point_v<acc_t<T>>) {
          // Rounding to a narrow type can reach the open upper bound.
          if (kind == RandomKind::Uniform && static_cast<double>(static_cast<acc_t<T>>(t)) >= b)
            t = static_cast<T>(static_cast<acc_t<T>>(a));
        }
        y[i] = t;
      }
    });
  });
}

// ---- Op layer ----
Generator& default_generator() {
  static Generator g(0);
  return g;
}
void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

namespace {
void run_random(RandomKind kind, Tensor& out, double a, double b, Generator* gen, const Tensor& p = Tensor()) {
  check_inplace(out, "random");
  Generator& g = gen ? *gen : default_generator();
  // Inside a CUDA graph the kernel reads the generator's state on the
  // device, which each replay writes (cuda_graph.h).
  const std::optional<CapturedRng> captured = out.is_cuda() ? cuda_graph_rng(g, out.device().index) : std::nullopt;
  const uint64_t offset = captured ? captured->offset : g.next_offset();
  const uint64_t* rng = captured ? captured->state : nullptr;
  if (out.numel() == 0) return;
  if (out.is_contiguous()) {
    if (out.is_cuda())
      random_cuda(kind, out, a, b, g.seed(), offset, p, rng);
    else random_cpu(kind, out, a, b, g.seed(), offset, p);
    return;
  }
  Tensor tmp = Tensor::empty(out.sizes(), out.options());
  if (out.is_cuda())
    random_cuda(kind, tmp, a, b, g.seed(), offset, p, rng);
  else random_cpu(kind, tmp, a, b, g.seed(), offset, p);
  out.copy_(tmp);
}
}  // namespace

Tensor& uniform_(Tensor& t, double low, double high, Generator* gen) {
  EMBER_CHECK(is_floating(t.dtype()), "uniform_: expected a floating dtype, got ", t.dtype());
  EMBER_CHECK(low <= high, "uniform_: low ", low, " must not exceed high ", high);
  run_random(RandomKind::Uniform, t, low, high, gen);
  return t;
}

Tensor& normal_(Tensor& t, double mean, double std, Generator* gen) {
  EMBER_CHECK(is_floating(t.dtype()), "normal_: expected a floating dtype, got ", t.dtype());
  EMBER_CHECK(std >= 0, "normal_: std must be non-negative, got ", std);
  run_random(RandomKind::Normal, t, mean, std, gen);
  return t;
}

Tensor rand(const Shape& sizes, TensorOptions opts, Generator* gen) {
  Tensor t = Tensor::empty(sizes, opts);
  return uniform_(t, 0.0, 1.0, gen);
}

Tensor randn(const Shape& sizes, TensorOptions opts, Generator* gen) {
  Tensor t = Tensor::empty(sizes, opts);
  return normal_(t, 0.0, 1.0, gen);
}

Tensor bernoulli(const Tensor& p, Generator* gen) {
  EMBER_CHECK(p.defined() && is_floating(p.dtype()), "bernoulli: probabilities must be a floating tensor");
  double lo = min(p).item(), hi = max(p).item();
  EMBER_CHECK(lo >= 0 && hi <= 1, "bernoulli: probabilities must be in [0, 1], got range [", lo, ", ", hi, "]");
  Tensor out = Tensor::empty(p.sizes(), p.options());
  Tensor pc = p.contiguous();
  run_random(RandomKind::Bernoulli_Tensor, out, 0, 0, gen, pc);
  return out;
}

Tensor bernoulli(const Shape& sizes, double p, TensorOptions opts, Generator* gen) {
  EMBER_CHECK(p >= 0 && p <= 1, "bernoulli: p must be in [0, 1], got ", p);
  Tensor out = Tensor::empty(sizes, opts);
  run_random(RandomKind::Bernoulli, out, p, 0, gen);
  return out;
}

Tensor randint(int64_t low, int64_t high, const Shape& sizes, TensorOptions opts, Generator* gen) {
  EMBER_CHECK(low < high, "randint: low ", low, " must be less than high ", high);
  Tensor u = rand(sizes, {DType::Float64, opts.device}, gen);
  // floor(low + (high - low) * u) with u in [0, 1): uniform over [low, high).
  Tensor f = (u * static_cast<double>(high - low)).to(DType::Int64);  // non-negative: truncation is floor
  return (f + static_cast<double>(low)).to(opts.dtype);
}

}  // namespace ember
