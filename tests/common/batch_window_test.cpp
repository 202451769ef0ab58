// BatchWindow: the batching-window rule shared by the trainer and the sampler.
#include "common/batch_window.h"

#include <gtest/gtest.h>

#include <chrono>

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

TEST(BatchWindow, WaitsOneWindowAfterTheNewestArrival) {
  const BatchWindow rule{milliseconds(2)};
  const Clock::time_point t0{};
  EXPECT_TRUE(rule.KeepWaiting(t0 + milliseconds(1), t0, t0));
  EXPECT_FALSE(rule.KeepWaiting(t0 + milliseconds(2), t0, t0));  // quiet for a whole window
  EXPECT_EQ(rule.WaitUntil(t0 + milliseconds(5), t0), t0 + milliseconds(7));
}

TEST(BatchWindow, NeverKeepsTheOldestLongerThanTenWindows) {
  const BatchWindow rule{milliseconds(2)};
  const Clock::time_point t0{};
  // Arrivals every millisecond never leave a quiet window; the oldest ends it.
  EXPECT_TRUE(rule.KeepWaiting(t0 + milliseconds(19), t0 + milliseconds(19), t0));
  EXPECT_FALSE(rule.KeepWaiting(t0 + milliseconds(20), t0 + milliseconds(20), t0));
  EXPECT_EQ(rule.WaitUntil(t0 + milliseconds(19), t0), t0 + milliseconds(BatchWindow::kMaxWindows * 2));
}

TEST(BatchWindow, ZeroNeverWaits) {
  const BatchWindow rule{milliseconds(0)};
  const Clock::time_point t0{};
  EXPECT_FALSE(rule.enabled());
  EXPECT_FALSE(rule.KeepWaiting(t0, t0, t0));
}

}  // namespace
}  // namespace loom
