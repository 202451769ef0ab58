// Sequencer::Skip: a seq_id whose request was rejected with a 4xx before
// admission must not hold up the requests after it (the real SDK numbers
// every call and never resends a rejected one).
#include "service/sequencer.h"

#include <gtest/gtest.h>

#include <vector>

#include "sequencer_test_ops.h"

namespace loom::service {
namespace {

using namespace std::chrono_literals;

using testing::DrainReady;
using testing::Op;

TEST(SequencerSkip, RejectedSeqAfterArrivalsReleasesThem) {
  Sequencer s;
  s.Admit(Op(1));
  s.Admit(Op(3));  // waits for 2
  s.Admit(Op(4));
  EXPECT_EQ(DrainReady(s), (std::vector<int64_t>{1}));
  EXPECT_EQ(s.waiting(), 2u);
  s.Skip(2);  // 2 was rejected
  EXPECT_EQ(DrainReady(s), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(s.next_seq(), 5);
  EXPECT_EQ(s.waiting(), 0u);
}

TEST(SequencerSkip, RejectedSeqBeforeLaterArrivals) {
  Sequencer s;
  s.Skip(1);
  s.Skip(3);
  EXPECT_EQ(s.next_seq(), 2);  // 3 stays skipped until 2 arrives
  s.Admit(Op(2));
  s.Admit(Op(4));
  EXPECT_EQ(DrainReady(s), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(s.next_seq(), 5);
}

TEST(SequencerSkip, NoOpOnAdmittedOrPastSeq) {
  Sequencer s;
  s.Admit(Op(1));
  s.Admit(Op(3));
  s.Skip(1);  // already admitted and passed
  s.Skip(3);  // admitted, waiting: must not be dropped
  EXPECT_EQ(DrainReady(s), (std::vector<int64_t>{1}));
  EXPECT_EQ(s.waiting(), 1u);
  s.Admit(Op(2));
  EXPECT_EQ(DrainReady(s), (std::vector<int64_t>{2, 3}));
  ASSERT_TRUE(s.Lookup(3).has_value());
  EXPECT_EQ(*s.Lookup(3), "req-3");
}

TEST(SequencerSkip, GapTimeoutStillAppliesAndClearsOldSkips) {
  Sequencer s;
  s.Skip(3);
  s.Admit(Op(2));  // 1 never arrives
  auto expired = s.ExpireGap(Sequencer::Clock::now() + 1s, 500ms);
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].seq_id, 2);
  EXPECT_EQ(s.next_seq(), 4);  // jumped past 2, then past the skipped 3
  s.Admit(Op(4));
  EXPECT_EQ(DrainReady(s), (std::vector<int64_t>{4}));
}

}  // namespace
}  // namespace loom::service
