// PassHistory (the dashboard's loss curves): a tenant reads only its own
// models' points, in order; a model keeps at most kMaxPoints, the newest,
// with the request numbers still counting; Forget drops a model's points.
#include "service/pass_history.h"

#include <gtest/gtest.h>

namespace loom::service {
namespace {

TEST(PassHistoryTest, EachTenantReadsOnlyItsOwnModelsInOrder) {
  PassHistory h;
  h.Record("alice", "m-a", 3.0, 6, 100);
  h.Record("bob", "m-b", 9.0, 3, 101);
  h.Record("alice", "m-a", 2.0, 4, 102);
  const auto alice = h.Of("alice");
  ASSERT_EQ(alice.size(), 1u);
  const auto& points = alice.at("m-a").points;
  ASSERT_EQ(points.size(), 2u);
  EXPECT_EQ(points[0].index, 1);
  EXPECT_EQ(points[0].loss_sum, 3.0);
  EXPECT_EQ(points[0].tokens, 6);
  EXPECT_EQ(points[1].index, 2);
  EXPECT_EQ(points[1].at_ms, 102);
  EXPECT_EQ(h.Of("bob").count("m-a"), 0u);
  EXPECT_TRUE(h.Of("carol").empty());
}

TEST(PassHistoryTest, KeepsTheNewestPointsUpToTheBoundAndForgets) {
  PassHistory h;
  const int64_t n = PassHistory::kMaxPoints + 5;
  for (int64_t i = 0; i < n; ++i) h.Record("alice", "m", static_cast<double>(i), 1, i);
  const auto alice = h.Of("alice");
  const auto& points = alice.at("m").points;
  ASSERT_EQ(points.size(), PassHistory::kMaxPoints);
  EXPECT_EQ(points.front().index, 6);  // the first 5 fell off
  EXPECT_EQ(points.back().index, n);
  h.Forget("m");
  EXPECT_TRUE(h.Of("alice").empty());
}

}  // namespace
}  // namespace loom::service
