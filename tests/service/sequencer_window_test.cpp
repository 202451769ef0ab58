// Sequencer window (issue 15): a seq_id far ahead of the next expected one
// must not brick the model. Before the window, seq_id 1000000 waited, its gap
// timed out, next_seq jumped to 1000001 and every later in-order request was
// stale; 2^63-1 made next_seq overflow.
#include "service/sequencer.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "sequencer_test_ops.h"

namespace loom::service {
namespace {

using namespace std::chrono_literals;

using testing::DrainReady;
using testing::Op;

TEST(SequencerWindow, FarFutureSeqIsRefusedAndTheModelKeepsWorking) {
  Sequencer s;
  const auto far = s.Admit(Op(1000000));
  EXPECT_NE(far.admission, Sequencer::Admission::kAccepted);
  EXPECT_EQ(s.waiting(), 0u);
  EXPECT_FALSE(s.Lookup(1000000).has_value());
  // Even once any gap would have timed out, nothing moves next_seq.
  EXPECT_TRUE(s.ExpireGap(Sequencer::Clock::now() + 1h, 1s).empty());
  EXPECT_EQ(s.next_seq(), 1);
  // The client's next in-order requests run.
  EXPECT_EQ(s.Admit(Op(1)).admission, Sequencer::Admission::kAccepted);
  EXPECT_EQ(s.Admit(Op(2)).admission, Sequencer::Admission::kAccepted);
  EXPECT_EQ(DrainReady(s), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(s.next_seq(), 3);
}

TEST(SequencerWindow, MaxInt64IsRefusedWithoutTouchingNextSeq) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  Sequencer s;
  EXPECT_NE(s.Admit(Op(max)).admission, Sequencer::Admission::kAccepted);
  s.Skip(max);
  s.Skip(max - 1);
  EXPECT_TRUE(s.ExpireGap(Sequencer::Clock::now() + 1h, 1s).empty());
  EXPECT_EQ(s.next_seq(), 1);
  EXPECT_EQ(s.Admit(Op(1)).admission, Sequencer::Admission::kAccepted);
  EXPECT_EQ(DrainReady(s), (std::vector<int64_t>{1}));
  EXPECT_EQ(s.next_seq(), 2);
}

TEST(SequencerWindow, TheWindowIsExactAndNamedInTheError) {
  Sequencer s;  // next expected: 1
  const int64_t edge = 1 + Sequencer::kMaxAhead;
  EXPECT_TRUE(s.CheckWindow(edge).ok());
  Status st = s.CheckWindow(edge + 1);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("seq_id: 1026 is more than 1024 ahead of the next expected seq_id 1", 0), 0u)
      << st.message();
  EXPECT_FALSE(s.CheckWindow(std::numeric_limits<int64_t>::max()).ok());
  EXPECT_TRUE(s.CheckWindow(0).ok());  // below next_seq: stale, not the window's business
  EXPECT_EQ(s.Admit(Op(edge + 1)).admission, Sequencer::Admission::kOutOfWindow);
  // The chunks of a big forward_backward, first chunk last, all fit.
  for (int64_t seq = edge; seq >= 2; --seq) EXPECT_EQ(s.Admit(Op(seq)).admission, Sequencer::Admission::kAccepted);
  EXPECT_EQ(s.waiting(), static_cast<size_t>(Sequencer::kMaxAhead));
  EXPECT_EQ(s.Admit(Op(1)).admission, Sequencer::Admission::kAccepted);
  EXPECT_EQ(s.ready_count(), static_cast<size_t>(edge));
  EXPECT_EQ(s.next_seq(), edge + 1);
  // The window moves with next_seq.
  EXPECT_TRUE(s.CheckWindow(edge + 1 + Sequencer::kMaxAhead).ok());
  EXPECT_FALSE(s.CheckWindow(edge + 2 + Sequencer::kMaxAhead).ok());
}

}  // namespace
}  // namespace loom::service
