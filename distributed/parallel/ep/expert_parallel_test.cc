// Expert parallelism against one process, on 4 real processes at ep 1, 2
// and 4 (E = 4 and 8, k = 1 and 2, float64): each rank's tokens routed to
// the same experts as one process routing every rank's tokens (the routing
// test), each rank's outputs equal to its rows of the one-process output,
// and, with each rank's loss its own batch's and the gradients averaged
// over the data ranks (as FSDP / DDP would), every gradient (the router,
// the shared experts, each rank's slice of the stacked experts, the input)
// equal to the one-process gradient of the mean loss (rel 1e-10). The
// all-to-all bytes of a step from the process group's counters equal the
// formula: the counts (E int64) plus, forward and backward, the rows sent
// (this rank's tokens x k) and the rows received (the tokens every rank
// routed to this rank's experts), times dim x 8 bytes (float64).
#include "distributed/parallel/ep/expert_parallel.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"
#include "nn/moe.h"
#include "nn/transformer.h"

namespace ember::distributed {
namespace {

namespace mp = ember::distributed::testing;

Tensor rnd(const Shape& s, uint64_t seed, double scale = 1.0) {
  Generator g(seed);
  return randn(s, {DType::Float64}, &g) * scale;
}

// The same layer on every rank (drawn from one seed), float64.
std::shared_ptr<nn::MoE> make_layer(int64_t D, const nn::MoEOptions& o) {
  manual_seed(7);
  auto moe = std::make_shared<nn::MoE>(D, o);
  moe->to(DType::Float64);
  // Router weights with an exact tie (rows 0 and 1) so ties are exercised too.
  Tensor g = rnd({o.num_experts, D}, 11, 0.5);
  g.select(0, 1).copy_(g.select(0, 0));
  moe->router->gate->weight.detach().copy_(g);
  return moe;
}

Tensor avg(const Tensor& t, const std::shared_ptr<ProcessGroup>& pg) {
  Tensor c = t.detach().clone();
  pg->allreduce(c, ReduceOp::Avg)->wait();
  return c;
}

// Every gradient of this rank's layer against the one-process `ref`'s:
// x's (this rank's rows `at`, the loss a mean over the W ranks), the
// router's and the shared experts' averaged over the world, and this
// rank's slice of the stacked experts averaged over the ranks holding it
// ("rest": those outside its ep group), rel 1e-10.
void check_grads(nn::MoE& moe, nn::MoE& ref, const Tensor& x, const Tensor& xr, int64_t at, const DeviceMesh& mesh,
                 const std::string& what) {
  auto world = default_group();
  const int W = world->size();
  const int64_t N = x.size(0), El = moe.experts->w1.size(0), first = mesh.coordinate("ep") * El;
  mp::check_close(x.grad() * (1.0 / W), xr.grad().narrow(0, at, N), what + " dx", 1e-10);
  mp::check_close(avg(moe.router->gate->weight.grad(), world), ref.router->gate->weight.grad(), what + " router",
                  1e-10);
  mp::check_close(avg(moe.shared_experts->down_proj->weight.grad(), world),
                  ref.shared_experts->down_proj->weight.grad(), what + " shared", 1e-10);
  auto rest = mesh.group("rest");
  for (auto [name, got, want] :
       {std::tuple{"w1", moe.experts->w1, ref.experts->w1}, std::tuple{"w2", moe.experts->w2, ref.experts->w2},
        std::tuple{"w3", moe.experts->w3, ref.experts->w3}})
    mp::check_close(avg(got.grad(), rest), want.grad().narrow(0, first, El), what + " " + name, 1e-10);
}

EMBER_WORKER(ep_layer) {
  mp::init_world(env);
  auto world = default_group();
  const int W = env.world_size, me = env.rank;
  const auto args = mp::parse_arg(env.arg);
  const int ep = std::stoi(args.at("ep"));
  const int64_t E = std::stoi(args.at("E")), K = std::stoi(args.at("k"));
  const int64_t D = 6, H = 5, N = 10;  // N tokens per rank
  const nn::MoEOptions o{
      .num_experts = E, .top_k = K, .hidden = H, .shared_experts = 1, .aux_loss_coef = 0.2, .z_loss_coef = 0.05};
  const std::string what = "ep " + std::to_string(ep) + " E " + std::to_string(E) + " k " + std::to_string(K) +
                           " rank " + std::to_string(me);

  // Every rank's tokens and loss weights; the one-process run on all of them
  // with the mean of the ranks' losses.
  Tensor X = rnd({W * N, D}, 21), P = rnd({W * N, D}, 22);
  auto ref = make_layer(D, o);
  Tensor Xr = X.clone().requires_grad_();
  Tensor Y = (*ref)(Xr);
  sum(Y * P * (1.0 / W)).backward();
  const nn::Routing want_route = ref->router->route(X);

  // This rank: its tokens, expert parallel over ep ranks (ep 1: the layer whole).
  auto mesh = DeviceMesh::create({W / ep, ep}, {"rest", "ep"});
  auto moe = make_layer(D, o);
  if (ep > 1) expert_parallel(*moe, mesh->submesh({"ep"}));
  set_moe_balance_group(*moe, world);
  Tensor x = X.narrow(0, me * N, N).clone().requires_grad_();
  // The routing of every token is the one process's.
  const nn::Routing got_route = moe->router->route(x);
  WCHECK(got_route.experts.to_vector() == want_route.experts.narrow(0, me * N, N).to_vector(), what,
         ": routing differs");
  world->reset_counters();
  auto ep_pg = mesh->group("ep");
  ep_pg->reset_counters();
  Tensor y = (*moe)(x);
  mp::check_close(y, Y.detach().narrow(0, me * N, N), what + " forward", 1e-10);
  WCHECK(moe->stats().tokens_per_expert == ref->stats().tokens_per_expert, what, ": global expert counts differ");
  sum(y * P.narrow(0, me * N, N)).backward();

  check_grads(*moe, *ref, x, Xr, me * N, *mesh, what);
  const int64_t El = E / ep, first = mesh->coordinate("ep") * El;

  if (ep > 1) {
    // Bytes: the rows this rank sends (its N k choices) and receives (every
    // token of its ep group routed to its experts), each way, plus the counts.
    const Tensor chosen = want_route.experts.cpu();
    const int64_t group0 = (me / ep) * ep;  // the ep group's first rank
    int64_t received = 0;
    for (int q = 0; q < ep; ++q)
      for (int64_t t = 0; t < N * K; ++t) {
        const int64_t e = chosen.data<int64_t>()[(group0 + q) * N * K + t];
        if (e >= first && e < first + El) ++received;
      }
    const int64_t want_bytes = 2 * (N * K + received) * D * 8 + E * 8;
    const int64_t got_bytes = ep_pg->counter("all_to_all").bytes;
    WCHECK(got_bytes == want_bytes, what, ": all-to-all bytes ", got_bytes, ", expected ", want_bytes, " (routed rows ",
           N * K, " sent, ", received, " received, hidden ", D, ")");
    WCHECK(ep_pg->counter("all_to_all").calls == 5, what, ": ", ep_pg->counter("all_to_all").calls,
           " all-to-alls (counts, tokens, results, and the two back)");
  }
  world->barrier()->wait();
}

TEST(ExpertParallel, EqualsOneProcessAtEp124) {
  for (const char* ek : {"E=4,k=2", "E=8,k=1", "E=8,k=2"})
    for (int ep : {1, 2, 4}) EMBER_EXPECT_RANKS("ep_layer", 4, {.arg = "ep=" + std::to_string(ep) + "," + ek}) << ek;
}

// With a capacity each rank drops its own choices past C before the
// exchange (Megatron's capacity per rank), so rank r's output is what one
// process gives for rank r's tokens alone; the reference runs every rank's
// tokens through one layer, one forward per rank (its losses' gradient
// scaled by 1/W, as the mean of the ranks' losses). The exchanges: 4
// all-to-alls of E C rows, even splits, no counts.
EMBER_WORKER(ep_capacity) {
  mp::init_world(env);
  auto world = default_group();
  const int W = env.world_size, me = env.rank;
  const auto args = mp::parse_arg(env.arg);
  const int ep = std::stoi(args.at("ep"));
  const int64_t E = std::stoi(args.at("E")), K = std::stoi(args.at("k"));
  const double factor = std::stod(args.at("f"));
  const int64_t D = 6, H = 5, N = 10;
  const nn::MoEOptions o{.num_experts = E,
                         .top_k = K,
                         .hidden = H,
                         .shared_experts = 1,
                         .aux_loss_coef = 0.2,
                         .z_loss_coef = 0.05,
                         .capacity_factor = factor};
  const std::string what = "capacity factor " + args.at("f") + " ep " + std::to_string(ep) + " E " + std::to_string(E) +
                           " k " + std::to_string(K) + " rank " + std::to_string(me);
  Tensor X = rnd({W * N, D}, 31), P = rnd({W * N, D}, 32);
  auto ref = make_layer(D, o);
  ref->aux_grad_scale = 1.0 / W;
  Tensor Xr = X.clone().requires_grad_();
  int64_t ref_dropped_mine = 0;
  Tensor Y_mine;
  for (int r = 0; r < W; ++r) {
    Tensor Yr = (*ref)(Xr.narrow(0, r * N, N));
    sum(Yr * P.narrow(0, r * N, N) * (1.0 / W)).backward();
    const int64_t dropped = ref->stats().dropped;
    if (r == me) Y_mine = Yr.detach(), ref_dropped_mine = dropped;
    ref->reset_stats();
  }

  auto mesh = DeviceMesh::create({W / ep, ep}, {"rest", "ep"});
  auto moe = make_layer(D, o);
  if (ep > 1) expert_parallel(*moe, mesh->submesh({"ep"}));
  Tensor x = X.narrow(0, me * N, N).clone().requires_grad_();
  auto ep_pg = mesh->group("ep");
  Tensor y = (*moe)(x);  // the first forward at this C: the ranks agree on it
  ep_pg->reset_counters();
  moe->reset_stats();
  moe->zero_grad();
  y = (*moe)(x);
  mp::check_close(y, Y_mine, what + " forward", 1e-10);
  WCHECK(moe->stats().dropped == ref_dropped_mine, what, ": dropped ", moe->stats().dropped, ", one process ",
         ref_dropped_mine);
  sum(y * P.narrow(0, me * N, N)).backward();
  check_grads(*moe, *ref, x, Xr, me * N, *mesh, what);
  // Some rank dropped choices at the smaller factor (the counts agree on
  // every rank: one allreduce of the dropped counts).
  Tensor d = Tensor::from_vector({static_cast<double>(moe->stats().dropped)}, {1}, DType::Float64);
  world->allreduce(d)->wait();
  if (factor < 1) WCHECK(d.item() > 0, what, ": no rank dropped a choice");
  if (ep > 1) {
    const int64_t C = nn::expert_capacity(o, N);
    const int64_t want_bytes = 4 * E * C * D * 8;
    WCHECK(ep_pg->counter("all_to_all").bytes == want_bytes && ep_pg->counter("all_to_all").calls == 4, what,
           ": all-to-alls ", ep_pg->counter("all_to_all").calls, " of ", ep_pg->counter("all_to_all").bytes,
           " bytes, expected 4 of ", want_bytes, " in all (E C rows each, forward and backward)");
  }
  world->barrier()->wait();
}

TEST(ExpertParallel, WithACapacityEachRankIsOneProcessOnItsTokens) {
  for (const char* ek : {"E=4,k=2,f=0.75", "E=8,k=1,f=1.5", "E=8,k=2,f=4"})
    for (int ep : {2, 4}) EMBER_EXPECT_RANKS("ep_capacity", 4, {.arg = "ep=" + std::to_string(ep) + "," + ek}) << ek;
}

EMBER_WORKER(ep_errors) {
  mp::init_world(env);
  auto mesh = DeviceMesh::create({2}, {"ep"});
  auto moe = make_layer(4, {.num_experts = 3, .top_k = 1, .hidden = 4});
  const std::string e = ::ember::testing::error_of([&] { expert_parallel(*moe, mesh); });
  WCHECK(e.find("has 3 experts, which ep=2 does not divide") != std::string::npos, e);
  nn::Linear plain(4, 4);
  const std::string none = ::ember::testing::error_of([&] { expert_parallel(plain, mesh); });
  WCHECK(none.find("no MoE layer") != std::string::npos, none);
  // With a capacity, ranks that route different numbers of tokens pad to
  // different capacities: named on both before any token moves, also after
  // forwards that agreed (4 and 8 tokens on both: each C seen before).
  auto padded = make_layer(4, {.num_experts = 4, .top_k = 1, .hidden = 4, .capacity_factor = 1.0});
  expert_parallel(*padded, mesh);
  (*padded)(rnd({4, 4}, 1));
  (*padded)(rnd({8, 4}, 2));
  const std::string uneven = ::ember::testing::error_of([&] {
    (*padded)(rnd({env.rank == 0 ? 4 : 8, 4}, 3 + env.rank));
  });
  WCHECK(uneven.find("pads each expert's tokens to") != std::string::npos &&
             uneven.find("must route as many tokens per forward") != std::string::npos,
         uneven);
  default_group()->barrier()->wait();
}

TEST(ExpertParallel, NamedErrors) { EMBER_EXPECT_RANKS("ep_errors", 2); }

}  // namespace
}  // namespace ember::distributed
