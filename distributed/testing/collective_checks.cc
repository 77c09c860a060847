// Checks of every collective's values shared by the process groups' tests
// (collective_checks.h).
#include "distributed/testing/collective_checks.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/ops.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed::testing {

Tensor make(const Shape& shape, DType dt, const Fn& f, Device device) {
  const int64_t n = shape_numel(shape);
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = f(i);
  return Tensor::from_vector(v, shape, TensorOptions(dt, device));
}

double tol(DType dt) {
  switch (dt) {
    case DType::Float16:
      return 2e-3;
    case DType::BFloat16:
      return 1e-2;
    case DType::Float32:
      return 1e-6;
    case DType::Float64:
      return 1e-12;
    default:
      return 0;
  }
}

void expect_values(const Tensor& t, const Fn& f, const std::string& what) {
  std::vector<double> v = t.cpu().to_vector();
  for (size_t i = 0; i < v.size(); ++i) {
    double e = f(static_cast<int64_t>(i));
    WCHECK(std::fabs(v[i] - e) <= tol(t.dtype()) * std::max(1.0, std::fabs(e)), what, " (", t.dtype(), ", numel ",
           v.size(), "): element ", i, " is ", v[i], ", expected ", e);
  }
}

void check_collectives(ProcessGroup& pg, DType dt, int64_t n) {
  const int r = pg.rank(), ws = pg.size();
  const Device dev = pg.device();
  const auto make = [&](const Shape& shape, DType t, const Fn& f) { return testing::make(shape, t, f, dev); };
  const auto full = [&](const Shape& shape, double v, DType t) { return ember::full(shape, v, TensorOptions(t, dev)); };
  const auto is_int = [](DType t) { return !is_floating(t); };
  const std::string tag = std::string(dtype_name(dt)) + " n=" + std::to_string(n);
  auto sum = [&](int64_t i) {
    double s = 0;
    for (int q = 0; q < ws; ++q) s += val(q, i);
    return s;
  };

  Tensor x = make({n}, dt, [&](int64_t i) { return val(r, i); });
  pg.allreduce(x, ReduceOp::Sum)->wait();
  expect_values(x, sum, "allreduce sum " + tag);

  x = make({n}, dt, [&](int64_t i) { return val(r, i); });
  pg.allreduce(x, ReduceOp::Avg)->wait();
  expect_values(
      x, [&](int64_t i) { return is_int(dt) ? std::floor(sum(i) / ws) : sum(i) / ws; }, "allreduce avg " + tag);

  x = make({n}, dt, [&](int64_t i) { return val(r, i); });
  pg.allreduce(x, ReduceOp::Max)->wait();
  expect_values(
      x, [&](int64_t i) { return val(ws - 1, i); }, "allreduce max " + tag);

  x = make({n}, dt, [&](int64_t i) { return val(r, i); });
  pg.allreduce(x, ReduceOp::Min)->wait();
  expect_values(
      x, [&](int64_t i) { return val(0, i); }, "allreduce min " + tag);

  x = make({n}, dt, [&](int64_t i) { return pval(r, i); });
  pg.allreduce(x, ReduceOp::Product)->wait();
  expect_values(
      x,
      [&](int64_t i) {
        double p = 1;
        for (int q = 0; q < ws; ++q) p *= pval(q, i);
        return p;
      },
      "allreduce product " + tag);

  for (int root = 0; root < ws; ++root) {
    x = make({n}, dt, [&](int64_t i) { return val(r, i); });
    pg.broadcast(x, root)->wait();
    expect_values(
        x, [&](int64_t i) { return val(root, i); }, "broadcast root " + std::to_string(root) + " " + tag);

    x = make({n}, dt, [&](int64_t i) { return val(r, i); });
    pg.reduce(x, root, ReduceOp::Sum)->wait();
    if (r == root)
      expect_values(x, sum, "reduce root " + std::to_string(root) + " " + tag);
    else
      expect_values(
          x, [&](int64_t i) { return val(r, i); }, "reduce leaves non-roots alone " + tag);
  }

  Tensor in = make({n}, dt, [&](int64_t i) { return val(r, i); });
  std::vector<Tensor> outs;
  for (int q = 0; q < ws; ++q) outs.push_back(full({n}, -1.0, dt));
  pg.allgather(outs, in)->wait();
  for (int q = 0; q < ws; ++q)
    expect_values(
        outs[q], [&](int64_t i) { return val(q, i); }, "allgather outputs[" + std::to_string(q) + "] " + tag);

  Tensor flat = full({ws * n}, -1.0, dt);
  pg.allgather_into_tensor(flat, in)->wait();
  expect_values(
      flat, [&](int64_t j) { return val(static_cast<int>(j / std::max<int64_t>(n, 1)), j % std::max<int64_t>(n, 1)); },
      "allgather_into_tensor " + tag);

  Tensor big = make({ws * n}, dt, [&](int64_t j) { return val(r, j); });
  Tensor out = full({n}, -1.0, dt);
  pg.reduce_scatter_tensor(out, big, ReduceOp::Sum)->wait();
  expect_values(
      out, [&](int64_t i) { return sum(r * n + i); }, "reduce_scatter_tensor sum " + tag);
  expect_values(
      big, [&](int64_t j) { return val(r, j); }, "reduce_scatter_tensor leaves its input alone " + tag);
  pg.reduce_scatter_tensor(out, big, ReduceOp::Max)->wait();
  expect_values(
      out, [&](int64_t i) { return val(ws - 1, r * n + i); }, "reduce_scatter_tensor max " + tag);
  // The variant that may reduce in its input (FSDP's): the same result.
  Tensor scratch = make({ws * n}, dt, [&](int64_t j) { return val(r, j); });
  Tensor out2 = full({n}, -1.0, dt);
  pg.reduce_scatter_tensor_consuming_input(out2, scratch, ReduceOp::Sum)->wait();
  expect_values(
      out2, [&](int64_t i) { return sum(r * n + i); }, "reduce_scatter_tensor_consuming_input sum " + tag);

  Tensor send = make({ws * n}, dt, [&](int64_t j) {
    return a2a(r, static_cast<int>(j / std::max<int64_t>(n, 1)), j % std::max<int64_t>(n, 1));
  });
  Tensor recv = full({ws * n}, -1.0, dt);
  pg.all_to_all_single(recv, send)->wait();
  expect_values(
      recv,
      [&](int64_t j) { return a2a(static_cast<int>(j / std::max<int64_t>(n, 1)), r, j % std::max<int64_t>(n, 1)); },
      "all_to_all_single " + tag);

  pg.barrier()->wait();
}

}  // namespace ember::distributed::testing
