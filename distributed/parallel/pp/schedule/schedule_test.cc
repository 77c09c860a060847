// Schedules against their closed forms (the bubble of GPipe, 1F1B,
// interleaved 1F1B and ZB-H1; live micro-batches per stage), the drawn
// timeline, and the checker's errors on hand-written schedules.
#include "distributed/parallel/pp/schedule/schedule.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/testing/error_of.h"

namespace ember::distributed::pp {
namespace {
using testing::error_of;

Action F(int mb, int s) { return {ActionKind::F, mb, s}; }
Action B(int mb, int s) { return {ActionKind::B, mb, s}; }

TEST(Schedule, ClosedFormsOfTheIssue) {
  // P = 4, M = 8: GPipe and 1F1B 3/11, interleaved (V = 2) 3/19, ZB-H1 with
  // equal F, B, W 3/27.
  Costs fb{.f = 1, .b = 2, .w = 0};
  EXPECT_NEAR(simulate(make_schedule("gpipe", 4, 1, 8), fb).bubble_fraction, 3.0 / 11, 1e-12);
  EXPECT_NEAR(simulate(make_schedule("1f1b", 4, 1, 8), fb).bubble_fraction, 3.0 / 11, 1e-12);
  EXPECT_NEAR(simulate(make_schedule("interleaved", 4, 2, 8), fb).bubble_fraction, 3.0 / 19, 1e-12);
  Costs unit{.f = 1, .b = 1, .w = 1};
  EXPECT_NEAR(simulate(make_schedule("1f1b", 4, 1, 8), unit).bubble_fraction, 3.0 / 11, 1e-12);
  EXPECT_NEAR(simulate(make_schedule("zb-h1", 4, 1, 8), unit).bubble_fraction, 3.0 / 27, 1e-12);
}

TEST(Schedule, BubblesMatchClosedFormsOverManySizes) {
  for (int P = 1; P <= 6; ++P)
    for (int M = 1; M <= 12; ++M) {
      const std::string at = "P=" + std::to_string(P) + " M=" + std::to_string(M);
      Costs fb{.f = 1, .b = 2, .w = 0};
      auto g = make_schedule("gpipe", P, 1, M);
      EXPECT_NEAR(simulate(g, fb).bubble_fraction, closed_form_bubble(g, fb), 1e-12) << at;
      auto o = make_schedule("1f1b", P, 1, M);
      EXPECT_NEAR(simulate(o, fb).bubble_fraction, closed_form_bubble(o, fb), 1e-12) << at;
      for (Costs c : {Costs{.f = 1, .b = 1, .w = 1}, Costs{.f = 1, .b = 2, .w = 1}}) {
        auto z = make_schedule("zb-h1", P, 1, M);
        if (M >= P) {
          EXPECT_NEAR(simulate(z, c).bubble_fraction, closed_form_bubble(z, c), 1e-12) << at << " b=" << c.b;
        }
        // Never worse than 1F1B.
        EXPECT_LE(simulate(z, c).bubble_fraction, simulate(o, c).bubble_fraction + 1e-12) << at;
      }
      if (M % P == 0 && P > 1)
        for (int V : {2, 3}) {
          auto iv = make_schedule("interleaved", P, V, M);
          EXPECT_NEAR(simulate(iv, fb).bubble_fraction, closed_form_bubble(iv, fb), 1e-12) << at << " V=" << V;
        }
    }
}

TEST(Schedule, LiveMicroBatchesPerStage) {
  const int P = 4, M = 8;
  auto one = simulate(make_schedule("1f1b", P, 1, M), {});
  auto gp = simulate(make_schedule("gpipe", P, 1, M), {});
  auto zb = simulate(make_schedule("zb-h1", P, 1, M), {.f = 1, .b = 1, .w = 1});
  for (int i = 0; i < P; ++i) {
    EXPECT_EQ(one.peak_live[i], P - i) << "1f1b stage " << i;
    EXPECT_EQ(gp.peak_live[i], M) << "gpipe stage " << i;
    // ZB-H1 keeps 1F1B's peak (the first stage's P): waiting W's hold the rest.
    EXPECT_EQ(zb.peak_live[i], P) << "zb-h1 stage " << i;
  }
}

TEST(Schedule, TimelineAsTheSeedsFigure) {
  // GPU 0 runs F0 F1 then B1 B0; the next one slot behind.
  Costs c{.f = 1, .b = 1, .w = 0};
  auto s = make_schedule("gpipe", 2, 1, 2);
  EXPECT_EQ(render_timeline(s, simulate(s, c), c),
            "rank 0 | F0 F1 .  .  B1 B0\n"
            "rank 1 | .  F0 F1 B1 B0 . \n");
  auto z = make_schedule("zb-h1", 2, 1, 2);
  Costs u{.f = 1, .b = 1, .w = 1};
  const std::string t = render_timeline(z, simulate(z, u), u);
  EXPECT_NE(t.find("W0"), std::string::npos) << t;
  auto iv = make_schedule("interleaved", 2, 2, 2);
  EXPECT_NE(render_timeline(iv, simulate(iv, c), c).find("F0b"), std::string::npos);
}

TEST(Schedule, SendsAndReceivesPairUp) {
  auto s = make_schedule("interleaved", 2, 2, 4);
  int sends = 0, recvs = 0;
  for (const auto& list : s.actions)
    for (const Action& a : list) {
      sends += a.kind == ActionKind::SendF || a.kind == ActionKind::SendB;
      recvs += a.kind == ActionKind::RecvF || a.kind == ActionKind::RecvB;
    }
  // 4 stages on 2 ranks: every boundary crosses ranks, both ways, per micro-batch.
  EXPECT_EQ(sends, 3 * 2 * 4);
  EXPECT_EQ(recvs, sends);
  // One rank, several stages: hand-overs are local, nothing is sent.
  auto local = make_schedule("gpipe", 1, 3, 2);
  for (const Action& a : local.actions[0]) EXPECT_TRUE(a.is_compute()) << a.str();
}

TEST(Schedule, DeadlockIsReportedNamingBothActions) {
  // Rank 0 waits for micro-batch 0's gradient before sending its activation.
  std::vector<std::vector<Action>> lists{{F(0, 0),
                                          F(1, 0),
                                          {ActionKind::RecvB, 0, 0},
                                          {ActionKind::SendF, 0, 0},
                                          B(0, 0),
                                          {ActionKind::SendF, 1, 0},
                                          {ActionKind::RecvB, 1, 0},
                                          B(1, 0)},
                                         {{ActionKind::RecvF, 0, 1},
                                          F(0, 1),
                                          B(0, 1),
                                          {ActionKind::SendB, 0, 1},
                                          {ActionKind::RecvF, 1, 1},
                                          F(1, 1),
                                          B(1, 1),
                                          {ActionKind::SendB, 1, 1}}};
  Schedule s{"hand", 2, 1, 2, lists};
  const std::string e = error_of([&] { validate(s); });
  EXPECT_NE(e.find("deadlock"), std::string::npos) << e;
  EXPECT_NE(e.find("RecvB(mb 0, stage 0) waits for SendB(mb 0, stage 1)"), std::string::npos) << e;
  EXPECT_NE(e.find("RecvF(mb 0, stage 1)"), std::string::npos) << e;
  // The same lists in a working order pass.
  std::swap(s.actions[0][2], s.actions[0][3]);
  validate(s);
}

TEST(Schedule, MissingMisplacedAndUnknown) {
  auto s = make_schedule("1f1b", 2, 1, 2);
  auto dropped = s;
  dropped.actions[1].erase(dropped.actions[1].begin() + 2);  // rank 1: RecvF F B SendB ...: drop a B
  EXPECT_NE(error_of([&] { validate(dropped); }).find("is missing from rank 1"), std::string::npos);
  auto moved = s;
  moved.actions[0].push_back(F(0, 1));
  EXPECT_NE(error_of([&] { validate(moved); }).find("but rank 1 holds stage 1"), std::string::npos);
  auto early = s;
  std::swap(early.actions[0][0], early.actions[0][1]);  // SendF before its F
  EXPECT_NE(error_of([&] { validate(early); }).find("which comes later in its list"), std::string::npos);
  EXPECT_NE(error_of([&] { make_schedule("pipedream", 2, 1, 2); }).find("unknown pipeline schedule 'pipedream'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_schedule("interleaved", 4, 2, 6); }).find("multiple of the pp size"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_schedule("1f1b", 2, 2, 4); }).find("interleaved"), std::string::npos);
}

}  // namespace
}  // namespace ember::distributed::pp
