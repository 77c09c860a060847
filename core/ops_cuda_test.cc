// The cross-backend op test: every op on CUDA against the CPU kernel, on
// random inputs, for every float dtype, including broadcasting and strided
// views. Skips (with the reason) when no GPU is present.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

#include "core/ops.h"
#include "core/ops_nn.h"
#include "core/profiler.h"
#include "core/stream.h"

namespace ember {
namespace {

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  }
};

// Tolerances: one 16-bit rounding, float32's accumulation (docs/design.md,
// Note [numerics]).
double tol(DType t) { return t == DType::Float16 ? 2e-3 : t == DType::BFloat16 ? 1.6e-2 : t == DType::Float32 ? 2e-5 : 1e-11; }
const std::vector<DType> kTypes = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};

void expect_same(const Tensor& cpu, const Tensor& gpu, double t, const std::string& what) {
  ASSERT_TRUE(gpu.is_cuda()) << what;
  ASSERT_EQ(cpu.sizes(), gpu.sizes()) << what;
  ASSERT_EQ(cpu.dtype(), gpu.dtype()) << what;
  EXPECT_TRUE(allclose(gpu.cpu(), cpu, t, t)) << what << "\ncpu: " << cpu << "\ncuda: " << gpu.cpu();
}

using Unary = std::function<Tensor(const Tensor&)>;
using Binary = std::function<Tensor(const Tensor&, const Tensor&)>;

TEST_F(CudaOps, UnaryMatchesCpu) {
  std::vector<std::pair<std::string, Unary>> ops = {
      {"neg", [](auto& x) { return neg(x); }}, {"abs", [](auto& x) { return abs(x); }},
      {"exp", [](auto& x) { return exp(x); }}, {"log", [](auto& x) { return log(abs(x) + 0.1); }},
      {"sqrt", [](auto& x) { return sqrt(abs(x)); }}, {"rsqrt", [](auto& x) { return rsqrt(abs(x) + 0.1); }},
      {"relu", [](auto& x) { return relu(x); }}, {"sigmoid", [](auto& x) { return sigmoid(x); }},
      {"tanh", [](auto& x) { return tanh(x); }}, {"gelu", [](auto& x) { return gelu(x); }},
      {"gelu_tanh", [](auto& x) { return gelu(x, true); }}, {"pow", [](auto& x) { return pow(x, 3.0); }},
      {"clamp", [](auto& x) { return clamp(x, -0.5, 0.5); }}, {"cast", [](auto& x) { return x.to(DType::Int32); }},
      {"softmax0", [](auto& x) { return softmax(x, 0); }}, {"log_softmax1", [](auto& x) { return log_softmax(x, -1); }},
      {"sum", [](auto& x) { return sum(x, {1}); }}, {"sum_all", [](auto& x) { return sum(x); }},
      {"mean0", [](auto& x) { return mean(x, {0}, true); }}, {"max", [](auto& x) { return max(x, {1}); }},
      {"min_all", [](auto& x) { return min(x); }}, {"var", [](auto& x) { return var(x, {0}); }},
      {"argmax", [](auto& x) { return argmax(x, 1); }}, {"argmin", [](auto& x) { return argmin(x); }},
  };
  manual_seed(11);
  for (DType dt : kTypes) {
    Tensor base = randn({37, 129}, DType::Float64).to(dt), base_g = base.cuda();
    // The views are taken on the device too: x.cuda() of a view would be a
    // contiguous copy, and the strided kernels (unary_strided_kernel, the
    // reductions' strided path) would never run -- which the emulated
    // coverage count showed they did not, before this.
    const std::vector<std::function<Tensor(const Tensor&)>> views = {
        [](const Tensor& t) { return t; }, [](const Tensor& t) { return t.t(); },
        [](const Tensor& t) { return t.slice(1, 3, 100, 3); }};
    for (const auto& view : views) {
      Tensor x = view(base), xg = view(base_g);
      for (auto& [name, op] : ops) {
        double t = tol(dt) * (name.find("sum") != std::string::npos || name == "var" ? 40 : 4);
        expect_same(op(x), op(xg), t, name + " " + dtype_name(dt) + " " + shape_str(x.sizes()));
      }
    }
  }
}

// Long rows: softmax_rows_kernel and reduce_rows_kernel give a row several
// warps (up to 1024 threads) once it is longer than 32 threads x 4 vectors,
// and combine the warps through shared memory behind a __syncthreads. The
// 129-wide rows above fit one warp; a dropped barrier there survived the
// mutation check (tools/cuda_mutants.py) until these shapes were added.
// Each also one element into its buffer, which no other test gave softmax.
// min and argmin too: their partial sums' pass (reduce_partials_kernel,
// rows split over blocks) ran for no test.
TEST_F(CudaOps, RowKernelsSpanningSeveralWarpsMatchCpu) {
  std::vector<std::pair<std::string, Unary>> ops = {
      {"softmax", [](auto& x) { return softmax(x, -1); }}, {"log_softmax", [](auto& x) { return log_softmax(x, -1); }},
      {"sum", [](auto& x) { return sum(x, {1}); }},        {"max", [](auto& x) { return max(x, {1}); }},
      {"argmax", [](auto& x) { return argmax(x, 1); }},    {"min", [](auto& x) { return min(x, {1}); }},
      {"argmin", [](auto& x) { return argmin(x, 1); }},
  };
  manual_seed(13);
  for (DType dt : kTypes)
    for (const Shape& shape : {Shape{5, 700}, Shape{3, 3001}, Shape{2, 40000}}) {
      Tensor x = randn(shape, DType::Float64).to(dt), xg = x.cuda();
      // The same rows one element into their buffer, as a slice of a batch
      // lies: not aligned for the vector loads (softmax_rows_kernel<T, 1>).
      Tensor xo = Tensor::empty({x.numel() + 1}, xg.options()).slice(0, 1, x.numel() + 1).view(shape);
      xo.copy_(xg);
      for (auto& [name, op] : ops) {
        const double t = tol(dt) * (name == "sum" ? 200 : 4);
        expect_same(op(x), op(xg), t, name + " " + dtype_name(dt) + " " + shape_str(shape));
        expect_same(op(x), op(xo), t, name + " " + dtype_name(dt) + " " + shape_str(shape) + " one element in");
      }
    }
}

TEST_F(CudaOps, BinaryAndWhereMatchCpuWithBroadcast) {
  std::vector<std::pair<std::string, Binary>> ops = {
      {"add", [](auto& a, auto& b) { return add(a, b, 0.5); }}, {"sub", [](auto& a, auto& b) { return a - b; }},
      {"mul", [](auto& a, auto& b) { return a * b; }}, {"div", [](auto& a, auto& b) { return a / (abs(b) + 1.0); }},
      {"pow", [](auto& a, auto& b) { return pow(abs(a), b); }}, {"maximum", [](auto& a, auto& b) { return maximum(a, b); }},
      {"minimum", [](auto& a, auto& b) { return minimum(a, b); }}, {"lt", [](auto& a, auto& b) { return lt(a, b); }},
      {"eq", [](auto& a, auto& b) { return eq(a, b); }}, {"ge", [](auto& a, auto& b) { return ge(a, b); }},
      {"where", [](auto& a, auto& b) { return where(gt(a, b), a, b); }},
  };
  manual_seed(12);
  std::vector<std::pair<Shape, Shape>> shapes = {{{64, 33}, {64, 33}}, {{64, 33}, {33}}, {{8, 1, 5}, {7, 1}}, {{1000}, {}}};
  for (DType dt : kTypes)
    for (auto& [sa, sb] : shapes) {
      Tensor a = randn(sa, DType::Float64).to(dt), b = randn(sb, DType::Float64).to(dt);
      for (auto& [name, op] : ops)
        expect_same(op(a, b), op(a.cuda(), b.cuda()), tol(dt) * 4, name + " " + dtype_name(dt) + " " + shape_str(sa));
    }
  // CPU scalars combine with CUDA tensors.
  Tensor g = ones({3}, cuda_device());
  expect_same(ones({3}) * 2.5, g * 2.5, 0, "tensor * scalar");
}

// Errors kernels find (device.h): raised at the next synchronisation with
// the op's name and the bad value, the slot cleared afterwards; at the op
// itself under sync checks; and none costs a synchronisation at the op.
TEST_F(CudaOps, DeviceErrorsRaiseAtTheNextSynchronisation) {
  Tensor a = randn({4, 6}).cuda();
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  Tensor out;
  const std::string m1 = message([&] {
    out = gather(a, 1, Tensor::from_vector({0, 7}, {1, 2}, DType::Int64).cuda());  // no throw here
    out.cpu();
  });
  EXPECT_NE(m1.find("gather: index 7 is out of bounds for dimension 1 with size 6"), std::string::npos) << m1;
  EXPECT_NE(m1.find("EMBER_SYNC_CHECKS=1"), std::string::npos) << m1;
  // The slot is clear again: a good op and a synchronisation raise nothing.
  EXPECT_EQ(message([&] { index_select(a, 0, Tensor::from_vector({3}, {1}, DType::Int64).cuda()).cpu(); }), "no error");
  // check_index_range (cross-entropy targets, embeddings) and cuda_synchronize.
  const std::string m2 = message([&] {
    check_index_range(Tensor::from_vector({1, 2, -3}, {3}, DType::Int64).cuda(), 0, 5, "cross_entropy");
    cuda_synchronize();
  });
  EXPECT_NE(m2.find("cross_entropy: value -3 is out of the range [0, 5)"), std::string::npos) << m2;
  // The first error wins; later ones are dropped with it.
  const std::string m3 = message([&] {
    check_index_range(Tensor::from_vector({9}, {1}, DType::Int32).cuda(), 0, 5, "Embedding");
    check_index_range(Tensor::from_vector({8}, {1}, DType::Int64).cuda(), 0, 5, "cross_entropy");
    sum(a).item();
  });
  EXPECT_NE(m3.find("Embedding: value 9"), std::string::npos) << m3;
  EXPECT_EQ(message([&] { sum(a).item(); }), "no error");
  // one_hot with its num_classes given checks on the device too (no wait:
  // the vocabulary-parallel loss's backward runs it inside captured steps).
  Tensor oh;
  EXPECT_NO_THROW(oh = one_hot(Tensor::from_vector({2, 6, 0}, {3}, DType::Int64).cuda(), 6));
  const std::string m6 = message([&] { oh.cpu(); });
  EXPECT_NE(m6.find("one_hot: value 6 is out of the range [0, 6)"), std::string::npos) << m6;
  // cross_entropy's forward kernel checks its targets itself; ignore_index
  // passes, anything else out of [0, C) is named at the synchronisation.
  const Tensor logits = Tensor::from_vector(std::vector<double>(15, 0.5), {3, 5}, DType::Float32).cuda();
  const std::string m5 = message([&] {
    cross_entropy_rows(logits, Tensor::from_vector({1, -100, 5}, {3}, DType::Int64).cuda());
    cuda_synchronize();
  });
  EXPECT_NE(m5.find("cross_entropy: value 5 is out of the range [0, 5)"), std::string::npos) << m5;
  EXPECT_EQ(message([&] {
              cross_entropy_rows(logits, Tensor::from_vector({1, -100, 4}, {3}, DType::Int32).cuda());
              cuda_synchronize();
            }),
            "no error");
  // Sync checks: the error comes from the op.
  set_cuda_sync_checks(true);
  const std::string m4 = message([&] { index_select(a, 1, Tensor::from_vector({-7}, {1}, DType::Int64).cuda()); });
  set_cuda_sync_checks(false);
  EXPECT_NE(m4.find("index_select: index -7 is out of bounds for dimension 1 with size 6"), std::string::npos) << m4;
  EXPECT_EQ(m4.find("next synchronisation"), std::string::npos) << m4;
}

// Ops launched under a StreamGuard run on the side stream; an event
// recorded there and blocked on by the default stream orders the reads
// after them; the guard restores the previous stream.
TEST_F(CudaOps, StreamsAndEventsOrderWork) {
  EXPECT_EQ(Stream::current(0), (Stream{0, nullptr}));
  auto side = new_stream(0);
  ASSERT_NE(side->handle, nullptr);
  Tensor x = Tensor::from_vector({1, 2, 3, 4}, {4}).to(cuda_device(0));
  Event done(0);
  Tensor y;
  {
    StreamGuard g(*side);
    EXPECT_EQ(Stream::current(0), *side);
    y = x * 3.0 + 1.0;
    done.record(*side);
  }
  EXPECT_EQ(Stream::current(0), (Stream{0, nullptr}));
  done.block(Stream::current(0));
  EXPECT_EQ(y.cpu().to_vector(), (std::vector<double>{4, 7, 10, 13}));
  done.synchronize();
  EXPECT_TRUE(done.query());
  Event never(0);
  EXPECT_TRUE(never.query());  // nothing recorded: nothing to wait for
  EXPECT_THROW(done.record(Stream{1, nullptr}), Error);
}

// The list ops' kernels against the CPU's: several chunks per tensor, an
// empty tensor, both dtypes, a factor on the device; and more tensors than
// one launch's parameter table holds (1024: the later slices' chunks and
// sums counted from their own first tensor), empty tensors at a slice's
// edges.
TEST_F(CudaOps, ForeachMatchesCpu) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    std::vector<Tensor> cpu, gpu;
    uint64_t seed = 40;
    for (int64_t n : {int64_t{40000}, int64_t{0}, int64_t{3}, int64_t{16384}}) {
      Generator g(seed++);
      cpu.push_back(randn({n}, {dt}, &g));
      gpu.push_back(cpu.back().cuda());
    }
    expect_same(foreach_sum_squares(cpu), foreach_sum_squares(gpu), 1e-12, "foreach_sum_squares");
    foreach_mul_(cpu, -1.5);
    foreach_mul_(gpu, -1.5);
    for (size_t i = 0; i < cpu.size(); ++i) expect_same(cpu[i], gpu[i], 0, "foreach_mul_");
    foreach_mul_(cpu, full({}, 0.3, {DType::Float32}));
    foreach_mul_(gpu, full({}, 0.3, {DType::Float32}).cuda());
    for (size_t i = 0; i < cpu.size(); ++i) expect_same(cpu[i], gpu[i], 0, "foreach_mul_ by a tensor");
  }
  std::vector<Tensor> cpu, gpu;
  Generator g(41);
  for (int i = 0; i < 2500; ++i) {
    const int64_t n = i == 1023 || i == 1024 || i == 2047 ? 0 : i % 700 == 5 ? 20000 : 1 + i % 37;
    cpu.push_back(randn({n}, {DType::Float32}, &g));
    gpu.push_back(cpu.back().cuda());
  }
  expect_same(foreach_sum_squares(cpu), foreach_sum_squares(gpu), 1e-12, "foreach_sum_squares over 2500 tensors");
  foreach_mul_(cpu, 2.5);
  foreach_mul_(gpu, full({}, 2.5, {DType::Float64}).cuda());
  for (size_t i = 0; i < cpu.size(); ++i) expect_same(cpu[i], gpu[i], 0, "foreach_mul_ over 2500 tensors");
}

// GPU time per op: each op's event pair brackets its kernels, so a 512^3
// matmul takes more device time than a one-element add (under the emulation
// too, where device time is the time the queue takes to run); a user range
// gets none; the table and the trace show it; cuda_time = false records none.
TEST_F(CudaOps, ProfilerRecordsGpuTimePerOp) {
  Tensor a = ones({512, 512}).cuda(), b = ones({512, 512}).cuda(), s = ones({1}).cuda();
  cuda_synchronize();
  profiler::start();
  {
    EMBER_PROFILE_RANGE("outer");
    Tensor c = matmul(a, b);
    cuda_synchronize();  // then the host dawdles: the stream sits empty before the add
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    Tensor d = s + s;
  }
  profiler::stop();
  const std::vector<profiler::Event> ev = profiler::events();
  const profiler::Event *mm = nullptr, *add = nullptr, *outer = nullptr;
  for (const profiler::Event& e : ev) {
    if (e.name == "matmul" && e.depth == 1) mm = &e;
    if (e.name == "add" && e.depth == 1) add = &e;
    if (e.name == "outer") outer = &e;
  }
  ASSERT_TRUE(mm && add && outer) << profiler::summary_table(ev);
  EXPECT_EQ(outer->cuda_ns, -1);
  EXPECT_GE(add->cuda_ns, 0);
  EXPECT_GT(mm->cuda_ns, add->cuda_ns) << profiler::summary_table(ev);
  EXPECT_LE(mm->cuda_self_ns, mm->cuda_ns);
  EXPECT_GE(mm->cuda_self_ns, 0);
  EXPECT_NE(profiler::summary_table(ev).find("CUDA self"), std::string::npos);
  // The GPU's idle time before an op: none before the first; before the add,
  // the host's 30 ms on a GPU (the emulation's clock runs only while the
  // queue works, so there it is just >= 0).
  EXPECT_EQ(mm->cuda_gap_ns, -1);
  EXPECT_GE(add->cuda_gap_ns, 0);
  if (cuda_device_name() != "CUDA emulation") {
    EXPECT_GT(add->cuda_gap_ns, 20'000'000) << "the host's 30 ms wait is not GPU idle time";
  }
  EXPECT_NE(profiler::chrome_trace(ev).find("\"cuda_gap_us\":"), std::string::npos);

  // Self time skips scopes without GPU time: an op scope around a user range
  // around the matmul keeps little of its own; another thread's ops get none.
  profiler::start();
  {
    profiler::Scope op(profiler::Kind::Op, "wrapper");
    EMBER_PROFILE_RANGE("between");
    Tensor c = matmul(a, b);
  }
  std::thread([&] { Tensor d = s + s; }).join();
  profiler::stop();
  const std::vector<profiler::Event> ev2 = profiler::events();
  const profiler::Event *wrapper = nullptr, *inner = nullptr, *other = nullptr;
  for (const profiler::Event& e : ev2) {
    if (e.name == "wrapper") wrapper = &e;
    if (e.name == "matmul" && e.depth == 2) inner = &e;
    if (e.name == "add") other = &e;
  }
  ASSERT_TRUE(wrapper && inner && other) << profiler::summary_table(ev2);
  EXPECT_GE(wrapper->cuda_ns, inner->cuda_ns);
  EXPECT_LT(wrapper->cuda_self_ns, inner->cuda_ns) << profiler::summary_table(ev2);
  EXPECT_EQ(other->cuda_ns, -1);
  EXPECT_EQ(inner->cuda_gap_ns, -1) << "a nested op's gap belongs to its parent";
  EXPECT_NE(profiler::chrome_trace(ev).find("\"cuda_us\":"), std::string::npos);

  profiler::Options no_cuda;
  no_cuda.cuda_time = false;
  profiler::start(no_cuda);
  { Tensor c = matmul(a, b); }
  profiler::stop();
  for (const profiler::Event& e : profiler::events()) EXPECT_EQ(e.cuda_ns, -1) << e.name;
  EXPECT_EQ(profiler::summary_table(profiler::events()).find("CUDA self"), std::string::npos);
}

TEST_F(CudaOps, MatmulMatchesCpu) {
  manual_seed(13);
  for (DType dt : kTypes) {
    Tensor a = randn({65, 130}, DType::Float64).to(dt), b = randn({130, 47}, DType::Float64).to(dt);
    double t = tol(dt) * 50;
    expect_same(mm(a, b), mm(a.cuda(), b.cuda()), t, std::string("mm ") + dtype_name(dt));
    expect_same(mm(b.t(), a.t()), mm(b.cuda().t(), a.cuda().t()), t, std::string("mm^T ") + dtype_name(dt));
    Tensor x = randn({3, 5, 130}, DType::Float64).to(dt), w = randn({7, 130}, DType::Float64).to(dt);
    expect_same(linear(x, w), linear(x.cuda(), w.cuda()), t, std::string("linear ") + dtype_name(dt));
    Tensor p = randn({4, 9, 16}, DType::Float64).to(dt), q = randn({4, 16, 5}, DType::Float64).to(dt);
    expect_same(bmm(p, q), bmm(p.cuda(), q.cuda()), t, std::string("bmm ") + dtype_name(dt));
    expect_same(matmul(p, q.select(0, 0)), matmul(p.cuda(), q.cuda().select(0, 0)), t, "matmul broadcast");
    // An empty inner dimension: the output is zeros (the op layer fills it
    // before cuBLAS; fresh device memory is garbage, NaN bytes under the
    // emulator, so an unwritten element would show).
    expect_same(mm(zeros({4, 0}, dt), zeros({0, 5}, dt)), mm(zeros({4, 0}, {dt, cuda_device()}),
                zeros({0, 5}, {dt, cuda_device()})), 0, std::string("mm k=0 ") + dtype_name(dt));
    expect_same(bmm(zeros({3, 4, 0}, dt), zeros({3, 0, 5}, dt)),
                bmm(zeros({3, 4, 0}, {dt, cuda_device()}), zeros({3, 0, 5}, {dt, cuda_device()})), 0,
                std::string("bmm k=0 ") + dtype_name(dt));
  }
}

TEST_F(CudaOps, JoinIndexCopyRandom) {
  manual_seed(14);
  Tensor a = randn({4, 6}), b = randn({2, 6});
  expect_same(cat({a, b}, 0), cat({a.cuda(), b.cuda()}, 0), 0, "cat");
  expect_same(stack({a, a}, 2), stack({a.cuda(), a.cuda()}, 2), 0, "stack");
  Tensor idx = Tensor::from_vector({5, 0, 3, 3}, {4}, DType::Int64);
  expect_same(index_select(a, 1, idx), index_select(a.cuda(), 1, idx.cuda()), 0, "index_select");
  Tensor gi = randint(0, 6, {4, 3}, DType::Int64);
  expect_same(gather(a, 1, gi), gather(a.cuda(), 1, gi.cuda()), 0, "gather");
  // A bad index is found on the device (no synchronisation at the op) and
  // raised at the next synchronisation; test_errors below covers the rest.
  Tensor bad = index_select(a.cuda(), 0, Tensor::from_vector({9}, {1}, DType::Int64).cuda());
  EXPECT_THROW(bad.cpu(), Error);
  expect_same(one_hot(gi, 6), one_hot(gi.cuda(), 6), 0, "one_hot");
  expect_same(arange(0, 10, 0.5), arange(0, 10, 0.5, cuda_device()), 0, "arange");
  // fill_ of a strided view (fill_strided_kernel) leaves the gaps alone,
  // in each float dtype (16-bit ones ran for no test).
  for (DType dt : kTypes) {
    Tensor z = zeros({8, 9}, dt), zg = z.cuda();
    z.slice(1, 1, 8, 2).fill_(3.5);
    zg.slice(1, 1, 8, 2).fill_(3.5);
    expect_same(z, zg, 0, std::string("strided fill_ ") + dtype_name(dt));
  }
  // Rows of 32+ copy units (up to 16 bytes each) take index_select_rows_kernel,
  // shorter ones the flat kernel.
  // Every copy unit a row's bytes allow (index_select_rows_kernel's 16, 8,
  // 4, 2 and 1-byte words; only the 16-byte one ran before, as
  // tools/emu_coverage.py --instances showed): 200 and 160 float32s, 82 and
  // 81 of them, 81 bfloat16s, 81 bytes.
  Tensor rows = Tensor::from_vector({6, 0, 3, 3}, {4}, DType::Int64);
  for (const auto& [cols, dt] : std::vector<std::pair<int64_t, DType>>{{200, DType::Float32},
                                                                       {160, DType::Float32},
                                                                       {82, DType::Float32},
                                                                       {81, DType::Float32},
                                                                       {81, DType::BFloat16},
                                                                       {81, DType::UInt8}}) {
    Tensor wide = abs(randn({7, cols}) * 50.0).to(dt);
    expect_same(index_select(wide, 0, rows), index_select(wide.cuda(), 0, rows.cuda()), 0,
                "index_select rows of " + std::to_string(cols) + " " + dtype_name(dt));
  }
  // Strided copies and casts in both directions.
  Tensor big = randn({33, 65});
  expect_same(big.t().contiguous(), big.cuda().t().contiguous(), 0, "transpose copy");
  EXPECT_TRUE(allclose(big.cuda().to(DType::Float16).cpu(), big.to(DType::Float16), 0, 0));
  // A channels-last tensor moves between devices as it is (to() keeps the
  // layout; the staging buffers are laid out alike): the same values, still
  // channels-last, and no transposing copy on the device, in either direction
  // or through a cast.
  Tensor cl = randn({2, 5, 3, 4}).contiguous(MemoryFormat::ChannelsLast);
  const uint64_t before = cuda_layout_copies();
  Tensor on = cl.cuda(), back = on.cpu(), half = on.to(DType::BFloat16);
  EXPECT_EQ(cuda_layout_copies() - before, 0u);
  for (const Tensor& t : {on, back, half})
    EXPECT_TRUE(t.is_contiguous(MemoryFormat::ChannelsLast) && !t.is_contiguous());
  EXPECT_EQ(back.to_vector(), cl.to_vector());
  EXPECT_TRUE(allclose(half.cpu(), cl.to(DType::BFloat16), 0, 0));
  // Into a contiguous destination, the transposes are the destination's.
  Tensor plain = zeros({2, 5, 3, 4});
  plain.copy_(on);
  EXPECT_EQ(plain.to_vector(), cl.to_vector());
  // Same seed, same values on both devices (Philox on both).
  for (DType dt : kTypes) {
    Generator g1(99), g2(99);
    expect_same(rand({1001}, dt, &g1), rand({1001}, {dt, cuda_device()}, &g2), 0, "rand");
    expect_same(randn({1001}, dt, &g1), randn({1001}, {dt, cuda_device()}, &g2), 1e-6, "randn");
    expect_same(bernoulli({1001}, 0.3, dt, &g1), bernoulli({1001}, 0.3, {dt, cuda_device()}, &g2), 0, "bernoulli");
  }
}

// EMBER_NO_CUDA_MEMORY_CACHING=1 (set for the emulated tests under ASan):
// each tensor is its own exact-size cudaMalloc, returned at once.
TEST_F(CudaOps, UncachedAllocatorFreesAtOnce) {
  const char* v = std::getenv("EMBER_NO_CUDA_MEMORY_CACHING");
  if (v == nullptr || std::string(v) == "0") GTEST_SKIP() << "caching is on";
  Allocator* alloc = cuda_allocator(0);
  AllocatorStats s0 = alloc->stats();
  { Tensor t = empty({1000}, cuda_device()); }
  { Tensor t = empty({1000}, cuda_device()); }
  AllocatorStats s1 = alloc->stats();
  EXPECT_EQ(s1.num_device_allocs, s0.num_device_allocs + 2);  // no reuse
  EXPECT_EQ(s1.reserved, s0.reserved);                        // nothing kept
  EXPECT_EQ(s1.allocated, s0.allocated);
}

TEST_F(CudaOps, CachingAllocatorReusesBlocks) {
  const char* v = std::getenv("EMBER_NO_CUDA_MEMORY_CACHING");
  if (v != nullptr && std::string(v) != "0") GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set";
  Allocator* alloc = cuda_allocator(0);
  alloc->empty_cache();
  AllocatorStats s0 = alloc->stats();
  { Tensor t = empty({1 << 20}, cuda_device()); }
  AllocatorStats s1 = alloc->stats();
  EXPECT_EQ(s1.allocated, s0.allocated);
  EXPECT_GT(s1.reserved, s0.reserved);  // cached, not freed
  { Tensor t = empty({1 << 20}, cuda_device()); }
  AllocatorStats s2 = alloc->stats();
  EXPECT_EQ(s2.num_device_allocs, s1.num_device_allocs);  // reused without cudaMalloc
  EXPECT_GE(s2.peak_allocated, static_cast<size_t>(4 << 20));
  alloc->empty_cache();
  EXPECT_EQ(alloc->stats().reserved, s0.reserved);
  Tensor pinned = ones({16}).pin_memory();
  expect_same(pinned, pinned.cuda(), 0, "pinned copy");
}

}  // namespace
}  // namespace ember
