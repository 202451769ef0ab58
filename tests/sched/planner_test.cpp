// Tests of the batching policy (sched/planner.h): packing, splitting, merging,
// exclusivity, queue order and fair share under a 100x backlog.
#include "sched/planner.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

namespace loom::sched {
namespace {

const std::string kCE = BatchKey("forward_backward", "cross_entropy", {});
const std::string kIS = BatchKey("forward_backward", "importance_sampling", {});

Request Packable(uint64_t id, const std::string& model, std::vector<int64_t> tokens,
                 const std::string& key = kCE, int64_t arrival_ms = 0) {
  Request r;
  r.id = id;
  r.model_id = model;
  r.kind = OpKind::kPackable;
  r.batch_key = key;
  r.datum_tokens = std::move(tokens);
  r.arrival_ms = arrival_ms;
  return r;
}

Request Other(uint64_t id, const std::string& model, OpKind kind) {
  Request r;
  r.id = id;
  r.model_id = model;
  r.kind = kind;
  return r;
}

TEST(BatchKeyTest, CanonicalOverConfigOrderAndExactOverValues) {
  std::map<std::string, double> a{{"clip_low", 0.8}, {"clip_high", 1.2}};
  std::map<std::string, double> b;
  b["clip_high"] = 1.2;
  b["clip_low"] = 0.8;
  EXPECT_EQ(BatchKey("forward_backward", "ppo", a), BatchKey("forward_backward", "ppo", b));
  b["clip_high"] = 1.2000000000000002;  // one ulp away
  EXPECT_NE(BatchKey("forward_backward", "ppo", a), BatchKey("forward_backward", "ppo", b));
  EXPECT_NE(BatchKey("forward", "cross_entropy", {}), BatchKey("forward_backward", "cross_entropy", {}));
}

TEST(PlannerTest, PushRejectsBadRequests) {
  Planner p({100});
  EXPECT_EQ(p.Push(Packable(1, "a", {})).code(), Code::kInvalidArgument);
  EXPECT_EQ(p.Push(Packable(1, "a", {5, -1})).code(), Code::kInvalidArgument);
  EXPECT_EQ(p.Push(Packable(1, "", {5})).code(), Code::kInvalidArgument);
  EXPECT_EQ(p.Push(Packable(1, "a", {5}, "")).code(), Code::kInvalidArgument);
  ASSERT_TRUE(p.Push(Packable(1, "a", {5})).ok());
  EXPECT_EQ(p.Push(Packable(1, "b", {5})).code(), Code::kInvalidArgument);  // duplicate id
  EXPECT_EQ(p.queued(), 1u);
}

TEST(PlannerTest, EmptyPlannerHasNoPass) {
  Planner p({100});
  EXPECT_FALSE(p.Next().has_value());
  EXPECT_TRUE(p.empty());
}

TEST(PlannerTest, SameKeyPacksAcrossModels) {
  Planner p({100});
  ASSERT_TRUE(p.Push(Packable(1, "a", {10, 10})).ok());
  ASSERT_TRUE(p.Push(Packable(2, "b", {10, 10})).ok());
  ASSERT_TRUE(p.Push(Packable(3, "c", {10, 10})).ok());
  auto pass = p.Next();
  ASSERT_TRUE(pass.has_value());
  EXPECT_EQ(pass->kind, OpKind::kPackable);
  EXPECT_EQ(pass->batch_key, kCE);
  ASSERT_EQ(pass->pieces.size(), 3u);
  std::set<std::string> models;
  for (const Piece& piece : pass->pieces) {
    models.insert(piece.model_id);
    EXPECT_EQ(piece.datum_begin, 0u);
    EXPECT_EQ(piece.datum_end, 2u);
    EXPECT_TRUE(piece.first);
    EXPECT_TRUE(piece.last);
    EXPECT_EQ(piece.tokens, 20);
  }
  EXPECT_EQ(models, (std::set<std::string>{"a", "b", "c"}));
  EXPECT_EQ(pass->tokens, 60);
  EXPECT_DOUBLE_EQ(pass->fill_ratio(), 0.6);
  EXPECT_DOUBLE_EQ(p.last_fill_ratio(), 0.6);
  EXPECT_TRUE(p.empty());
  EXPECT_FALSE(p.Next().has_value());
}

// The room free on the device now caps a pass below the budget; the
// requests it leaves out run in the next pass, which gets the room then.
TEST(PlannerTest, TheRoomFreeNowCapsAPassBelowTheBudget) {
  Planner p({100});
  ASSERT_TRUE(p.Push(Packable(1, "a", {20, 20})).ok());
  ASSERT_TRUE(p.Push(Packable(2, "b", {20, 20})).ok());
  ASSERT_TRUE(p.Push(Packable(3, "c", {20, 20})).ok());
  auto first = p.Next(/*room=*/50);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->token_budget, 50);
  EXPECT_LE(first->tokens, 50);
  EXPECT_EQ(first->tokens, 40);  // two datums of 20 fit in 50, a third does not
  auto second = p.Next(/*room=*/1000);  // more room than the budget: the budget holds
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->token_budget, 100);
  EXPECT_EQ(second->tokens, 80);
  EXPECT_TRUE(p.empty());
  // No room known (0): the budget.
  ASSERT_TRUE(p.Push(Packable(4, "a", {60, 60})).ok());
  auto third = p.Next(0);
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->token_budget, 100);
  EXPECT_EQ(third->tokens, 60);
}

TEST(PlannerTest, DifferentKeysAreNotMixed) {
  Planner p({1000});
  ASSERT_TRUE(p.Push(Packable(1, "a", {10}, kCE)).ok());
  ASSERT_TRUE(p.Push(Packable(2, "b", {10}, kIS)).ok());
  ASSERT_TRUE(p.Push(Packable(3, "c", {10}, kCE)).ok());
  ASSERT_TRUE(p.Push(Packable(4, "d", {10}, BatchKey("forward", "cross_entropy", {}))).ok());
  std::vector<std::set<uint64_t>> passes;
  while (auto pass = p.Next()) {
    std::set<uint64_t> ids;
    for (const Piece& piece : pass->pieces) ids.insert(piece.request_id);
    passes.push_back(ids);
  }
  // a (anchor, oldest) packs with c; then b; then d.
  ASSERT_EQ(passes.size(), 3u);
  EXPECT_EQ(passes[0], (std::set<uint64_t>{1, 3}));
  EXPECT_EQ(passes[1], (std::set<uint64_t>{2}));
  EXPECT_EQ(passes[2], (std::set<uint64_t>{4}));
}

TEST(PlannerTest, OversizeRequestIsSplitInDatumOrderWithLastPieceMarked) {
  Planner p({100});
  ASSERT_TRUE(p.Push(Packable(7, "a", std::vector<int64_t>(10, 30))).ok());
  std::vector<std::pair<size_t, size_t>> ranges;
  std::vector<bool> firsts, lasts;
  while (auto pass = p.Next()) {
    ASSERT_EQ(pass->pieces.size(), 1u);
    EXPECT_LE(pass->tokens, 100);
    const Piece& piece = pass->pieces[0];
    EXPECT_EQ(piece.request_id, 7u);
    EXPECT_EQ(piece.tokens, 30 * static_cast<int64_t>(piece.datum_end - piece.datum_begin));
    ranges.emplace_back(piece.datum_begin, piece.datum_end);
    firsts.push_back(piece.first);
    lasts.push_back(piece.last);
  }
  EXPECT_EQ(ranges, (std::vector<std::pair<size_t, size_t>>{{0, 3}, {3, 6}, {6, 9}, {9, 10}}));
  EXPECT_EQ(firsts, (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ(lasts, (std::vector<bool>{false, false, false, true}));
}

TEST(PlannerTest, DatumLargerThanBudgetRunsAlone) {
  Planner p({100});
  ASSERT_TRUE(p.Push(Packable(1, "b", {10})).ok());
  ASSERT_TRUE(p.Push(Packable(2, "a", {500, 10})).ok());
  ASSERT_TRUE(p.Push(Packable(3, "c", {10})).ok());
  // b anchors: a's 500-token datum cannot join, c can.
  auto pass1 = p.Next();
  ASSERT_TRUE(pass1);
  ASSERT_EQ(pass1->pieces.size(), 2u);
  EXPECT_EQ(pass1->tokens, 20);
  // a anchors next: its oversized datum runs alone.
  auto pass2 = p.Next();
  ASSERT_TRUE(pass2);
  ASSERT_EQ(pass2->pieces.size(), 1u);
  EXPECT_EQ(pass2->pieces[0].request_id, 2u);
  EXPECT_EQ(pass2->pieces[0].datum_end, 1u);
  EXPECT_FALSE(pass2->pieces[0].last);
  EXPECT_EQ(pass2->tokens, 500);
  EXPECT_DOUBLE_EQ(pass2->fill_ratio(), 5.0);
  auto pass3 = p.Next();
  ASSERT_TRUE(pass3);
  ASSERT_EQ(pass3->pieces.size(), 1u);
  EXPECT_EQ(pass3->pieces[0].datum_begin, 1u);
  EXPECT_TRUE(pass3->pieces[0].last);
  EXPECT_FALSE(p.Next());
}

TEST(PlannerTest, ConsecutiveChunksOfOneModelShareAPass) {
  Planner p({1000});
  ASSERT_TRUE(p.Push(Packable(1, "a", {10, 10})).ok());
  ASSERT_TRUE(p.Push(Packable(2, "a", {10})).ok());
  ASSERT_TRUE(p.Push(Other(3, "a", OpKind::kOptim)).ok());
  ASSERT_TRUE(p.Push(Packable(4, "a", {10})).ok());
  auto pass = p.Next();
  ASSERT_TRUE(pass);
  ASSERT_EQ(pass->pieces.size(), 2u);
  EXPECT_EQ(pass->pieces[0].request_id, 1u);
  EXPECT_EQ(pass->pieces[1].request_id, 2u);
  // The optim_step is next in a's queue, so request 4 must wait for it.
  auto optim = p.Next();
  ASSERT_TRUE(optim);
  EXPECT_EQ(optim->kind, OpKind::kOptim);
  ASSERT_EQ(optim->pieces.size(), 1u);
  EXPECT_EQ(optim->pieces[0].request_id, 3u);
  auto last = p.Next();
  ASSERT_TRUE(last);
  EXPECT_EQ(last->pieces[0].request_id, 4u);
}

TEST(PlannerTest, OptimStepsOfAllReadyModelsMerge) {
  Planner p({1000});
  ASSERT_TRUE(p.Push(Other(1, "a", OpKind::kOptim)).ok());
  ASSERT_TRUE(p.Push(Packable(2, "d", {10})).ok());
  ASSERT_TRUE(p.Push(Other(3, "b", OpKind::kOptim)).ok());
  ASSERT_TRUE(p.Push(Packable(4, "e", {10})).ok());
  ASSERT_TRUE(p.Push(Other(5, "e", OpKind::kOptim)).ok());  // behind e's packable: not ready
  ASSERT_TRUE(p.Push(Other(6, "c", OpKind::kOptim)).ok());
  auto pass = p.Next();
  ASSERT_TRUE(pass);
  EXPECT_EQ(pass->kind, OpKind::kOptim);
  std::set<uint64_t> ids;
  for (const Piece& piece : pass->pieces) {
    ids.insert(piece.request_id);
    EXPECT_TRUE(piece.last);
  }
  EXPECT_EQ(ids, (std::set<uint64_t>{1, 3, 6}));
  EXPECT_DOUBLE_EQ(pass->fill_ratio(), 0.0);
  auto packed = p.Next();
  ASSERT_TRUE(packed);
  EXPECT_EQ(packed->kind, OpKind::kPackable);
  EXPECT_EQ(packed->pieces.size(), 2u);  // d and e
  auto optim_e = p.Next();
  ASSERT_TRUE(optim_e);
  EXPECT_EQ(optim_e->kind, OpKind::kOptim);
  ASSERT_EQ(optim_e->pieces.size(), 1u);
  EXPECT_EQ(optim_e->pieces[0].request_id, 5u);
}

TEST(PlannerTest, ExclusiveOpsRunAlone) {
  Planner p({1000});
  ASSERT_TRUE(p.Push(Other(1, "a", OpKind::kExclusive)).ok());
  ASSERT_TRUE(p.Push(Other(2, "b", OpKind::kExclusive)).ok());
  ASSERT_TRUE(p.Push(Packable(3, "c", {10})).ok());
  std::vector<std::pair<OpKind, std::vector<uint64_t>>> passes;
  while (auto pass = p.Next()) {
    std::vector<uint64_t> ids;
    for (const Piece& piece : pass->pieces) ids.push_back(piece.request_id);
    passes.emplace_back(pass->kind, ids);
  }
  ASSERT_EQ(passes.size(), 3u);
  EXPECT_EQ(passes[0].first, OpKind::kExclusive);
  EXPECT_EQ(passes[0].second, std::vector<uint64_t>{1});
  EXPECT_EQ(passes[1].first, OpKind::kExclusive);
  EXPECT_EQ(passes[1].second, std::vector<uint64_t>{2});
  EXPECT_EQ(passes[2].second, std::vector<uint64_t>{3});
}

TEST(PlannerTest, RemoveAndDropModel) {
  Planner p({25});
  ASSERT_TRUE(p.Push(Packable(1, "a", {10, 10, 10, 10})).ok());
  ASSERT_TRUE(p.Push(Packable(2, "a", {10})).ok());
  ASSERT_TRUE(p.Push(Packable(3, "b", {10})).ok());
  ASSERT_TRUE(p.Push(Other(4, "b", OpKind::kOptim)).ok());
  auto pass = p.Next();  // a's first datums, b's request
  ASSERT_TRUE(pass);
  EXPECT_EQ(p.queued(), 3u);  // 1 (partial), 2, 4
  EXPECT_TRUE(p.Remove(1));   // a's split request failed: its rest is dropped
  EXPECT_FALSE(p.Remove(1));
  EXPECT_EQ(p.DropModel("b"), std::vector<uint64_t>{4});
  EXPECT_TRUE(p.DropModel("zzz").empty());
  auto next = p.Next();
  ASSERT_TRUE(next);
  ASSERT_EQ(next->pieces.size(), 1u);
  EXPECT_EQ(next->pieces[0].request_id, 2u);
  EXPECT_TRUE(p.empty());
}

TEST(PlannerTest, Metrics) {
  Planner p({100});
  ASSERT_TRUE(p.Push(Packable(1, "a", {10}, kCE, 1000)).ok());
  ASSERT_TRUE(p.Push(Packable(2, "a", {10}, kCE, 1500)).ok());
  ASSERT_TRUE(p.Push(Packable(3, "b", {10}, kIS, 1800)).ok());
  EXPECT_EQ(p.QueueDepths(), (std::map<std::string, size_t>{{"a", 2}, {"b", 1}}));
  EXPECT_EQ(p.OldestWaitMs("a", 2000), 1000);
  EXPECT_EQ(p.OldestWaitMs("b", 2000), 200);
  EXPECT_EQ(p.OldestWaitMs("none", 2000), 0);
  EXPECT_EQ(p.OldestWaitMs(2000), 1000);
  auto pass = p.Next();
  ASSERT_TRUE(pass);
  EXPECT_DOUBLE_EQ(p.last_fill_ratio(), 0.2);  // a's two requests
  EXPECT_EQ(p.TokensServed("a"), 20);
  EXPECT_EQ(p.QueueDepths(), (std::map<std::string, size_t>{{"b", 1}}));
}

// Invariants over random traffic: budget respected (except a lone oversized
// datum), one key per pass, every datum planned exactly once and in order,
// each model's requests completed in push order.
class PlannerTraffic : public ::testing::TestWithParam<bool> {};  // small_first

TEST_P(PlannerTraffic, RandomTrafficKeepsInvariants) {
  std::mt19937 rng(12345);
  const int64_t budget = 256;
  Planner p({budget, GetParam()});
  const std::vector<std::string> keys{kCE, kIS};
  std::map<uint64_t, std::vector<int64_t>> sizes;
  std::map<uint64_t, size_t> next_datum;
  std::map<std::string, std::vector<uint64_t>> pushed, completed;
  uint64_t id = 0;
  int passes = 0;
  for (int step = 0; step < 400; ++step) {
    for (int k = 0; k < 3; ++k) {
      const std::string model = "m" + std::to_string(rng() % 6);
      const int what = rng() % 10;
      Request r;
      if (what < 7) {
        std::vector<int64_t> tokens(1 + rng() % 6);
        for (auto& t : tokens) t = (rng() % 20 == 0) ? 300 : 1 + rng() % 90;
        r = Packable(++id, model, tokens, keys[rng() % 2]);
        sizes[id] = tokens;
      } else {
        r = Other(++id, model, what < 9 ? OpKind::kOptim : OpKind::kExclusive);
      }
      pushed[model].push_back(id);
      ASSERT_TRUE(p.Push(r).ok());
    }
    auto pass = p.Next();
    ASSERT_TRUE(pass);
    ++passes;
    std::set<std::string> models_in_pass;
    for (const Piece& piece : pass->pieces) {
      if (pass->kind == OpKind::kPackable) {
        const auto& s = sizes.at(piece.request_id);
        ASSERT_EQ(piece.datum_begin, next_datum[piece.request_id]);
        ASSERT_GT(piece.datum_end, piece.datum_begin);
        int64_t tokens = 0;
        for (size_t d = piece.datum_begin; d < piece.datum_end; ++d) tokens += s[d];
        ASSERT_EQ(tokens, piece.tokens);
        next_datum[piece.request_id] = piece.datum_end;
        ASSERT_EQ(piece.last, piece.datum_end == s.size());
        ASSERT_EQ(piece.first, piece.datum_begin == 0);
      }
      if (piece.last) completed[piece.model_id].push_back(piece.request_id);
      if (pass->kind == OpKind::kOptim) {
        ASSERT_TRUE(models_in_pass.insert(piece.model_id).second);  // one per model
      }
    }
    if (pass->kind == OpKind::kPackable) {
      const bool lone_oversized = pass->pieces.size() == 1 &&
                                  pass->pieces[0].datum_end - pass->pieces[0].datum_begin == 1;
      if (!lone_oversized) ASSERT_LE(pass->tokens, budget);
    }
    if (pass->kind == OpKind::kExclusive) ASSERT_EQ(pass->pieces.size(), 1u);
  }
  while (auto pass = p.Next()) {
    for (const Piece& piece : pass->pieces) {
      if (piece.last) completed[piece.model_id].push_back(piece.request_id);
    }
  }
  EXPECT_EQ(completed, pushed);
}

INSTANTIATE_TEST_SUITE_P(Planner, PlannerTraffic, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "small_first" : "by_ticket"; });

// POLICY 6: an optim_step (or a save) that became ready after another
// model's packable request runs before it with small_first, after it without.
TEST(PlannerTest, SmallOpsFirstRunBeforeAnOlderPackablePass) {
  for (const bool small_first : {false, true}) {
    Planner p({100, small_first});
    ASSERT_TRUE(p.Push(Packable(1, "a", {50, 50, 50})).ok());
    ASSERT_TRUE(p.Push(Other(2, "b", OpKind::kOptim)).ok());
    ASSERT_TRUE(p.Push(Other(3, "c", OpKind::kExclusive)).ok());
    std::vector<OpKind> kinds;
    while (auto pass = p.Next()) kinds.push_back(pass->kind);
    const std::vector<OpKind> want =
        small_first ? std::vector<OpKind>{OpKind::kOptim, OpKind::kExclusive, OpKind::kPackable, OpKind::kPackable}
                    : std::vector<OpKind>{OpKind::kPackable, OpKind::kOptim, OpKind::kExclusive, OpKind::kPackable};
    EXPECT_EQ(kinds, want) << small_first;
  }
}

// POLICY 6's bound: models whose queues hold nothing but small ops get at
// most one such pass per queued model in a row; then the oldest ticket's
// packable request runs.
TEST(PlannerTest, SmallOpsFirstCannotStarveAPackablePass) {
  Planner p({100, true});
  ASSERT_TRUE(p.Push(Packable(1, "a", {10})).ok());
  uint64_t id = 1;
  for (const std::string m : {"b", "c", "d"})
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(p.Push(Other(++id, m, i % 2 ? OpKind::kOptim : OpKind::kExclusive)).ok());
  int index = 0, packable_at = -1;
  size_t pieces = 0;
  while (auto pass = p.Next()) {
    if (pass->kind == OpKind::kPackable) packable_at = index;
    pieces += pass->pieces.size();
    ++index;
  }
  EXPECT_EQ(pieces, 31u);  // every request ran
  ASSERT_GE(packable_at, 0);
  EXPECT_LE(packable_at, 4);  // 4 models queued: at most 4 small passes before it
}

// One heavy tenant with a 100x backlog and 7 light tenants, all training with
// the same loss. Each light tenant runs a closed loop: one 64-token request,
// then the next once it completes.
TEST(PlannerFairnessTest, HeavyBacklogDoesNotDelayLightTenants) {
  const int64_t budget = 512;
  Planner p({budget});
  uint64_t id = 0;
  // Heavy: 100x a light tenant's outstanding work per step (64 tokens x 100).
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(p.Push(Packable(++id, "heavy", {64})).ok());
  std::map<std::string, uint64_t> light_request;
  std::map<uint64_t, int> pushed_at_pass;
  for (int t = 0; t < 7; ++t) {
    const std::string m = "light" + std::to_string(t);
    light_request[m] = ++id;
    pushed_at_pass[id] = 0;
    ASSERT_TRUE(p.Push(Packable(id, m, {64})).ok());
  }
  int max_latency = 0;
  for (int pass_no = 1; pass_no <= 60; ++pass_no) {
    auto pass = p.Next();
    ASSERT_TRUE(pass);
    EXPECT_LE(pass->tokens, budget);
    for (const Piece& piece : pass->pieces) {
      if (piece.model_id == "heavy" || !piece.last) continue;
      max_latency = std::max(max_latency, pass_no - pushed_at_pass.at(piece.request_id));
      // The tenant sends its next step right away.
      const uint64_t next = ++id;
      pushed_at_pass[next] = pass_no;
      ASSERT_TRUE(p.Push(Packable(next, piece.model_id, {64})).ok());
    }
  }
  EXPECT_LE(max_latency, 1);  // every light request ran in the very next pass
  const double total = 60.0 * budget;
  const double heavy_share = p.TokensServed("heavy") / total;
  EXPECT_NEAR(heavy_share, 1.0 / 8, 0.02);
  for (int t = 0; t < 7; ++t) {
    EXPECT_NEAR(p.TokensServed("light" + std::to_string(t)) / total, 1.0 / 8, 0.02);
  }
}

// Same, but the heavy tenant's datums are big (5x a light share) and every
// tenant is backlogged: tokens must still split about evenly, and the heavy
// tenant must not starve either.
TEST(PlannerFairnessTest, BackloggedTenantsShareTokensEvenly) {
  const int64_t budget = 512;
  Planner p({budget});
  uint64_t id = 0;
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(p.Push(Packable(++id, "heavy", {320, 320})).ok());
  for (int t = 0; t < 7; ++t) {
    for (int i = 0; i < 200; ++i) {
      ASSERT_TRUE(p.Push(Packable(++id, "light" + std::to_string(t), {64, 32})).ok());
    }
  }
  const int passes = 200;
  for (int i = 0; i < passes; ++i) {
    auto pass = p.Next();
    ASSERT_TRUE(pass);
    EXPECT_LE(pass->tokens, budget);
  }
  int64_t total = 0;
  for (int t = 0; t < 7; ++t) total += p.TokensServed("light" + std::to_string(t));
  total += p.TokensServed("heavy");
  EXPECT_GT(total, passes * budget * 8 / 10);  // passes stay mostly full
  EXPECT_NEAR(static_cast<double>(p.TokensServed("heavy")) / total, 1.0 / 8, 0.04);
  for (int t = 0; t < 7; ++t) {
    EXPECT_NEAR(static_cast<double>(p.TokensServed("light" + std::to_string(t))) / total, 1.0 / 8,
                0.04);
  }
}

// Light tenants use a different loss than the heavy one, so they cannot share
// its passes: anchor rotation must still run them within about one pass.
TEST(PlannerFairnessTest, OtherKeysAreNotStarvedByABacklog) {
  Planner p({512});
  uint64_t id = 0;
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(p.Push(Packable(++id, "heavy", {512})).ok());
  std::map<uint64_t, int> pushed_at_pass;
  for (int t = 0; t < 7; ++t) {
    pushed_at_pass[++id] = 0;
    ASSERT_TRUE(p.Push(Packable(id, "light" + std::to_string(t), {64}, kIS)).ok());
  }
  int max_latency = 0;
  int light_done = 0;
  for (int pass_no = 1; pass_no <= 40; ++pass_no) {
    auto pass = p.Next();
    ASSERT_TRUE(pass);
    for (const Piece& piece : pass->pieces) {
      if (piece.model_id == "heavy") continue;
      ++light_done;
      max_latency = std::max(max_latency, pass_no - pushed_at_pass.at(piece.request_id));
      pushed_at_pass[++id] = pass_no;
      ASSERT_TRUE(p.Push(Packable(id, piece.model_id, {64}, kIS)).ok());
    }
  }
  EXPECT_LE(max_latency, 2);
  EXPECT_GE(light_done, 7 * 15);
  EXPECT_GE(p.TokensServed("heavy"), 15 * 512);  // the heavy tenant progresses too
}

}  // namespace
}  // namespace loom::sched
