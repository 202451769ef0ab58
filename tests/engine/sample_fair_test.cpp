// The sampler's admission order (FairQueue, torch-free): a light tenant's
// request overtakes another tenant's backlog, tokens are shared per tenant
// and then per sampling session, the anchor waits for room instead of being
// overtaken, and a session's queued requests can be taken out.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "engine/sample/fair_queue.h"

namespace loom::engine::sample {
namespace {

uint64_t next_id = 0;

std::unique_ptr<SampleRequest> Req(const std::string& tenant, const std::string& session, int64_t cost) {
  auto r = std::make_unique<SampleRequest>();
  r->id = next_id++;
  r->call.tenant = tenant;
  r->call.session = session;
  r->max_tokens = cost;  // the tests' cost function reads it back
  return r;
}

bool Ready(const SampleRequest&) { return true; }

std::string Name(const SampleRequest& r) { return r.call.session + "#" + std::to_string(r.id); }

// One pass that admits at most `room` requests (a stand-in for the batch
// rows) and `free_tokens` of KV; returns who was admitted, in order.
std::vector<std::string> Pass(FairQueue& q, int room, int64_t free_tokens = 1000) {
  std::vector<std::string> got;
  q.Admit(
      free_tokens, Ready,
      [&](const SampleRequest& r) -> std::optional<int64_t> {
        if (static_cast<int>(got.size()) >= room) return std::nullopt;
        return r.max_tokens;
      },
      [&](std::unique_ptr<SampleRequest>& r) {
        got.push_back(Name(*r));
        r.reset();
        return sched::Take::kTaken;
      });
  return got;
}

TEST(SampleFairQueue, LightTenantOvertakesABacklog) {
  FairQueue q(1000);
  next_id = 0;
  for (int i = 0; i < 5; ++i) q.Push(Req("a", "a:sample:0", 100));  // ids 0..4
  q.Push(Req("b", "b:sample:0", 10));                                // id 5
  std::vector<std::string> order;
  while (!q.empty())
    for (const std::string& n : Pass(q, /*room=*/1)) order.push_back(n);
  // Arrival order would put b last; the anchor rotates after a is served.
  EXPECT_EQ(order, (std::vector<std::string>{"a:sample:0#0", "b:sample:0#5", "a:sample:0#1", "a:sample:0#2",
                                             "a:sample:0#3", "a:sample:0#4"}));
}

TEST(SampleFairQueue, SharesTokensPerTenantThenPerSession) {
  FairQueue q(1200);
  next_id = 0;
  for (int i = 0; i < 20; ++i) {
    q.Push(Req("a", "a:sample:0", 100));
    q.Push(Req("a", "a:sample:1", 100));
    q.Push(Req("b", "b:sample:0", 100));
  }
  // 1200 free tokens: tenant b's one session gets half, a's two a quarter each.
  std::map<std::string, int> per_session;
  for (const std::string& n : Pass(q, /*room=*/100, /*free_tokens=*/1200)) ++per_session[n.substr(0, n.find('#'))];
  EXPECT_EQ(per_session["b:sample:0"], 6);
  EXPECT_EQ(per_session["a:sample:0"], 3);
  EXPECT_EQ(per_session["a:sample:1"], 3);
  EXPECT_EQ(q.size(), 48u);
}

TEST(SampleFairQueue, AnchorThatDoesNotFitBlocksThePass) {
  FairQueue q(1000);
  next_id = 0;
  q.Push(Req("a", "a:sample:0", 500));  // id 0: the anchor (oldest ticket)
  q.Push(Req("b", "b:sample:0", 10));   // id 1
  // Only 100 tokens free: b would fit, but it must not overtake the anchor.
  const SampleRequest* waiting = nullptr;
  std::vector<std::string> got;
  waiting = q.Admit(
      100, Ready, [](const SampleRequest& r) -> std::optional<int64_t> { return r.max_tokens; },
      [&](std::unique_ptr<SampleRequest>& r) {
        got.push_back(Name(*r));
        r.reset();
        return sched::Take::kTaken;
      });
  ASSERT_NE(waiting, nullptr);
  EXPECT_EQ(waiting->id, 0u);
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(Pass(q, 10, 1000), (std::vector<std::string>{"a:sample:0#0", "b:sample:0#1"}));
}

TEST(SampleFairQueue, AFlowItsOwnTenantHoldsBackSitsOutAndBlocksNoOne) {
  FairQueue q(1000);
  next_id = 0;
  q.Push(Req("a", "a:sample:0", 100));  // id 0: the oldest ticket, but its tenant owes a full step
  q.Push(Req("b", "b:sample:0", 10));   // id 1
  std::vector<std::string> got;
  const SampleRequest* waiting = q.Admit(
      1000, [](const SampleRequest& r) { return r.call.tenant != "a"; },
      [](const SampleRequest& r) -> std::optional<int64_t> {
        if (r.call.tenant == "a") return std::nullopt;
        return r.max_tokens;
      },
      [&](std::unique_ptr<SampleRequest>& r) {
        got.push_back(Name(*r));
        r.reset();
        return sched::Take::kTaken;
      });
  EXPECT_EQ(waiting, nullptr);
  EXPECT_EQ(got, (std::vector<std::string>{"b:sample:0#1"}));
  EXPECT_EQ(Pass(q, 10), (std::vector<std::string>{"a:sample:0#0"}));  // held no longer: admitted
}

TEST(SampleFairQueue, DroppedRequestsLeaveWithoutBeingCharged) {
  FairQueue q(1000);
  next_id = 0;
  q.Push(Req("a", "a:sample:0", 900));  // fails (say, its snapshot is unreadable)
  q.Push(Req("a", "a:sample:0", 900));
  int taken = 0;
  q.Admit(
      1000, Ready, [](const SampleRequest& r) -> std::optional<int64_t> { return r.max_tokens; },
      [&](std::unique_ptr<SampleRequest>& r) {
        const bool fail = r->id == 0;
        r.reset();
        if (fail) return sched::Take::kDropped;
        ++taken;
        return sched::Take::kTaken;
      });
  EXPECT_EQ(taken, 1);  // the failed one used none of the 1000 tokens
  EXPECT_TRUE(q.empty());
}

TEST(SampleFairQueue, TakeSessionRemovesOnlyThatSession) {
  FairQueue q(1000);
  next_id = 0;
  q.Push(Req("a", "a:sample:0", 10));
  q.Push(Req("a", "a:sample:1", 10));
  q.Push(Req("a", "a:sample:0", 10));
  auto out = q.TakeSession("a:sample:0");
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0]->id, 0u);
  EXPECT_EQ(out[1]->id, 2u);
  EXPECT_EQ(q.size(), 1u);
  EXPECT_EQ(Pass(q, 10), (std::vector<std::string>{"a:sample:1#1"}));
}

}  // namespace
}  // namespace loom::engine::sample
