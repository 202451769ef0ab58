// Tenants contending on the sampler (step_plan.h), driven step by step on
// the Scheduler, so every assertion counts steps and tokens, never time: a
// light tenant's request that arrives while another tenant's long prompt is
// mid-chunking runs in its own few steps, each carrying only a capped part
// of the other's prompt; the other tenant takes full chunks again once the
// light one is gone; a long generation still leaves the other's prompt a
// step; equal tenants are never capped; and the capped decode rows rotate,
// with a step of every row after each few.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/sample/step_plan.h"
#include "sample_steps.h"

namespace loom::engine {
namespace {

using sample::Scheduler;
using sample::SchedulerLimits;
using testing_sampler::AddRequest;
using testing_sampler::RunCallbacks;
using testing_sampler::Tokens;

constexpr int64_t kChunk = 128, kCap = 8;

std::unique_ptr<Scheduler> Make(int contended_decode_rows = 0, bool mixed_steps = false, bool riders = true) {
  SchedulerLimits limits;
  limits.prefill_riders = riders;
  limits.max_prefill_tokens = kChunk;
  limits.contended_prefill_tokens = kCap;
  limits.contended_decode_rows = contended_decode_rows;
  limits.mixed_steps = mixed_steps;
  return testing_sampler::MakeScheduler(limits, 512, 8);
}

// One step: 'P', 'D' or 'M' (a decode step that also prefilled), and the
// prompt tokens it prefilled.
struct Stepped {
  char kind;
  int64_t prefilled;
  bool contended;
};
Stepped StepOnce(Scheduler& s) {
  const SamplerStats before = s.stats();
  s.Step();
  RunCallbacks(s);
  const SamplerStats after = s.stats();
  const bool prefilled = after.prefill_steps > before.prefill_steps;
  const bool decoded = after.decode_steps > before.decode_steps;
  return {prefilled && decoded ? 'M' : prefilled ? 'P' : 'D', after.prefill_tokens - before.prefill_tokens,
          after.contended_steps > before.contended_steps};
}

// Steps until *done has a result; the kinds of those steps.
std::string StepUntil(Scheduler& s, const std::optional<Result<SampleOutput>>& done, std::vector<Stepped>* steps) {
  std::string kinds;
  while (!done.has_value() && kinds.size() < 100) {
    steps->push_back(StepOnce(s));
    kinds.push_back(steps->back().kind);
  }
  return kinds;
}

TEST(SamplerContention, LightRequestMidChunkingRunsInItsOwnStepsBesideCappedChunks) {
  auto s = Make();
  std::optional<Result<SampleOutput>> flood1, flood2, light;
  AddRequest(*s, 1, Tokens(600, 1), 4, 1, &flood1, "", "flood");
  AddRequest(*s, 2, Tokens(600, 2), 4, 1, &flood2, "", "flood");
  const Stepped first = StepOnce(*s);  // the flood alone: a full chunk
  EXPECT_EQ(first.prefilled, kChunk);
  EXPECT_FALSE(first.contended);
  // The flood still owes 1072 prompt tokens (more than a step): before
  // issue 19's step rule the light request waited for them.
  AddRequest(*s, 3, Tokens(10, 3), 3, 1, &light, "", "light");
  std::vector<Stepped> steps;
  EXPECT_EQ(StepUntil(*s, light, &steps), "PDD");  // its prefill, then its two decode steps back to back
  EXPECT_EQ(steps[0].prefilled, 10 + kCap);        // its 10 tokens and a capped flood chunk
  for (const Stepped& st : steps) EXPECT_TRUE(st.contended);
  ASSERT_TRUE(light->ok());
  EXPECT_EQ((*light)->sequences[0].tokens.size(), 3u);

  // Its tokens are those it samples alone (same seed).
  auto solo = Make();
  std::optional<Result<SampleOutput>> alone;
  AddRequest(*solo, 3, Tokens(10, 3), 3, 1, &alone, "", "light");
  testing_sampler::Drain(*solo);
  EXPECT_EQ((*alone)->sequences[0].tokens, (*light)->sequences[0].tokens);

  // The light tenant counts for kRecentSteps more steps (its client may send
  // the next request at once), then the flood takes full chunks again.
  steps.clear();
  for (uint64_t i = 0; i < sample::kRecentSteps + 1; ++i) steps.push_back(StepOnce(*s));
  for (uint64_t i = 0; i < sample::kRecentSteps; ++i) {
    EXPECT_TRUE(steps[i].contended) << i;
    EXPECT_EQ(steps[i].kind, 'P') << i;
    EXPECT_EQ(steps[i].prefilled, kCap) << i;
  }
  EXPECT_FALSE(steps.back().contended);
  EXPECT_EQ(steps.back().prefilled, kChunk);
  testing_sampler::Drain(*s);
  ASSERT_TRUE(flood1->ok() && flood2->ok());
  EXPECT_EQ((*flood2)->sequences[0].tokens.size(), 4u);
}

// StepLimits::prefill_riders off: the light request's prefill step carries
// its own prompt alone; the flood's capped chunks take steps of their own
// (rule 3) after the light request's decode run, and the light tokens are
// the same.
TEST(SamplerContention, WithoutRidersTheLightPrefillStepCarriesItsPromptAlone) {
  std::vector<int32_t> with_riders;
  for (bool riders : {true, false}) {
    auto s = Make(0, false, riders);
    std::optional<Result<SampleOutput>> flood, light;
    AddRequest(*s, 1, Tokens(600, 1), 4, 1, &flood, "", "flood");
    EXPECT_EQ(StepOnce(*s).prefilled, kChunk);
    AddRequest(*s, 3, Tokens(10, 3), 3, 1, &light, "", "light");
    std::vector<Stepped> steps;
    EXPECT_EQ(StepUntil(*s, light, &steps), "PDD") << riders;
    EXPECT_EQ(steps[0].prefilled, riders ? 10 + kCap : 10);
    ASSERT_TRUE(light->ok());
    if (riders) with_riders = (*light)->sequences[0].tokens;
    else EXPECT_EQ((*light)->sequences[0].tokens, with_riders);
    // The flood still advances by capped chunks while the light tenant is recent.
    const Stepped next = StepOnce(*s);
    EXPECT_EQ(next.kind, 'P');
    EXPECT_EQ(next.prefilled, kCap);
    testing_sampler::Drain(*s);
    ASSERT_TRUE(flood->ok());
  }
}

// StepLimits::mixed_steps: the light request's decode steps also carry a
// capped chunk of the flood's prompts (on the CPU the runner has no graphs,
// so each such step runs the decode and then the chunk: the same bookkeeping
// as one forward). Every request samples the tokens it samples without it.
TEST(SamplerContention, MixedDecodeStepsCarryTheCappedChunksAndSampleTheSameTokens) {
  std::vector<std::vector<int32_t>> tokens[2];
  for (const bool mixed : {false, true}) {
    auto s = Make(0, mixed);
    std::optional<Result<SampleOutput>> flood1, flood2, light;
    AddRequest(*s, 1, Tokens(600, 1), 4, 1, &flood1, "", "flood");
    AddRequest(*s, 2, Tokens(600, 2), 4, 1, &flood2, "", "flood");
    EXPECT_EQ(StepOnce(*s).prefilled, kChunk);
    AddRequest(*s, 3, Tokens(10, 3), 3, 1, &light, "", "light");
    std::vector<Stepped> steps;
    const std::string kinds = StepUntil(*s, light, &steps);
    EXPECT_EQ(kinds, mixed ? "PMM" : "PDD");
    EXPECT_EQ(steps[0].prefilled, 10 + kCap);
    for (size_t i = 1; i < steps.size(); ++i) EXPECT_EQ(steps[i].prefilled, mixed ? kCap : 0) << i;
    for (const Stepped& st : steps) EXPECT_TRUE(st.contended);
    testing_sampler::Drain(*s);
    for (auto* r : {&flood1, &flood2, &light}) {
      ASSERT_TRUE(r->has_value() && (*r)->ok());
      tokens[mixed].push_back((**r)->sequences[0].tokens);
    }
    EXPECT_EQ(s->stats().mixed_steps, 0);  // no graphs here: never one forward
  }
  EXPECT_EQ(tokens[0], tokens[1]);
}

TEST(SamplerContention, LongGenerationLeavesTheOtherTenantsPromptAStep) {
  auto s = Make();
  std::optional<Result<SampleOutput>> flood, light;
  AddRequest(*s, 1, Tokens(300, 1), 4, 1, &flood, "", "flood");
  StepOnce(*s);
  AddRequest(*s, 2, Tokens(10, 2), 12, 1, &light, "", "light");  // 1 token from its prefill, 11 decoded
  std::vector<Stepped> steps;
  // kDecodeRun (4) decode steps in a row, then one capped chunk of the flood's prompt.
  EXPECT_EQ(StepUntil(*s, light, &steps), "PDDDDPDDDDPDDD");
  EXPECT_EQ(steps[5].prefilled, kCap);
  EXPECT_EQ(steps[10].prefilled, kCap);
  testing_sampler::Drain(*s);
  EXPECT_TRUE(flood->ok());
}

TEST(SamplerContention, TenantsOfEqualLoadTakeFullChunks) {
  auto s = Make();
  std::optional<Result<SampleOutput>> a, b;
  AddRequest(*s, 1, Tokens(200, 1), 4, 1, &a, "", "a");
  AddRequest(*s, 2, Tokens(200, 2), 4, 1, &b, "", "b");
  std::vector<int64_t> chunks;
  while (!a.has_value() && !b.has_value()) {
    const Stepped st = StepOnce(*s);
    EXPECT_FALSE(st.contended);
    if (st.kind == 'P') chunks.push_back(st.prefilled);
  }
  EXPECT_EQ(chunks, (std::vector<int64_t>{kChunk, kChunk, kChunk, 400 - 3 * kChunk}));
  testing_sampler::Drain(*s);
}

TEST(SamplerContention, CappedDecodeRowsRotateOverTheOverShareRows) {
  auto s = Make(/*contended_decode_rows=*/2);
  std::optional<Result<SampleOutput>> flood, light;
  AddRequest(*s, 1, Tokens(10, 1), 10, 6, &flood, "", "flood");  // 6 rows, each 1 token from the prefill
  EXPECT_EQ(StepOnce(*s).kind, 'P');
  AddRequest(*s, 2, Tokens(5, 2), 7, 1, &light, "", "light");
  std::vector<Stepped> steps;
  const SamplerStats before = s->stats();
  EXPECT_EQ(StepUntil(*s, light, &steps), "PDDDDDD");
  // Each decode step carries the light row and 2 of the flood's 6 rows,
  // except the fifth: after kDecodeRun (4) such steps left flood rows out,
  // one step carries every row.
  EXPECT_EQ(s->stats().tokens_generated - before.tokens_generated, 1 + 4 * 3 + 7 + 3);
  testing_sampler::Drain(*s);
  ASSERT_TRUE(flood->ok());
  for (const auto& seq : (*flood)->sequences) EXPECT_EQ(seq.tokens.size(), 10u);
}

// The rotation itself, on the plan (torch-free): the over-share rows that
// waited longest go first.
TEST(SampleStepPlan, CappedRowsAreTheLongestWaiting) {
  std::vector<std::unique_ptr<sample::SampleRequest>> admitted;
  const auto add = [&](const std::string& tenant, int rows, int64_t kv, std::vector<uint64_t> last) {
    auto r = std::make_unique<sample::SampleRequest>();
    r->id = admitted.size();
    r->call.tenant = tenant;
    r->call.prompt = {1, 2, 3};
    r->kv_tokens = kv;
    for (int i = 0; i < rows; ++i) {
      auto q = std::make_unique<sample::Sequence>();
      q->request = r.get();
      q->index = i;
      q->cached = 3;
      q->last_step = last[static_cast<size_t>(i)];
      r->sequences.push_back(std::move(q));
    }
    admitted.push_back(std::move(r));
  };
  add("flood", 4, 1000, {7, 5, 9, 6});
  add("light", 1, 10, {9});
  sample::StepLimits limits;
  limits.contended_decode_rows = 2;
  sample::StepHistory history;
  history.step = 9;
  const sample::StepPlan plan = sample::PlanStep(admitted, limits, history);
  EXPECT_TRUE(plan.contended);
  EXPECT_FALSE(plan.prefill);
  ASSERT_EQ(plan.rows.size(), 3u);
  EXPECT_EQ(plan.rows[0]->request->call.tenant, "light");  // within its share: always
  EXPECT_EQ(plan.rows[1]->index, 1);                        // last stepped at 5
  EXPECT_EQ(plan.rows[2]->index, 3);                        // at 6
}

}  // namespace
}  // namespace loom::engine
