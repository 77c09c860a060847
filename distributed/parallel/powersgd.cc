// PowerSGD (powersgd.h): the bucket's gradients sorted into matrices worth
// compressing and the rest, the two allreduce rounds (uncompressed + Ps at
// once, then Qs when the bucket is waited for), decompression and the
// error kept for the next step.
#include "distributed/parallel/powersgd.h"

#include <cmath>
#include <exception>
#include <utility>
#include <vector>

#include "core/autograd_hook.h"
#include "core/exception.h"

namespace ember::distributed {

PowerSGDState::PowerSGDState(PowerSGDOptions options) : options_(options), gen_(options.random_seed) {
  EMBER_CHECK(options_.matrix_approximation_rank >= 1, "PowerSGDOptions: matrix_approximation_rank ",
              options_.matrix_approximation_rank, " must be at least 1");
  EMBER_CHECK(options_.start_powerSGD_iter >= 0, "PowerSGDOptions: start_powerSGD_iter ", options_.start_powerSGD_iter,
              " must not be negative");
  EMBER_CHECK(options_.min_compression_rate > 0, "PowerSGDOptions: min_compression_rate ",
              options_.min_compression_rate, " must be positive");
  EMBER_CHECK(options_.orthogonalization_epsilon >= 0, "PowerSGDOptions: orthogonalization_epsilon ",
              options_.orthogonalization_epsilon, " must not be negative");
}

int64_t PowerSGDState::iter() const {
  std::lock_guard<std::mutex> lock(mu_);
  return iter_;
}

PowerSGDState::Stats PowerSGDState::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void orthogonalize_columns(const Tensor& out, double epsilon) {
  NoGradGuard no_grad;
  // In float64: Gram-Schmidt in float32 loses orthogonality in proportion
  // to the matrix's condition (the later columns of a rank-4 P are close to
  // noise), where torch switches to Householder QR above rank 2; float64
  // Gram-Schmidt is as orthogonal as that, and the matrices are small
  // (n x r).
  Tensor m = out.to(DType::Float64);
  const int64_t r = m.size(1);
  for (int64_t i = 0; i < r; ++i) {
    Tensor col = m.narrow(1, i, 1);
    Tensor norm = sqrt(sum(col * col));
    if (epsilon > 0) norm = norm + epsilon;
    // A column of zeros (a gradient that is zero everywhere) stays zero
    // instead of 0/0 (torch's QR, above rank 2, does not make NaN either).
    norm = where(eq(norm, zeros_like(norm)), ones_like(norm), norm);
    col.copy_(col / norm);
    if (i + 1 < r) {
      Tensor rest = m.narrow(1, i + 1, r - i - 1);
      rest.copy_(rest - sum(col * rest, {0}, /*keepdim=*/true) * col);
    }
  }
  Tensor dst = out;
  dst.copy_(m);
}

namespace {

// The second half of a bucket's reduction, run once by the first wait().
class DeferredWork : public Work {
 public:
  explicit DeferredWork(std::function<void()> finish) : finish_(std::move(finish)) {}
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  bool is_success() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_ && !error_;
  }
  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      try {
        finish_();
      } catch (...) {
        error_ = std::current_exception();
      }
      done_ = true;
      finish_ = nullptr;
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool wait(Millis) override {
    wait();
    return true;
  }
  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  std::mutex mu_;
  std::function<void()> finish_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace

// One compressed reduction of one bucket (a friend of the state).
struct PowerSGDStep {
  static std::shared_ptr<Work> run(const std::shared_ptr<PowerSGDState>& st, ProcessGroup& pg, const GradBucket& bucket,
                                   bool average) {
    const PowerSGDOptions& o = st->options_;
    Tensor buffer = bucket.buffer;  // a handle: writes land in the bucket
    {
      std::lock_guard<std::mutex> lock(st->mu_);
      if (st->iter_ < o.start_powerSGD_iter) {
        if (bucket.is_last) ++st->iter_;
        return pg.allreduce(buffer, average ? ReduceOp::Avg : ReduceOp::Sum);
      }
    }
    EMBER_CHECK(buffer.dtype() == DType::Float32 || buffer.dtype() == DType::Float64, "powerSGD_hook: bucket ",
                bucket.index, " holds ", buffer.dtype(),
                " gradients; PowerSGD compresses float32 or float64 ones (autocast keeps float32 parameters)");
    NoGradGuard no_grad;
    std::unique_lock<std::mutex> lock(st->mu_);
    PowerSGDState::Bucket& b = st->buckets_[bucket.index];
    Tensor meant;  // the bucket with the last error added: what this step means to send
    if (o.use_error_feedback) {
      if (!b.error.defined() || b.error.numel() != buffer.numel())
        b.error = zeros_like(buffer);
      else
        buffer.copy_(buffer + b.error);
      meant = buffer.clone();
    }
    // Which gradients are worth compressing: M is n x m, viewed from the
    // gradient's first dimension by the rest.
    struct Matrix {
      Tensor m;
      int64_t n, cols;
      int r;
      Tensor p, q;
    };
    std::vector<Matrix> compressed;
    std::vector<Tensor> whole;
    int64_t p_numel = 0, q_numel = 0;
    for (const Tensor& g : bucket.gradients) {
      const int64_t n = g.dim() == 0 ? 1 : g.size(0), cols = n == 0 ? 0 : g.numel() / n;
      const int r = static_cast<int>(std::min<int64_t>({n, cols, o.matrix_approximation_rank}));
      const bool worth =
          r > 0 && static_cast<double>((n + cols) * r) * o.min_compression_rate < static_cast<double>(n * cols);
      st->stats_.numel_before += n * cols;
      st->stats_.numel_after += worth ? (n + cols) * r : n * cols;
      if (worth) {
        // A channels-last gradient is compressed as the matrix of its memory
        // ([O, H*W*C], the columns permuted), a view as the plain one is.
        const Tensor m = g.suggest_memory_format() == MemoryFormat::ChannelsLast
                             ? g.permute({0, 2, 3, 1}).view({n, cols})
                             : g.view({n, cols});
        compressed.push_back({m, n, cols, r, Tensor(), Tensor()});
        p_numel += n * r;
        q_numel += cols * r;
      } else {
        whole.push_back(g);
      }
    }
    // P and Q memories: kept across steps with warm start.
    const bool fresh = !o.warm_start || !b.p.defined() || b.p.numel() != p_numel || b.q.numel() != q_numel;
    if (fresh) {
      b.p = empty({p_numel}, buffer.options());
      b.q = empty({q_numel}, buffer.options());
    }
    int64_t pi = 0, qi = 0;
    for (Matrix& mt : compressed) {
      mt.p = b.p.narrow(0, pi, mt.n * mt.r).view({mt.n, mt.r});
      mt.q = b.q.narrow(0, qi, mt.cols * mt.r).view({mt.cols, mt.r});
      pi += mt.n * mt.r;
      qi += mt.cols * mt.r;
      if (fresh)
        mt.q.copy_(st->initial_q ? st->initial_q(bucket.index, mt.n, mt.cols, mt.r)
                                 : randn({mt.cols, mt.r}, buffer.options(), &st->gen_));
      orthogonalize_columns(mt.q, o.orthogonalization_epsilon);
      mt.p.copy_(matmul(mt.m, mt.q));
    }
    std::vector<Tensor> flat_whole;
    for (const Tensor& g : whole) flat_whole.push_back(g.reshape({-1}));
    Tensor uncompressed = flat_whole.empty() ? empty({0}, buffer.options()) : cat(flat_whole);
    lock.unlock();
    // Both at once: neither needs the other.
    std::shared_ptr<Work> w_whole = pg.allreduce(uncompressed, ReduceOp::Sum);
    std::shared_ptr<Work> w_p = pg.allreduce(b.p, ReduceOp::Sum);
    const double scale = average ? 1.0 / pg.size() : 1.0;
    ProcessGroup* group = &pg;
    const bool is_last = bucket.is_last;
    Tensor buf = buffer;
    Tensor q_all = b.q;
    const int index = bucket.index;
    return std::make_shared<DeferredWork>([=, compressed = std::move(compressed), whole = std::move(whole)] {
      NoGradGuard ng;
      w_whole->wait();
      int64_t at = 0;
      for (const Tensor& g : whole) {
        Tensor dst = g;
        dst.copy_((uncompressed.narrow(0, at, g.numel()) * scale).view(g.sizes()));
        at += g.numel();
      }
      w_p->wait();
      for (const Matrix& mt : compressed) {
        orthogonalize_columns(mt.p, o.orthogonalization_epsilon);
        Tensor q = mt.q;
        q.copy_(matmul(mt.m.t(), mt.p));
      }
      group->allreduce(q_all, ReduceOp::Sum)->wait();
      Tensor q_mean = q_all;  // kept averaged, as torch keeps it for the warm start
      q_mean.copy_(q_all * scale);
      for (const Matrix& mt : compressed) {
        Tensor m = mt.m;
        m.copy_(matmul(mt.p, mt.q.t()));
      }
      std::lock_guard<std::mutex> l(st->mu_);
      PowerSGDState::Bucket& bs = st->buckets_[index];
      if (o.use_error_feedback) bs.error = meant - buf;
      if (!o.warm_start) bs.p = bs.q = Tensor();
      if (is_last) ++st->iter_;
    });
  }
};

CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state) {
  EMBER_CHECK(state != nullptr, "powerSGD_hook: the state is null");
  return [state](ProcessGroup& pg, const GradBucket& bucket, bool average) {
    return PowerSGDStep::run(state, pg, bucket, average);
  };
}

}  // namespace ember::distributed
