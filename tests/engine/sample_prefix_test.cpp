// The sampler's prefix cache end to end on the tiny model: tokens sampled
// over a reused prefix equal those of a sampler without the cache (same
// seed), prompt_cache_hit_tokens counts whole reused blocks, generated
// tokens are reusable by the next turn, adapters never share blocks,
// eviction under a small KV budget never disturbs running calls, and
// cancellation leaves no block held.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <future>
#include <thread>
#include <vector>

#include "engine/sample_api.h"
#include "sample_world.h"

namespace loom::engine {
namespace {

using testing_sampler::Call;
using testing_sampler::Open;
using testing_sampler::SampleNow;
using testing_sampler::Start;
using testing_sampler::W;

std::vector<int32_t> Tokens(int n, int32_t salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((salt * 131 + i * 37 + 11) % 500));
  return t;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

SamplerOptions Opts(bool cache, int64_t kv_tokens = 0, int block_size = 8) {
  SamplerOptions o;
  o.prefix_cache = cache;
  o.kv_budget_tokens = kv_tokens;
  o.block_size = block_size;
  return o;
}

void ExpectSame(const SampleOutput& cached, const SampleOutput& plain) {
  ASSERT_EQ(cached.sequences.size(), plain.sequences.size());
  for (size_t i = 0; i < plain.sequences.size(); ++i) {
    EXPECT_EQ(cached.sequences[i].tokens, plain.sequences[i].tokens) << "sample " << i;
    ASSERT_EQ(cached.sequences[i].logprobs.size(), plain.sequences[i].logprobs.size());
    for (size_t t = 0; t < plain.sequences[i].logprobs.size(); ++t)
      EXPECT_NEAR(cached.sequences[i].logprobs[t], plain.sequences[i].logprobs[t], 1e-4) << i << "," << t;
  }
}

TEST(SamplerPrefixCache, ReusedPrefixSamplesTheSameTokensAsNoCache) {
  auto cached = Open(Opts(true));
  auto plain = Open(Opts(false));
  const std::vector<int32_t> a = Tokens(37, 1);  // 4 full blocks of 8 and 5 tokens
  for (const std::string& adapter : {std::string(), W().adapter1}) {
    SampleCall first = Call(a, 12, 1.0, adapter, 7);
    EXPECT_EQ(SampleNow(*cached, first).prompt_cache_hit_tokens, 0);
    // Same prompt, 3 samples, another seed: the 4 full blocks are reused.
    SampleCall again = Call(a, 12, 1.0, adapter, 8);
    again.num_samples = 3;
    const SampleOutput hit = SampleNow(*cached, again);
    EXPECT_EQ(hit.prompt_cache_hit_tokens, 32);
    ExpectSame(hit, SampleNow(*plain, again));
    // A longer prompt with the same start reuses the same blocks.
    SampleCall longer = Call(Concat(a, Tokens(20, 2)), 10, 0.8, adapter, 9);
    const SampleOutput l = SampleNow(*cached, longer);
    EXPECT_GE(l.prompt_cache_hit_tokens, 32);
    ExpectSame(l, SampleNow(*plain, longer));
  }
  EXPECT_EQ(plain->stats().prompt_cache_hit_tokens, 0);
  EXPECT_EQ(plain->stats().kv_blocks_cached, 0);
}

TEST(SamplerPrefixCache, NextTurnReusesTheGeneratedTokensAndPrefillsOnlyTheRest) {
  auto cached = Open(Opts(true));
  auto plain = Open(Opts(false));
  std::vector<int32_t> history = Tokens(13, 3);
  int64_t prefilled_before = 0;
  for (int turn = 0; turn < 4; ++turn) {
    SampleCall c = Call(history, 11, 1.0, W().adapter2, 100 + turn);
    const SampleOutput out = SampleNow(*cached, c);
    ExpectSame(out, SampleNow(*plain, c));
    const int64_t P = static_cast<int64_t>(history.size());
    // Every whole block of the history before this turn's user message is
    // cached (prompt and generated tokens alike), the last token aside.
    const int64_t expect_hit = turn == 0 ? 0 : (P - 1 - 6) / 8 * 8;
    EXPECT_EQ(out.prompt_cache_hit_tokens, expect_hit) << "turn " << turn;
    const int64_t prefilled = cached->stats().prefill_tokens;
    EXPECT_EQ(prefilled - prefilled_before, P - out.prompt_cache_hit_tokens) << "turn " << turn;
    prefilled_before = prefilled;
    history = Concat(Concat(history, out.sequences[0].tokens), Tokens(6, 10 + turn));  // the next user message
  }
  EXPECT_EQ(cached->stats().prompt_cache_hit_tokens + cached->stats().prefill_tokens,
            plain->stats().prefill_tokens);
}

// Requests continuing cached prefixes (of the base and of two adapters) and
// one with nothing cached, in one prefill step: each samples what it samples
// without the cache.
TEST(SamplerPrefixCache, SeveralCachedPrefixesInOnePrefillStepSampleTheSameTokensAsNoCache) {
  SamplerOptions o = Opts(true);
  o.admission_window = std::chrono::milliseconds(100);  // the calls below, sent together, share one prefill
  auto cached = Open(o);
  auto plain = Open(Opts(false));
  const std::vector<std::string> adapters = {"", W().adapter1, W().adapter2, W().adapter1};
  std::vector<std::vector<int32_t>> heads;
  for (size_t i = 0; i < adapters.size(); ++i) {
    heads.push_back(Tokens(17 + 8 * static_cast<int>(i), 30 + static_cast<int32_t>(i)));  // 2 + i whole blocks
    SampleNow(*cached, Call(heads[i], 2, 0.0, adapters[i]));
  }
  std::vector<SampleCall> calls;
  for (size_t i = 0; i < adapters.size(); ++i)
    calls.push_back(Call(Concat(heads[i], Tokens(5 + static_cast<int>(i), 50 + static_cast<int32_t>(i))), 8, 1.0,
                         adapters[i], 60 + i));
  calls.push_back(Call(Tokens(12, 70), 8, 1.0, W().adapter2, 70));  // nothing cached
  const int64_t steps_before = cached->stats().prefill_steps;
  std::vector<std::future<Result<SampleOutput>>> fs;
  for (const SampleCall& c : calls) fs.push_back(Start(*cached, c));
  for (size_t i = 0; i < calls.size(); ++i) {
    Result<SampleOutput> r = fs[i].get();
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->prompt_cache_hit_tokens, i < heads.size() ? (2 + static_cast<int>(i)) * 8 : 0) << "call " << i;
    ExpectSame(*r, SampleNow(*plain, calls[i]));
  }
  EXPECT_EQ(cached->stats().prefill_steps - steps_before, 1);  // one step carried them all
}

TEST(SamplerPrefixCache, WholePromptCachedStillPrefillsItsLastToken) {
  auto s = Open(Opts(true));
  const std::vector<int32_t> a = Tokens(24, 4);  // exactly 3 blocks
  SampleNow(*s, Call(a, 4, 0.0));
  const SampleOutput again = SampleNow(*s, Call(a, 4, 0.0));
  EXPECT_EQ(again.prompt_cache_hit_tokens, 16);  // block 3 holds the last token: recomputed for its logits
}

TEST(SamplerPrefixCache, AdaptersAndPromptLogprobsNeverReuseAnothersBlocks) {
  auto s = Open(Opts(true));
  const std::vector<int32_t> a = Tokens(30, 5);
  EXPECT_EQ(SampleNow(*s, Call(a, 3, 0.0, W().adapter1)).prompt_cache_hit_tokens, 0);
  EXPECT_EQ(SampleNow(*s, Call(a, 3, 0.0, W().adapter2)).prompt_cache_hit_tokens, 0);
  EXPECT_EQ(SampleNow(*s, Call(a, 3, 0.0)).prompt_cache_hit_tokens, 0);
  EXPECT_EQ(SampleNow(*s, Call(a, 3, 0.0, W().adapter1)).prompt_cache_hit_tokens, 24);
  EXPECT_EQ(SampleNow(*s, Call(a, 3, 0.0, W().adapter2)).prompt_cache_hit_tokens, 24);
  // Prompt logprobs need every position's hidden state: no reuse, same values.
  SampleCall lp = Call(a, 2, 0.0, W().adapter1);
  lp.prompt_logprobs = true;
  const SampleOutput with = SampleNow(*s, lp);
  EXPECT_EQ(with.prompt_cache_hit_tokens, 0);
  auto plain = Open(Opts(false));
  const SampleOutput without = SampleNow(*plain, lp);
  ASSERT_TRUE(with.prompt_logprobs && without.prompt_logprobs);
  for (size_t i = 1; i < a.size(); ++i) EXPECT_NEAR((*with.prompt_logprobs)[i], (*without.prompt_logprobs)[i], 1e-5);
}

TEST(SamplerPrefixCache, EvictionUnderASmallBudgetNeverDisturbsRunningCalls) {
  // 12 blocks of 8 tokens. A long call holds 5 of them while short calls
  // with distinct prompts fill the rest and leave their blocks cached, so
  // admissions must evict cached blocks, never the long call's.
  auto cached = Open(Opts(true, 96));
  auto plain = Open(Opts(false, 96));
  ASSERT_EQ(cached->info().kv_blocks, 12);
  SampleCall long_call = Call(Tokens(17, 6), 22, 1.0, W().adapter1, 3);  // 38 positions: 5 blocks
  auto running = Start(*cached, long_call);
  std::vector<SampleCall> shorts;
  for (int i = 0; i < 10; ++i)  // pairs share their first block: reused while held
    shorts.push_back(Call(Concat(Tokens(8, 20 + i / 2), Tokens(8 + i % 3, 40 + i)), 6, 1.0, "", 50 + i));
  std::vector<std::future<Result<SampleOutput>>> fs;
  for (const SampleCall& c : shorts) fs.push_back(Start(*cached, c));
  for (size_t i = 0; i < fs.size(); ++i) {
    Result<SampleOutput> r = fs[i].get();
    ASSERT_TRUE(r.ok()) << r.status().message();
    ExpectSame(*r, SampleNow(*plain, shorts[i]));
  }
  Result<SampleOutput> l = running.get();
  ASSERT_TRUE(l.ok()) << l.status().message();
  ExpectSame(*l, SampleNow(*plain, long_call));
  const SamplerStats st = cached->stats();
  EXPECT_GT(st.kv_cache_evictions, 0);
  EXPECT_EQ(st.kv_blocks_free, 12);
  EXPECT_GT(st.kv_blocks_cached, 0);
  // A call that needs every block still fits: cached blocks give way.
  SampleCall whole = Call(Tokens(40, 7), 57, 0.0);  // 96 positions: all 12 blocks
  ASSERT_TRUE(cached->Validate(whole).ok());
  ExpectSame(SampleNow(*cached, whole), SampleNow(*plain, whole));
}

TEST(SamplerPrefixCache, CancelledCallsLeaveNoBlockHeld) {
  SamplerOptions o = Opts(true, 128);
  o.max_batch_rows = 2;
  auto s = Open(o);
  const std::vector<int32_t> a = Tokens(21, 8);
  SampleNow(*s, Call(a, 2, 0.0));  // a's blocks cached: the doomed calls reuse them
  std::vector<std::future<Result<SampleOutput>>> doomed;
  for (int i = 0; i < 3; ++i) {
    SampleCall c = Call(a, 90, 1.0, "", i);
    c.session = "t:sample:0";
    doomed.push_back(Start(*s, c));
  }
  while (s->stats().decode_steps < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s->Cancel("t:sample:0", Status::Precondition("session expired (test)"));
  for (auto& f : doomed) EXPECT_FALSE(f.get().ok());
  // Nothing held: the whole budget is free (some of it idle in the cache),
  // and a call needing all of it is admitted.
  EXPECT_EQ(s->stats().kv_blocks_free, 16);
  SampleCall whole = Call(Tokens(30, 9), 99, 0.0);  // 128 positions
  ASSERT_TRUE(s->Validate(whole).ok());
  EXPECT_EQ(SampleNow(*s, whole).sequences.size(), 1u);
}

}  // namespace
}  // namespace loom::engine
