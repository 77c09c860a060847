// Differentiable collectives on 3 real processes (sizes 3 does not make
// convenient): each rank's input is a known function of its rank, so every
// rank computes the forward value and the gradient of the sum of all ranks'
// losses (loss_r = <w_r, y_r>, w_r also known) in float64 by hand, and
// compares with the collective and autograd's backward through it.
#include "distributed/comm/functional_collectives.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/testing/coords.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using ::ember::testing::error_of;

// Rank r's input of `shape`, element i: a value no two (r, i) share.
std::vector<double> input_of(int r, int64_t n) {
  std::vector<double> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(std::sin(1.3 * r + 0.37 * static_cast<double>(i)) + r);
  return v;
}
// Rank r's loss weights over an output of n elements.
std::vector<double> weights_of(int r, int64_t n) {
  std::vector<double> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(std::cos(0.7 * r + 0.11 * static_cast<double>(i)));
  return v;
}

using ::ember::testing::all_coords;
using ::ember::testing::flat_index;

void expect_close(const Tensor& got, const std::vector<double>& want, const std::string& what) {
  const auto g = got.to(DType::Float64).to_vector();
  WCHECK(g.size() == want.size(), what, ": ", g.size(), " elements, expected ", want.size());
  for (size_t i = 0; i < g.size(); ++i)
    WCHECK(std::abs(g[i] - want[i]) <= 1e-9 * (1 + std::abs(want[i])), what, " element ", i, ": ", g[i], " vs ",
           want[i]);
}

// Runs y = f(x) on this rank's input, loss <w_r, y>, backward; checks y
// and x.grad against the references.
void check(const std::string& what, const Shape& in_shape, const std::function<Tensor(const Tensor&)>& f,
           const std::vector<double>& want_y, const std::vector<double>& want_grad, int rank) {
  int64_t n = 1;
  for (int64_t s : in_shape) n *= s;
  Tensor x = Tensor::from_vector(input_of(rank, n), in_shape, DType::Float64).requires_grad_();
  Tensor y = f(x);
  expect_close(y, want_y, what + " forward");
  Tensor w = Tensor::from_vector(weights_of(rank, y.numel()), y.sizes(), DType::Float64);
  sum(y * w).backward();
  expect_close(x.grad(), want_grad, what + " gradient");
}

EMBER_WORKER(functional) {
  mp::init_world(env);
  auto pg = default_group();
  const int N = env.world_size, me = env.rank;

  {  // all_reduce: y = sum_q x_q (or the mean); dL/dx = sum_r w_r (mean: / N).
    const Shape s = {2, 3};
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      const double scale = op == ReduceOp::Avg ? 1.0 / N : 1.0;
      std::vector<double> y(6, 0.0), g(6, 0.0);
      for (int q = 0; q < N; ++q)
        for (int i = 0; i < 6; ++i) y[i] += input_of(q, 6)[i] * scale, g[i] += weights_of(q, 6)[i] * scale;
      check(
          std::string("all_reduce ") + reduce_op_name(op), s,
          [&](const Tensor& x) { return functional::all_reduce(x, op, pg); }, y, g, me);
    }
  }
  for (int64_t dim : {0, 1, 2}) {  // all_gather: y = cat_q x_q along dim; dL/dx_me = sum_r w_r[block me].
    const Shape s = {2, 3, 2};
    Shape ys = s;
    ys[dim] *= N;
    std::vector<double> y(N * 12), g(12, 0.0);
    for (const Shape& c : all_coords(ys)) {
      const int q = static_cast<int>(c[dim] / s[dim]);
      Shape local = c;
      local[dim] %= s[dim];
      y[flat_index(ys, c)] = input_of(q, 12)[flat_index(s, local)];
      if (q == me)
        for (int r = 0; r < N; ++r) g[flat_index(s, local)] += weights_of(r, N * 12)[flat_index(ys, c)];
    }
    check(
        "all_gather dim " + std::to_string(dim), s, [&](const Tensor& x) { return functional::all_gather(x, dim, pg); },
        y, g, me);
  }
  for (int64_t dim : {0, 1}) {  // reduce_scatter: y_me = sum_q block me of x_q; dL/dx_me[block r] = w_r.
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      const double scale = op == ReduceOp::Avg ? 1.0 / N : 1.0;
      Shape s = {2, 2};
      s[dim] = 2 * N;
      Shape ys = s;
      ys[dim] = 2;
      std::vector<double> y(4, 0.0), g(4 * N, 0.0);
      for (const Shape& c : all_coords(s)) {
        const int r = static_cast<int>(c[dim] / 2);
        Shape local = c;
        local[dim] %= 2;
        if (r == me)
          for (int q = 0; q < N; ++q) y[flat_index(ys, local)] += input_of(q, 4 * N)[flat_index(s, c)] * scale;
        g[flat_index(s, c)] = weights_of(r, 4)[flat_index(ys, local)] * scale;
      }
      check(
          "reduce_scatter dim " + std::to_string(dim) + " " + reduce_op_name(op), s,
          [&](const Tensor& x) { return functional::reduce_scatter(x, dim, op, pg); }, y, g, me);
    }
  }
  // all_to_all: x [N*2, 3] split along 0, concatenated along 1: y_me =
  // cat_j block me of x_j -> [2, 3N]; dL/dx_me[block r] = w_r's block me.
  for (auto [split, concat] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 0}, {0, 0}}) {
    Shape s = {2, 3};
    s[split] *= N;
    Shape block = s;
    block[split] /= N;
    Shape ys = block;
    ys[concat] *= N;
    int64_t n = 1, bn = 1, yn = 1;
    for (int64_t d : s) n *= d;
    for (int64_t d : block) bn *= d;
    for (int64_t d : ys) yn *= d;
    std::vector<double> y(yn), g(n);
    for (const Shape& c : all_coords(ys)) {  // y_me at c: from rank j = c[concat] / block[concat]
      const int j = static_cast<int>(c[concat] / block[concat]);
      Shape b = c;
      b[concat] %= block[concat];
      Shape src = b;  // in x_j: block me along split
      src[split] += me * block[split];
      y[flat_index(ys, c)] = input_of(j, n)[flat_index(s, src)];
    }
    for (const Shape& c : all_coords(s)) {  // x_me at c goes to rank r = c[split] / block[split]
      const int r = static_cast<int>(c[split] / block[split]);
      Shape b = c;
      b[split] %= block[split];
      Shape dst = b;  // in y_r: the block from me along concat
      dst[concat] += me * block[concat];
      g[flat_index(s, c)] = weights_of(r, yn)[flat_index(ys, dst)];
    }
    (void)bn;
    check(
        "all_to_all " + std::to_string(split) + "->" + std::to_string(concat), s,
        [&](const Tensor& x) { return functional::all_to_all(x, split, concat, pg); }, y, g, me);
  }
  {  // all_to_all_v: rank q sends c(q, r) rows of 2 to rank r (some none).
    auto c = [](int q, int r) { return static_cast<int64_t>((q + 2 * r + 1) % 4); };
    std::vector<int64_t> in_splits, out_splits;
    int64_t in_rows = 0, out_rows = 0;
    for (int r = 0; r < N; ++r) in_splits.push_back(c(me, r)), in_rows += c(me, r);
    for (int q = 0; q < N; ++q) out_splits.push_back(c(q, me)), out_rows += c(q, me);
    auto rows_of = [&](int q) {
      int64_t n = 0;
      for (int r = 0; r < N; ++r) n += c(q, r);
      return n;
    };
    std::vector<double> y, g(static_cast<size_t>(in_rows * 2));
    for (int q = 0; q < N; ++q) {  // y_me: from q, its block for me
      int64_t off = 0;
      for (int r = 0; r < me; ++r) off += c(q, r);
      const std::vector<double> xq = input_of(q, rows_of(q) * 2);
      for (int64_t i = 0; i < c(q, me) * 2; ++i) y.push_back(xq[static_cast<size_t>(off * 2 + i)]);
    }
    int64_t at = 0;
    for (int r = 0; r < N; ++r) {  // my rows for r sit in y_r after the blocks of ranks before me
      int64_t off = 0, yr = 0;
      for (int q = 0; q < N; ++q) yr += c(q, r);
      for (int q = 0; q < me; ++q) off += c(q, r);
      const std::vector<double> wr = weights_of(r, yr * 2);
      for (int64_t i = 0; i < c(me, r) * 2; ++i) g[static_cast<size_t>(at++)] = wr[static_cast<size_t>(off * 2 + i)];
    }
    check(
        "all_to_all_v", {in_rows, 2},
        [&](const Tensor& x) { return functional::all_to_all_v(x, out_splits, in_splits, pg); }, y, g, me);
    WCHECK(out_rows == static_cast<int64_t>(y.size() / 2), "all_to_all_v rows");
    const std::string bad = error_of([&] {
      pg->all_to_all_single(zeros({2, 2}), zeros({3, 2}), {1, 1, 0}, {1, 1, 0});
    });
    WCHECK(bad.find("input_split_sizes sums to 2 rows but the tensor is [3,2]") != std::string::npos, bad);
    std::vector<int64_t> self_in(N, 0), self_out(N, 0);
    self_in[me] = 1;  // one row to itself, none expected back
    self_out[(me + 1) % N] = 1;
    const std::string self = error_of([&] { pg->all_to_all_single(zeros({1, 2}), zeros({1, 2}), self_out, self_in); });
    WCHECK(self.find("rows to itself but output_split_sizes") != std::string::npos, self);
  }
  // Errors name the op and the shape, on every rank alike.
  const std::string e = error_of([&] { functional::reduce_scatter(zeros({4, 2}), 0, ReduceOp::Sum, pg); });
  WCHECK(e.find("functional::reduce_scatter: dimension 0 of [4,2] does not split into 3 equal blocks") !=
             std::string::npos,
         e);
  const std::string m = error_of([&] {
    Tensor x = zeros({3}, DType::Float64).requires_grad_();
    functional::all_reduce(x, ReduceOp::Max, pg);
  });
  WCHECK(m.find("no gradient through max") != std::string::npos, m);
  pg->barrier()->wait();
}

TEST(FunctionalCollectives, ForwardAndBackwardOnThreeRanks) { EMBER_EXPECT_RANKS("functional", 3); }

}  // namespace
}  // namespace ember::distributed
