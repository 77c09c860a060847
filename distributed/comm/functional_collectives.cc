// Differentiable collectives (functional_collectives.h): each forward is a
// process-group collective on contiguous blocks, each backward the
// matching collective through the same functions, so double backward and
// nesting need nothing extra.
#include "distributed/comm/functional_collectives.h"

#include <string>
#include <vector>

#include "core/autograd_hook.h"
#include "core/exception.h"
#include "core/ops.h"

namespace ember::distributed::functional {

namespace {

int64_t wrap_dim(int64_t dim, const Tensor& x, const char* op) {
  const int64_t n = x.dim();
  const int64_t d = dim < 0 ? dim + n : dim;
  EMBER_CHECK(d >= 0 && d < n, "functional::", op, ": dimension ", dim, " of a tensor of shape ", shape_str(x.sizes()));
  return d;
}

void check_args(const Tensor& x, const std::shared_ptr<ProcessGroup>& pg, const char* op) {
  EMBER_CHECK(pg != nullptr, "functional::", op, ": null process group");
  EMBER_CHECK(x.defined(), "functional::", op, ": the input is undefined");
}

// x's blocks along `dim` (size() of them, equal), each contiguous, one
// after another in one flat tensor: the layout the flat collectives take.
// The shape of one of x's n equal blocks along `dim`; an error naming the op
// when they are not equal.
Shape block_shape(const Tensor& x, int64_t dim, int n, const char* op) {
  Shape block = x.sizes();
  EMBER_CHECK(block[dim] % n == 0, "functional::", op, ": dimension ", dim, " of ", shape_str(x.sizes()),
              " does not split into ", n, " equal blocks");
  block[dim] /= n;
  return block;
}

// The inverse: a flat tensor of n blocks of `block` shape, concatenated
// along `dim`.
Tensor cat_blocks(const Tensor& flat, const Shape& block, int64_t dim, int n) {
  int64_t numel = 1;
  for (int64_t s : block) numel *= s;
  if (dim == 0) {
    Shape whole = block;
    whole[0] *= n;
    return flat.view(whole);
  }
  std::vector<Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(flat.narrow(0, r * numel, numel).view(block));
  return cat(parts, dim);
}

}  // namespace

Tensor detail::blocks_along(const Tensor& x, int64_t dim, int n) {
  const int64_t len = x.size(dim);
  if (dim == 0) return x.contiguous().view({-1});
  std::vector<Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(x.narrow(dim, r * (len / n), len / n).contiguous().view({-1}));
  return cat(parts, 0);
}

Tensor all_reduce(const Tensor& x, ReduceOp op, const std::shared_ptr<ProcessGroup>& pg) {
  check_args(x, pg, "all_reduce");
  return differentiable(
      "all_reduce", {x},
      [&] {
        Tensor y = x.contiguous().clone();
        pg->allreduce(y, op)->wait();
        return y;
      },
      [&](const Tensor&) {
        EMBER_CHECK(op == ReduceOp::Sum || op == ReduceOp::Avg, "functional::all_reduce: no gradient through ",
                    reduce_op_name(op), " (only sum and avg are differentiable)");
        std::shared_ptr<ProcessGroup> g = pg;
        BackwardFn fn = [g, op](const Tensor& grad) { return std::vector<Tensor>{all_reduce(grad, op, g)}; };
        return Recorded{std::move(fn), {}, true};
      });
}

Tensor all_gather(const Tensor& x, int64_t dim_in, const std::shared_ptr<ProcessGroup>& pg) {
  check_args(x, pg, "all_gather");
  const int64_t dim = wrap_dim(dim_in, x, "all_gather");
  return differentiable(
      "all_gather", {x},
      [&] {
        Tensor in = x.contiguous();
        Tensor flat = Tensor::empty({in.numel() * pg->size()}, in.options());
        pg->allgather_into_tensor(flat, in)->wait();
        return cat_blocks(flat, in.sizes(), dim, pg->size());
      },
      [&](const Tensor&) {
        std::shared_ptr<ProcessGroup> g = pg;
        BackwardFn fn = [g, dim](const Tensor& grad) {
          return std::vector<Tensor>{reduce_scatter(grad, dim, ReduceOp::Sum, g)};
        };
        return Recorded{std::move(fn), {}, true};
      });
}

Tensor reduce_scatter(const Tensor& x, int64_t dim_in, ReduceOp op, const std::shared_ptr<ProcessGroup>& pg) {
  check_args(x, pg, "reduce_scatter");
  const int64_t dim = wrap_dim(dim_in, x, "reduce_scatter");
  EMBER_CHECK(op == ReduceOp::Sum || op == ReduceOp::Avg, "functional::reduce_scatter: ", reduce_op_name(op),
              " is not differentiable; use sum or avg");
  const int n = pg->size();
  const Shape block = block_shape(x, dim, n, "reduce_scatter");
  return differentiable(
      "reduce_scatter", {x},
      [&] {
        Tensor in = detail::blocks_along(x, dim, n);
        Tensor out = Tensor::empty(block, x.options());
        pg->reduce_scatter_tensor(out, in, op)->wait();
        return out;
      },
      [&](const Tensor&) {
        std::shared_ptr<ProcessGroup> g = pg;
        BackwardFn fn = [g, dim, op, n](const Tensor& grad) {
          Tensor whole = all_gather(grad, dim, g);
          return std::vector<Tensor>{op == ReduceOp::Avg ? whole * (1.0 / n) : whole};
        };
        return Recorded{std::move(fn), {}, true};
      });
}

Tensor all_to_all(const Tensor& x, int64_t split_in, int64_t concat_in, const std::shared_ptr<ProcessGroup>& pg) {
  check_args(x, pg, "all_to_all");
  const int64_t split = wrap_dim(split_in, x, "all_to_all"), concat = wrap_dim(concat_in, x, "all_to_all");
  const int n = pg->size();
  const Shape block = block_shape(x, split, n, "all_to_all");
  return differentiable(
      "all_to_all", {x},
      [&] {
        Tensor in = detail::blocks_along(x, split, n);
        Tensor out = Tensor::empty({in.numel()}, x.options());
        pg->all_to_all_single(out, in)->wait();
        return cat_blocks(out, block, concat, n);
      },
      [&](const Tensor&) {
        std::shared_ptr<ProcessGroup> g = pg;
        BackwardFn fn = [g, split, concat](const Tensor& grad) {
          return std::vector<Tensor>{all_to_all(grad, concat, split, g)};
        };
        return Recorded{std::move(fn), {}, true};
      });
}

Tensor all_to_all_v(const Tensor& x, const std::vector<int64_t>& output_splits,
                    const std::vector<int64_t>& input_splits, const std::shared_ptr<ProcessGroup>& pg) {
  check_args(x, pg, "all_to_all_v");
  EMBER_CHECK(x.dim() >= 1, "functional::all_to_all_v: a tensor of shape ", shape_str(x.sizes()), " has no rows");
  int64_t rows = 0;
  for (const auto* splits : {&output_splits, &input_splits})
    for (int64_t s : *splits)
      EMBER_CHECK(s >= 0, "functional::all_to_all_v: a split of ", s, " rows (",
                  splits == &output_splits ? "output" : "input", "_splits)");
  for (int64_t s : output_splits) rows += s;
  Shape out_shape = x.sizes();
  out_shape[0] = rows;
  return differentiable(
      "all_to_all_v", {x},
      [&] {
        Tensor out = Tensor::empty(out_shape, x.options());
        pg->all_to_all_single(out, x, output_splits, input_splits)->wait();
        return out;
      },
      [&](const Tensor&) {
        std::shared_ptr<ProcessGroup> g = pg;
        BackwardFn fn = [g, output_splits, input_splits](const Tensor& grad) {
          return std::vector<Tensor>{all_to_all_v(grad, input_splits, output_splits, g)};
        };
        return Recorded{std::move(fn), {}, true};
      });
}

}  // namespace ember::distributed::functional
