// Context-parallel attention against one process: every exchange (ring,
// allgather, alltoall) at cp 2, 3 and 4 (odd chunks: 3 positions), causal
// and not, forward and the gradients of q, k and v in float64, each rank's
// slice equal (rel 1e-10) to the same slice of the unsharded attention and
// of its gradients; the bytes each exchange moves, from the process
// group's counters, equal to the formulas; and the named errors.
#include "distributed/parallel/cp/attention.h"

#include <gtest/gtest.h>

#include <string>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/parallel/cp/load_balance.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed::cp {
namespace {

namespace mp = ember::distributed::testing;

Tensor rnd(const Shape& s, uint64_t seed) {
  Generator g(seed);
  return randn(s, {DType::Float64}, &g);
}

EMBER_WORKER(cp_attention) {
  mp::init_world(env);
  auto pg = default_group();
  const Exchange ex = parse_exchange(mp::parse_arg(env.arg).at("exchange"));
  const int cp = env.world_size, me = env.rank;
  const int64_t B = 2, H = 12, c = 3, T = 2 * cp * c, D = 4;
  for (bool causal : {false, true}) {
    const std::string what = std::string(exchange_name(ex)) + " cp " + std::to_string(cp) + (causal ? " causal" : "") +
                             " rank " + std::to_string(me);
    // The whole batch, the same on every rank, and its attention in one process.
    Tensor q = rnd({B, H, T, D}, 1).requires_grad_(), k = rnd({B, H, T, D}, 2).requires_grad_(),
           v = rnd({B, H, T, D}, 3).requires_grad_(), proj = rnd({B, H, T, D}, 4);
    Tensor want = scaled_dot_product_attention(q, k, v, causal);
    sum(want * proj).backward();
    // This rank's slices, as leaves.
    Tensor ql = shard(q.detach(), 2, cp, me).contiguous().requires_grad_();
    Tensor kl = shard(k.detach(), 2, cp, me).contiguous().requires_grad_();
    Tensor vl = shard(v.detach(), 2, cp, me).contiguous().requires_grad_();
    pg->reset_counters();
    Tensor out = attention(ql, kl, vl, causal, ex, pg);
    const auto counters = pg->counters();
    mp::check_close(out, shard(want.detach(), 2, cp, me), what + " forward", 1e-10);
    // Each rank's loss is its slice's share of the one-process loss; the
    // exchanges' backwards sum every rank's contributions.
    pg->reset_counters();
    sum(out * shard(proj, 2, cp, me)).backward();
    const auto back = pg->counters();
    mp::check_close(ql.grad(), shard(q.grad(), 2, cp, me), what + " dq", 1e-10);
    mp::check_close(kl.grad(), shard(k.grad(), 2, cp, me), what + " dk", 1e-10);
    mp::check_close(vl.grad(), shard(v.grad(), 2, cp, me), what + " dv", 1e-10);
    // A retained graph's second backward gives the same gradients (the
    // ring's and the all-gather's nodes start from their first block again).
    {
      Tensor q2 = ql.detach().requires_grad_(), k2 = kl.detach().requires_grad_(), v2 = vl.detach().requires_grad_();
      Tensor y = sum(attention(q2, k2, v2, causal, ex, pg) * shard(proj, 2, cp, me));
      y.backward(Tensor(), /*retain_graph=*/true);
      const Tensor first = k2.grad().clone();
      y.backward();
      mp::check_close(k2.grad(), first * 2.0, what + " dk after a second backward", 1e-10);
    }
    // Bytes of the forward (one layer), per rank.
    const int64_t local = B * H * (2 * c) * D * 8;  // one of q, k, v, out on this rank
    const auto bytes = [&](const char* op) { return counters.count(op) ? counters.at(op).bytes : int64_t{0}; };
    if (ex == Exchange::Ring) {
      // k and v, cp - 1 times: (cp - 1) / cp of the whole sequence's k and v.
      WCHECK(bytes("send") == (cp - 1) * 2 * local, what, ": sent ", bytes("send"));
      WCHECK(bytes("recv") == (cp - 1) * 2 * local, what, ": received ", bytes("recv"));
      // Backward: k and v round again, and each slice's dk, dv on with it
      // (cp hops, the last to its owner): (2 cp - 1) x 2 slices, nothing kept.
      const int64_t sent = back.count("send") ? back.at("send").bytes : 0;
      WCHECK(sent == (2 * cp - 1) * 2 * local, what, ": backward sent ", sent);
    } else if (ex == Exchange::AllGather) {
      // The all-gathered k and v (the counter counts the output): of which
      // (cp - 1) / cp come from the other ranks.
      WCHECK(bytes("allgather") == 2 * cp * local, what, ": all-gathered ", bytes("allgather"));
    } else {
      // Ulysses: q, k, v and the output through all-to-all, 4 N h / cp a rank.
      WCHECK(bytes("all_to_all") == 4 * local, what, ": all-to-all ", bytes("all_to_all"));
    }
  }
}

TEST(ContextParallelAttention, EqualsOneProcessForEveryExchange) {
  for (const char* ex : {"ring", "allgather", "alltoall"})
    for (int cp : {2, 3, 4}) EMBER_EXPECT_RANKS("cp_attention", cp, {.arg = std::string("exchange=") + ex}) << ex;
}

EMBER_WORKER(cp_attention_errors) {
  mp::init_world(env);
  auto pg = default_group();
  const Tensor odd = rnd({1, 3, 5, 4}, 1), even = rnd({1, 3, 4, 4}, 2);
  const std::string e1 = ::ember::testing::error_of([&] { attention(odd, odd, odd, true, Exchange::Ring, pg); });
  WCHECK(e1.find("holds 5 positions") != std::string::npos, e1);
  const std::string e2 = ::ember::testing::error_of([&] { attention(even, even, even, true, Exchange::AllToAll, pg); });
  WCHECK(e2.find("cp 2 must divide the 3 heads") != std::string::npos, e2);
  const std::string e3 = ::ember::testing::error_of([&] {
    attention(even, rnd({1, 3, 6, 4}, 3), even, true, Exchange::AllGather, pg);
  });
  WCHECK(e3.find("must share every dim but the last") != std::string::npos, e3);
  // The checks are local: without this a rank could exit while its peer is
  // still connecting the group (a "Connection closed by peer" in its init).
  pg->barrier()->wait();
}

TEST(ContextParallelAttention, NamedErrors) {
  EMBER_EXPECT_RANKS("cp_attention_errors", 2);
  EXPECT_NE(::ember::testing::error_of([] { parse_exchange("ulysses"); }).find("unknown exchange 'ulysses'"),
            std::string::npos);
}

}  // namespace
}  // namespace ember::distributed::cp
