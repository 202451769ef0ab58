// CheckPassRoom: a server whose slots and sampler leave no room to train is
// refused at start-up with the flags that free memory, not by refusing
// every forward_backward later.
#include "service/pass_room.h"

#include <gtest/gtest.h>

#include "fake_engine.h"

namespace loom::service {
namespace {

TEST(PassRoom, RefusesAServerWithNoRoomToTrainNamingTheFlags) {
  loom::testing::FakeEngine engine;
  EXPECT_TRUE(CheckPassRoom(engine, 1, "m").ok());  // no limit known (the CPU)
  engine.max_pass_tokens = 1;
  Status s = CheckPassRoom(engine, 1, "m");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  for (const char* part : {"room for 1 tokens per training pass of 'm'", "fewer than 512", "--max-adapters",
                           "--kv-budget-tokens", "--sampler-adapters", "a fake plan"})
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " in " << s.message();
  EXPECT_EQ(s.message().find("serve fewer models"), std::string::npos);
  engine.max_pass_tokens = kMinPassTokens;
  EXPECT_TRUE(CheckPassRoom(engine, 1, "m").ok());
  // Two models at once share the room: each must hold the minimum.
  Status two = CheckPassRoom(engine, 2, "m");
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.message().find("the 2 models together leave room for 256 tokens"), std::string::npos) << two.message();
  EXPECT_NE(two.message().find("serve fewer models"), std::string::npos);
  engine.max_pass_tokens = 2 * kMinPassTokens;
  EXPECT_TRUE(CheckPassRoom(engine, 2, "m").ok());
}

// The token budget of serve and the benches' service: the flag when given,
// else the model's share of the room, else (no limit known: the CPU) 8192.
TEST(PassRoom, TheTokenBudgetIsTheFlagElseTheShareOfTheRoom) {
  loom::testing::FakeEngine engine;
  EXPECT_EQ(TokenBudget(engine, 1, 0), kDefaultTokenBudget);
  EXPECT_EQ(TokenBudget(engine, 1, 300), 300);
  engine.max_pass_tokens = 40000;
  EXPECT_EQ(TokenBudget(engine, 1, 0), 40000);
  EXPECT_EQ(TokenBudget(engine, 2, 0), 20000);
  EXPECT_EQ(TokenBudget(engine, 2, 300), 300);
}

// Under PassSizing::kKept a pass is sized to the room with every layer kept,
// not below the floor (then with layers recomputed), never above the most
// that fits; under kMost (the default), or where nothing was measured with
// layers kept, to the most.
TEST(PassRoom, APassIsSizedToTheKeptRoomAboveTheFloor) {
  ServiceOptions kept;
  kept.pass_sizing = ServiceOptions::PassSizing::kKept;
  kept.min_kept_pass_tokens = 4096;
  EXPECT_EQ(PassRoomTokens(6000, 30000, kept), 6000);
  EXPECT_EQ(PassRoomTokens(1000, 30000, kept), 4096);  // the floor, with layers recomputed
  EXPECT_EQ(PassRoomTokens(1000, 3000, kept), 3000);   // never above what fits at all
  EXPECT_EQ(PassRoomTokens(0, 30000, kept), 30000);    // nothing measured with layers kept
  EXPECT_EQ(PassRoomTokens(0, 0, kept), 0);            // no limit known (the CPU)
  ServiceOptions most = kept;
  most.pass_sizing = ServiceOptions{}.pass_sizing;  // the default
  ASSERT_EQ(most.pass_sizing, ServiceOptions::PassSizing::kMost);
  EXPECT_EQ(PassRoomTokens(6000, 30000, most), 30000);
  EXPECT_EQ(PassRoomTokens(6000, 0, most), 0);
}

}  // namespace
}  // namespace loom::service
