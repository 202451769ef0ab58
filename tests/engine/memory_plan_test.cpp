// The trainer's memory plan: the cost model from probe peaks, the fewest
// recomputed layers that fit, and the largest pass.
#include "engine/train/memory_plan.h"

#include <gtest/gtest.h>

namespace loom::engine::train {
namespace {

// A model of 10 layers: 1 MiB fixed, 100 KiB a token kept, 10 KiB recomputed.
ActivationCost Cost() {
  constexpr double KiB = 1024, MiB = 1024 * 1024;
  const int64_t P = 1000;
  const double m[2][2] = {{MiB + P * 100 * KiB, MiB + P * 10 * KiB}, {MiB + 2 * P * 100 * KiB, MiB + 2 * P * 10 * KiB}};
  return ActivationCost::FromProbes(10, P, m);
}

// The line through the probes, a tenth above.
TEST(MemoryPlan, RecoversTheLinearModelFromTheProbes) {
  const ActivationCost c = Cost();
  EXPECT_NEAR(c.kept, 1.1 * 100 * 1024.0, 1e-6);
  EXPECT_NEAR(c.recomputed, 1.1 * 10 * 1024.0, 1e-6);
  EXPECT_NEAR(c.fixed, 1.1 * 1024 * 1024.0, 1e-3);
  EXPECT_NEAR(c.Bytes(100, 5), 1.1 * (1024 * 1024.0 + 100 * 55 * 1024.0), 1e-3);  // half the layers: 10 + 45 KiB
}

TEST(MemoryPlan, RecomputesTheFewestLayersThatFit) {
  const ActivationCost c = Cost();
  const int64_t T = 1000;
  // Everything kept fits: no recomputation.
  EXPECT_EQ(PlanPass(c, T, c.Bytes(T, 0)).recompute_layers, 0);
  EXPECT_TRUE(PlanPass(c, T, c.Bytes(T, 0)).fits);
  // Between: the smallest k whose estimate fits, and k - 1 would not.
  for (double room : {c.Bytes(T, 3), c.Bytes(T, 3) + 1.0, c.Bytes(T, 2) - 1.0}) {
    const PassPlan p = PlanPass(c, T, room);
    EXPECT_TRUE(p.fits);
    EXPECT_EQ(p.recompute_layers, 3) << room;
    EXPECT_LE(p.bytes, room);
    EXPECT_GT(c.Bytes(T, p.recompute_layers - 1), room);
  }
  // Not even all recomputed fits: refused, naming what it would need.
  const PassPlan no = PlanPass(c, T, c.Bytes(T, 10) - 1.0);
  EXPECT_FALSE(no.fits);
  EXPECT_EQ(no.recompute_layers, 10);
  // Nothing measured: no plan to refuse by.
  EXPECT_TRUE(PlanPass(ActivationCost{}, T, 0).fits);
}

TEST(MemoryPlan, TheLargestPassFitsAndOneMoreTokenDoesNot) {
  const ActivationCost c = Cost();
  const double room = 3.5 * 1024 * 1024 * 1024;
  const int64_t n = MaxPassTokens(c, room);
  EXPECT_GT(n, 0);
  EXPECT_TRUE(PlanPass(c, n, room).fits);
  EXPECT_FALSE(PlanPass(c, n + 1, room).fits);
  EXPECT_EQ(MaxPassTokens(c, c.fixed / 2), 0);
  EXPECT_EQ(MaxPassTokens(ActivationCost{}, room), 0);
}

// With every layer kept a pass holds fewer tokens, and the largest of them
// is planned with none recomputed; one more token needs a recomputed layer.
TEST(MemoryPlan, TheLargestPassWithEveryLayerKeptRecomputesNone) {
  const ActivationCost c = Cost();
  const double room = 3.5 * 1024 * 1024 * 1024;
  const int64_t kept = MaxPassTokens(c, room, 0);
  ASSERT_GT(kept, 0);
  EXPECT_LT(kept, MaxPassTokens(c, room));
  EXPECT_EQ(PlanPass(c, kept, room).recompute_layers, 0);
  EXPECT_GT(PlanPass(c, kept + 1, room).recompute_layers, 0);
  EXPECT_EQ(MaxPassTokens(c, room, c.layers), MaxPassTokens(c, room));
}

// Two ways a pass may run (the LoRA orders: on the H100 the ragged one
// measured less kept and more recomputed a token than the padded one): the
// plan takes each term's dearer, so a pass either way fits what it planned.
TEST(MemoryPlan, TheDearestOfTwoCostsBoundsBoth) {
  const ActivationCost a = Cost();
  const double m[2][2] = {{2e6, 5e5}, {2e6 + 80e3 * 1000, 5e5 + 20e3 * 1000}};
  const ActivationCost b = ActivationCost::FromProbes(10, 1000, m);
  ASSERT_TRUE(a.kept > b.kept && a.recomputed < b.recomputed);  // neither bounds the other
  for (const ActivationCost& c : {ActivationCost::Dearest(a, b), ActivationCost::Dearest(b, a)}) {
    for (int64_t k : {0, 3, 10})
      for (int64_t T : {10, 1000, 100000}) {
        EXPECT_GE(c.Bytes(T, k), a.Bytes(T, k)) << k << " " << T;
        EXPECT_GE(c.Bytes(T, k), b.Bytes(T, k)) << k << " " << T;
      }
    EXPECT_EQ(c.layers, 10);
  }
  EXPECT_EQ(ActivationCost::Dearest(ActivationCost{}, b).kept, b.kept);  // an unknown cost adds nothing
  EXPECT_EQ(ActivationCost::Dearest(a, ActivationCost{}).kept, a.kept);
}

// A probe whose second size measured less than twice the first (noise, a
// cached block reused) never yields a slope below the larger pass's average.
TEST(MemoryPlan, ANoisyProbeErrsOnTheSideOfMoreMemory) {
  const double m[2][2] = {{900.0, 100.0}, {1000.0, 150.0}};
  const ActivationCost c = ActivationCost::FromProbes(4, 10, m);
  EXPECT_GE(c.kept, 1000.0 / 20);
  EXPECT_GE(c.Bytes(20, 0), 1000.0);
  EXPECT_GE(c.Bytes(10, 0), 900.0);
  EXPECT_GE(c.Bytes(20, 4), 150.0);
}

}  // namespace
}  // namespace loom::engine::train
