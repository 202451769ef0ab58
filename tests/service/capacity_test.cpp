// Capacity that waits: with every adapter slot bound, create_model stays
// pending (queue_state paused_capacity, with its place in the queue) until a
// slot frees, in arrival order across tenants; a wait past --capacity-wait
// fails naming the limit; a waiter whose session expires leaves the queue;
// tenants holding slots train on meanwhile. Outcomes and orders only: no
// assertion depends on how long anything took.
#include <gtest/gtest.h>

#include "sched_fixture.h"

namespace loom::service {
namespace {

using namespace std::chrono_literals;

class CapacityTest : public testing::SchedFixture {
 protected:
  void OpenSlots(int slots, std::chrono::milliseconds capacity_wait = std::chrono::minutes(10),
                 std::chrono::milliseconds session_ttl = std::chrono::minutes(5)) {
    ServiceOptions o;
    o.capacity_wait = capacity_wait;
    o.session_ttl = session_ttl;
    OpenWith(o, slots);
  }
  FutureView View(const std::string& tenant, const std::string& id) const {
    auto v = service_->futures().Get(tenant, id);
    EXPECT_TRUE(v.ok());
    return v.ok() ? *v : FutureView{};
  }
  void Unload(const std::string& tenant, const std::string& model) {
    ASSERT_TRUE(service_->UnloadModel({tenant, ""}, model).ok());
  }
  int Binds() const {
    int n = 0;
    for (const std::string& e : engine_->log()) n += e.rfind("bind:", 0) == 0;
    return n;
  }
};

TEST_F(CapacityTest, AWaiterReportsPausedCapacityAndGetsTheSlotThatFrees) {
  OpenSlots(1);
  const std::string a = NewModel("alice");
  const Submitted b = SubmitModel("bob", NewSession("bob"));
  // Pending and paused, with its place and the limits it waits on.
  const FutureView waiting = View("bob", b.request_id);
  EXPECT_EQ(waiting.state, FutureState::kPending);
  EXPECT_EQ(waiting.queue_state, QueueState::kPausedCapacity);
  EXPECT_NE(waiting.queue_reason.find("1 of 1 in the queue"), std::string::npos) << waiting.queue_reason;
  EXPECT_NE(waiting.queue_reason.find("--max-adapters"), std::string::npos) << waiting.queue_reason;
  EXPECT_NE(waiting.queue_reason.find("--capacity-wait"), std::string::npos) << waiting.queue_reason;
  EXPECT_NE(service_->MetricsText().find("\nloom_capacity_waiters 1\n"), std::string::npos);
  EXPECT_EQ(Binds(), 1);  // nothing of bob's reached the engine
  Unload("alice", a);
  const FutureView done = Wait("bob", b.request_id);
  EXPECT_EQ(done.state, FutureState::kDone) << done.error.message();
  EXPECT_EQ(service_->slots_in_use(), 1);
  EXPECT_NE(service_->MetricsText().find("\nloom_capacity_waiters 0\n"), std::string::npos);
}

TEST_F(CapacityTest, RequestsSentWhileWaitingRunAfterTheCreateInSeqIdOrder) {
  OpenSlots(1);
  const std::string a = NewModel("alice");
  const Submitted b = SubmitModel("bob", NewSession("bob"));
  const std::string fb = Submit("bob", Fb(b.model_id, 1, 7, {3}));
  EXPECT_EQ(StateOf("bob", fb), FutureState::kPending);
  Unload("alice", a);
  EXPECT_EQ(Wait("bob", fb).state, FutureState::kDone);
  EXPECT_EQ(StateOf("bob", b.request_id), FutureState::kDone);
}

TEST_F(CapacityTest, FreedSlotsGoToWaitersInArrivalOrderWhateverTheirTenant) {
  OpenSlots(2);
  const std::string alice = NewSession("alice");
  const Submitted a1 = SubmitModel("alice", alice, 0);
  const Submitted a2 = SubmitModel("alice", alice, 1);
  ASSERT_EQ(Wait("alice", a1.request_id).state, FutureState::kDone);
  ASSERT_EQ(Wait("alice", a2.request_id).state, FutureState::kDone);
  const Submitted b = SubmitModel("bob", NewSession("bob"));
  const Submitted c = SubmitModel("carol", NewSession("carol"));
  EXPECT_NE(View("carol", c.request_id).queue_reason.find("2 of 2 in the queue"), std::string::npos);
  // Alice gives one back and asks again at once: she queues behind bob and carol.
  Unload("alice", a1.model_id);
  const Submitted a3 = SubmitModel("alice", alice, 2);
  EXPECT_EQ(Wait("bob", b.request_id).state, FutureState::kDone);
  EXPECT_EQ(StateOf("carol", c.request_id), FutureState::kPending);
  EXPECT_EQ(StateOf("alice", a3.request_id), FutureState::kPending);
  EXPECT_NE(View("carol", c.request_id).queue_reason.find("1 of 2 in the queue"), std::string::npos);
  Unload("alice", a2.model_id);
  EXPECT_EQ(Wait("carol", c.request_id).state, FutureState::kDone);
  EXPECT_EQ(StateOf("alice", a3.request_id), FutureState::kPending);
  Unload("bob", b.model_id);
  EXPECT_EQ(Wait("alice", a3.request_id).state, FutureState::kDone);
}

TEST_F(CapacityTest, AWaitPastTheBoundFailsNamingTheLimit) {
  OpenSlots(1, /*capacity_wait=*/1ms);
  const std::string a = NewModel("alice");
  const Submitted b = SubmitModel("bob", NewSession("bob"));
  const FutureView failed = Wait("bob", b.request_id);
  ASSERT_EQ(failed.state, FutureState::kFailed);
  EXPECT_EQ(failed.error.code(), Code::kUnavailable);
  EXPECT_NE(failed.error.message().find("--capacity-wait"), std::string::npos) << failed.error.message();
  EXPECT_NE(failed.error.message().find("--max-adapters 1"), std::string::npos) << failed.error.message();
  // The model is gone, alice keeps her slot and trains, the queue is empty.
  EXPECT_EQ(service_->ForwardBackward({"bob", ""}, Fb(b.model_id, 1, 1, {3})).status().code(),
            Code::kFailedPrecondition);
  EXPECT_EQ(Wait("alice", Submit("alice", Fb(a, 1, 1, {3}))).state, FutureState::kDone);
  EXPECT_NE(service_->MetricsText().find("\nloom_capacity_waiters 0\n"), std::string::npos);
  EXPECT_EQ(Binds(), 1);
}

TEST_F(CapacityTest, WithoutWaitingAFullServiceRefusesUpFront) {
  OpenSlots(1, /*capacity_wait=*/0ms);
  NewModel("alice");
  auto refused = service_->CreateModel({"bob", ""}, CreateRequest(NewSession("bob")));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kUnavailable);
  EXPECT_NE(refused.status().message().find("--capacity-wait 0"), std::string::npos) << refused.status().message();
}

TEST_F(CapacityTest, TheQueueIsBoundedPerSlot) {
  OpenSlots(1);
  NewModel("alice");
  const std::string s = NewSession("bob");
  for (int i = 0; i < TrainingModels::kWaitersPerSlot; ++i) SubmitModel("bob", s, i);
  auto refused = service_->CreateModel({"bob", ""}, CreateRequest(s, TrainingModels::kWaitersPerSlot));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kUnavailable);
  EXPECT_NE(refused.status().message().find("queue for one is full"), std::string::npos) << refused.status().message();
}

TEST_F(CapacityTest, AWaiterWhoseSessionExpiresLeavesTheQueue) {
  OpenSlots(1, std::chrono::minutes(10), /*session_ttl=*/300ms);
  const std::string alice = NewSession("alice");
  const Submitted a = SubmitModel("alice", alice);
  ASSERT_EQ(Wait("alice", a.request_id).state, FutureState::kDone);
  const Submitted b = SubmitModel("bob", NewSession("bob"));  // bob then goes silent
  const std::string carol = NewSession("carol");
  const Submitted c = SubmitModel("carol", carol);
  auto heartbeats = [&] {
    (void)service_->Heartbeat({"alice", ""}, alice);
    (void)service_->Heartbeat({"carol", ""}, carol);
  };
  const FutureView dropped = WaitWhile("bob", b.request_id, heartbeats);
  ASSERT_EQ(dropped.state, FutureState::kFailed);
  EXPECT_NE(dropped.error.message().find("expired"), std::string::npos) << dropped.error.message();
  EXPECT_NE(View("carol", c.request_id).queue_reason.find("1 of 1 in the queue"), std::string::npos);
  Unload("alice", a.model_id);
  EXPECT_EQ(WaitWhile("carol", c.request_id, heartbeats).state, FutureState::kDone);
}

TEST_F(CapacityTest, TenantsHoldingSlotsTrainWhileOthersWait) {
  OpenSlots(1);
  const std::string a = NewModel("alice");
  const Submitted b = SubmitModel("bob", NewSession("bob"));
  EXPECT_EQ(Wait("alice", Submit("alice", Fb(a, 1, 1, {4, 5}))).state, FutureState::kDone);
  EXPECT_EQ(Wait("alice", Optim("alice", a, 2)).state, FutureState::kDone);
  EXPECT_EQ(engine_->accumulated(0), 0u);
  EXPECT_EQ(engine_->stepped(0), std::vector<size_t>{2});
  EXPECT_EQ(StateOf("bob", b.request_id), FutureState::kPending);
  EXPECT_EQ(View("bob", b.request_id).queue_state, QueueState::kPausedCapacity);
}

}  // namespace
}  // namespace loom::service
