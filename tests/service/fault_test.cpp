// Failure isolation inside packed passes (FaultEngine tags, see
// sched_fixture.h): a late validation error, a non-finite loss or an engine
// exception in one model's call fails only that model's request; the others
// in the pass get their results, and the failed model's slot accumulates no
// gradient from the failed call.
#include <gtest/gtest.h>

#include <algorithm>

#include "sched_fixture.h"

namespace loom::testing {
namespace {

using service::FutureState;

class FaultTest : public SchedFixture {
 protected:
  // Three models; while the engine is held on a warm-up pass of model 0, one
  // request per model piles up (tags as given) so they share the next pass.
  void PackThree(int32_t tag_a, int32_t tag_b, int32_t tag_c) {
    Open(/*token_budget=*/1024);
    for (const char* t : {"a", "b", "c"}) models_.push_back(NewModel(t));
    engine_->Hold();
    warm_ = Submit("a", Fb(models_[0], 1, 1, {3}));
    engine_->WaitInForward();
    ids_.push_back(Submit("a", Fb(models_[0], 2, tag_a, {3, 3})));
    ids_.push_back(Submit("b", Fb(models_[1], 1, tag_b, {4})));
    ids_.push_back(Submit("c", Fb(models_[2], 1, tag_c, {5, 5})));
    engine_->Release();
    ASSERT_EQ(Wait("a", warm_).state, FutureState::kDone);
  }
  std::vector<std::string> models_, ids_;
  std::string warm_;
};

TEST_F(FaultTest, LateValidationFailureFailsOnlyItsModel) {
  PackThree(5, 99, 6);
  auto b = Wait("b", ids_[1]);
  EXPECT_EQ(b.state, FutureState::kFailed);
  EXPECT_EQ(b.error.code(), Code::kInvalidArgument);
  auto a = Wait("a", ids_[0]);
  auto c = Wait("c", ids_[2]);
  ASSERT_EQ(a.state, FutureState::kDone);
  ASSERT_EQ(c.state, FutureState::kDone);
  EXPECT_EQ(std::get<tinker::ForwardBackwardOutput>(*a.result).outputs.size(), 2u);
  EXPECT_EQ(std::get<tinker::ForwardBackwardOutput>(*c.result).outputs.size(), 2u);
  EXPECT_EQ(engine_->batch_sizes(), (std::vector<size_t>{1, 3}));  // they did share a pass
  EXPECT_EQ(engine_->accumulated(1), 0u);                         // b's slot untouched
  EXPECT_EQ(engine_->accumulated(0), 1u + 2u);                    // warm-up + a's 2 datums
  EXPECT_EQ(engine_->accumulated(2), 2u);
}

TEST_F(FaultTest, NonFiniteLossFailsOnlyItsModel) {
  PackThree(98, 5, 6);
  auto a = Wait("a", ids_[0]);
  EXPECT_EQ(a.state, FutureState::kFailed);
  EXPECT_NE(a.error.message().find("not finite"), std::string::npos) << a.error.message();
  EXPECT_EQ(Wait("b", ids_[1]).state, FutureState::kDone);
  EXPECT_EQ(Wait("c", ids_[2]).state, FutureState::kDone);
  EXPECT_EQ(engine_->accumulated(0), 1u);  // only the warm-up's datum
  // a keeps training: its next request runs normally.
  auto next = Wait("a", Submit("a", Fb(models_[0], 3, 5, {2})));
  EXPECT_EQ(next.state, FutureState::kDone) << next.error.message();
}

TEST_F(FaultTest, EngineExceptionInAPackedPassIsIsolatedByRunningCallsAlone) {
  PackThree(5, 97, 6);
  auto b = Wait("b", ids_[1]);
  EXPECT_EQ(b.state, FutureState::kFailed);
  EXPECT_NE(b.error.message().find("out of memory"), std::string::npos) << b.error.message();
  EXPECT_EQ(Wait("a", ids_[0]).state, FutureState::kDone);
  EXPECT_EQ(Wait("c", ids_[2]).state, FutureState::kDone);
  // warm-up, the failed packed pass of 3, then each of the 3 alone.
  EXPECT_EQ(engine_->batch_sizes(), (std::vector<size_t>{1, 3, 1, 1, 1}));
  // Neighbours' gradients counted exactly once; the culprit's not at all.
  EXPECT_EQ(engine_->accumulated(0), 3u);
  EXPECT_EQ(engine_->accumulated(1), 0u);
  EXPECT_EQ(engine_->accumulated(2), 2u);
}

TEST_F(FaultTest, FailedPieceOfASplitRequestStopsItsLaterPieces) {
  Open(/*token_budget=*/6);
  const std::string a = NewModel("a");
  const std::string b = NewModel("b");
  auto req = Fb(a, 1, 5, {4, 4, 4, 4});  // 16 tokens: pieces of one datum each (budget 6)
  req.call.data[1].tokens[0] = 98;       // the second piece has a non-finite loss
  const std::string bad = Submit("a", std::move(req));
  const std::string good = Submit("b", Fb(b, 1, 6, {2, 2, 2, 2, 2, 2}));  // 12 tokens: split too
  auto va = Wait("a", bad);
  EXPECT_EQ(va.state, FutureState::kFailed);
  EXPECT_NE(va.error.message().find("split"), std::string::npos) << va.error.message();
  auto vb = Wait("b", good);
  ASSERT_EQ(vb.state, FutureState::kDone) << vb.error.message();
  EXPECT_EQ(std::get<tinker::ForwardBackwardOutput>(*vb.result).outputs.size(), 6u);
  EXPECT_DOUBLE_EQ(std::get<tinker::ForwardBackwardOutput>(*vb.result).metrics.at("loss:sum"), 6.0);
  // a's third and fourth datums never reached the engine.
  size_t a_calls = 0;
  for (const auto& e : engine_->log()) {
    if (e.rfind("fb:0:", 0) == 0) ++a_calls;
  }
  EXPECT_EQ(a_calls, 2u);
  // The request had no effect: its first piece's gradient was rolled back;
  // b's split request kept all of its own.
  EXPECT_EQ(engine_->accumulated(0), 0u);
  EXPECT_EQ(engine_->accumulated(1), 6u);
  std::vector<std::string> marks = engine_->grad_log();
  std::sort(marks.begin(), marks.end());
  EXPECT_EQ(marks, (std::vector<std::string>{"forget:1", "mark:0", "mark:1", "rollback:0"}));
  // a's model still works afterwards.
  EXPECT_EQ(Wait("a", Submit("a", Fb(a, 2, 5, {2}))).state, FutureState::kDone);
}

TEST_F(FaultTest, FailedPieceRollsBackToTheGradientAccumulatedBeforeTheRequest) {
  Open(/*token_budget=*/6);
  const std::string a = NewModel("a");
  ASSERT_EQ(Wait("a", Submit("a", Fb(a, 1, 5, {2, 2}))).state, FutureState::kDone);  // 4 tokens, one pass
  auto req = Fb(a, 2, 5, {4, 4, 4});  // split: one datum a piece
  req.call.data[2].tokens[0] = 98;    // the last piece fails
  EXPECT_EQ(Wait("a", Submit("a", std::move(req))).state, FutureState::kFailed);
  EXPECT_EQ(engine_->accumulated(0), 2u);  // the first request's datums, not the failed one's
  ASSERT_EQ(Wait("a", Optim("a", a, 3)).state, FutureState::kDone);
  EXPECT_EQ(engine_->stepped(0), (std::vector<size_t>{2}));
}

TEST_F(FaultTest, UnloadBetweenPiecesFailsTheRestAndSparesOthers) {
  Open(/*token_budget=*/4);
  const std::string a = NewModel("a");
  const std::string b = NewModel("b");
  engine_->Hold();
  const std::string first = Submit("a", Fb(a, 1, 5, {4, 4, 4}));  // three one-datum pieces
  engine_->WaitInForward();
  const std::string other = Submit("b", Fb(b, 1, 6, {2}));
  ASSERT_TRUE(service_->UnloadModel({"a", ""}, a).ok());
  engine_->Release();
  auto va = Wait("a", first);
  EXPECT_EQ(va.state, FutureState::kFailed);
  EXPECT_NE(va.error.message().find("unloaded"), std::string::npos) << va.error.message();
  EXPECT_EQ(Wait("b", other).state, FutureState::kDone);
}

}  // namespace
}  // namespace loom::testing

namespace loom::testing {
namespace {

TEST_F(SchedFixture, FarFutureSeqIdIsRefusedUpFrontAndTheModelKeepsWorking) {
  Open(/*token_budget=*/1024);
  const std::string a = NewModel("a");
  for (int64_t far : {int64_t{1000000}, int64_t{2147483647}}) {
    auto sub = service_->ForwardBackward({"a", ""}, Fb(a, far, 5, {2}));
    ASSERT_FALSE(sub.ok()) << far;
    EXPECT_EQ(sub.status().code(), Code::kInvalidArgument);
    EXPECT_NE(sub.status().message().find("ahead of the next expected seq_id 1"), std::string::npos)
        << sub.status().message();
  }
  EXPECT_EQ(Wait("a", Submit("a", Fb(a, 1, 5, {2}))).state, service::FutureState::kDone);
  EXPECT_EQ(Wait("a", Submit("a", Fb(a, 2, 5, {2}))).state, service::FutureState::kDone);
}

}  // namespace
}  // namespace loom::testing
