// Chunked prefill, driven step by step on the Scheduler (no decode thread,
// so every assertion counts steps): a prompt prefilled in chunks samples the
// same tokens as one prefilled whole (same seed), a running request gets a
// token between any two chunks of another's prompt, and a request cancelled
// between its chunks leaves no KV block held.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "sample_steps.h"

namespace loom::engine {
namespace {

using sample::Scheduler;
using sample::SchedulerLimits;
using testing_sampler::Drain;
using testing_sampler::RunCallbacks;
using testing_sampler::Tokens;
using testing_sampler::W;
using testing_sampler::AddRequest;

constexpr int64_t kBlocks = 32, kBlockSize = 8;

std::unique_ptr<Scheduler> Make(int64_t max_prefill_tokens) {
  SchedulerLimits limits;
  limits.max_prefill_tokens = max_prefill_tokens;
  return testing_sampler::MakeScheduler(limits, kBlocks, kBlockSize);
}

TEST(SamplerChunkedPrefill, ChunkedPromptSamplesTheSameTokensAsWhole) {
  for (const std::string& adapter : {std::string(), W().adapter1}) {
    std::optional<Result<SampleOutput>> whole, chunked;
    auto a = Make(8192), b = Make(7);  // 7: chunks end mid-block
    AddRequest(*a, 1, Tokens(45, 3), 12, 3, &whole, adapter);
    AddRequest(*b, 1, Tokens(45, 3), 12, 3, &chunked, adapter);
    Drain(*a);
    Drain(*b);
    EXPECT_EQ(a->stats().prefill_steps, 1);
    EXPECT_EQ(b->stats().prefill_steps, 7);  // ceil(45 / 7)
    EXPECT_EQ(b->stats().prefill_tokens, 45);
    ASSERT_TRUE(whole->ok() && chunked->ok());
    ASSERT_EQ((*chunked)->sequences.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ((*chunked)->sequences[i].tokens, (*whole)->sequences[i].tokens) << "sample " << i;
      for (size_t t = 0; t < (*whole)->sequences[i].logprobs.size(); ++t)
        EXPECT_NEAR((*chunked)->sequences[i].logprobs[t], (*whole)->sequences[i].logprobs[t], 1e-4);
    }
  }
}

TEST(SamplerChunkedPrefill, RunningRequestGetsATokenBetweenChunks) {
  auto s = Make(8);
  std::optional<Result<SampleOutput>> running, longer;
  AddRequest(*s, 1, Tokens(5, 1), 40, 1, &running);
  s->Step();  // its prefill: it has its first token
  ASSERT_EQ(s->stats().tokens_generated, 1);
  AddRequest(*s, 2, Tokens(60, 2), 1, 1, &longer);  // 8 chunks of at most 8 tokens
  std::vector<char> kinds;  // 'P' prefill chunk, 'D' decode step
  while (!longer.has_value()) {
    const SamplerStats before = s->stats();
    s->Step();
    RunCallbacks(*s);
    const SamplerStats after = s->stats();
    ASSERT_EQ(after.prefill_steps + after.decode_steps, before.prefill_steps + before.decode_steps + 1);
    if (after.prefill_steps > before.prefill_steps) {
      kinds.push_back('P');
    } else {
      EXPECT_EQ(after.tokens_generated, before.tokens_generated + 1) << "the running request's token";
      kinds.push_back('D');
    }
    ASSERT_LT(kinds.size(), 40u) << std::string(kinds.begin(), kinds.end());
  }
  // The step after the running request's own prefill is its decode; then
  // the 8 chunks, a decode between each two.
  EXPECT_EQ(std::string(kinds.begin(), kinds.end()), "DPDPDPDPDPDPDPDP");
  ASSERT_TRUE(longer->ok());
  EXPECT_EQ((*longer)->sequences[0].tokens.size(), 1u);
  EXPECT_FALSE(running.has_value());
  Drain(*s);
  ASSERT_TRUE(running->ok());
  EXPECT_EQ((*running)->sequences[0].tokens.size(), 40u);
}

TEST(SamplerChunkedPrefill, CancelBetweenChunksFreesItsBlocks) {
  auto s = Make(8);
  std::optional<Result<SampleOutput>> doomed;
  AddRequest(*s, 1, Tokens(100, 4), 50, 2, &doomed);  // 13 chunks; worst case well over the prompt's blocks
  s->Step();
  s->Step();
  ASSERT_EQ(s->stats().prefill_steps, 2);
  ASSERT_LT(s->blocks().free_count() - s->blocks().reserved(), kBlocks);
  s->Cancel("t:sample:1", Status::Precondition("session expired (test)"));
  RunCallbacks(*s);
  ASSERT_TRUE(doomed.has_value());
  EXPECT_FALSE(doomed->ok());
  EXPECT_TRUE(s->idle());
  EXPECT_EQ(s->blocks().free_count(), kBlocks);  // the 2 computed blocks stay, idle, in the prefix cache
  EXPECT_EQ(s->blocks().reserved(), 0);
  EXPECT_EQ(s->stats().requests_cancelled, 1);
}

}  // namespace
}  // namespace loom::engine
