// The sampler's torch-free parts: block accounting and reservations, the
// byte-level detokenizer, stop-string matching, the counter-based PRNG.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <stdexcept>
#include <vector>

#include "testmodel/make_model.h"
#include "engine/sample/block_manager.h"
#include "engine/sample/detokenizer.h"
#include "engine/sample/sampling.h"

namespace loom::engine::sample {
namespace {

TEST(SampleBlockManager, WorstCaseCountsSharedPromptBlocksOnce) {
  BlockManager m(100, 16);
  // prompt 21, 18 new: 38 positions -> 3 blocks each; 1 full prompt block shared.
  EXPECT_EQ(m.WorstCase(21, 18, 1), 3);
  EXPECT_EQ(m.WorstCase(21, 18, 4), 3 + 3 * 2);
  EXPECT_EQ(m.WorstCase(16, 1, 2), 1 + 0);   // 16 positions, all shared
  EXPECT_EQ(m.WorstCase(16, 2, 2), 2 + 1);   // 17 positions
  EXPECT_EQ(m.WorstCase(5, 0, 1), 1);        // the prompt is prefilled even with max_tokens 0
}

TEST(SampleBlockManager, ReservationsAndRefcounts) {
  BlockManager m(4, 8);
  EXPECT_TRUE(m.Reserve(3));
  EXPECT_FALSE(m.Reserve(2));  // only 1 unpromised block left
  const int a = m.Allocate(), b = m.Allocate();
  EXPECT_NE(a, b);
  EXPECT_EQ(m.free_count(), 2);
  EXPECT_EQ(m.reserved(), 1);
  m.Share(a);
  m.Release(a);
  EXPECT_EQ(m.free_count(), 2);  // still one owner
  m.Release(a);
  m.Release(b);
  EXPECT_EQ(m.free_count(), 4);
  m.Unreserve(1);
  EXPECT_EQ(m.reserved(), 0);
  EXPECT_TRUE(m.Reserve(4));
  EXPECT_THROW({ m.Unreserve(4); m.Allocate(); }, std::logic_error);
}

TEST(SampleBlockManager, PrefixCacheMatchesExactChainsAndEvictsIdleBlocksOnly) {
  BlockManager m(4, 2);
  const uint64_t base = m.RootTag(""), lora = m.RootTag("/snap/1");
  EXPECT_NE(base, lora);
  EXPECT_EQ(m.RootTag(""), base);
  const int32_t toks[] = {1, 2, 3, 4, 5, 6};
  ASSERT_TRUE(m.Reserve(3));
  const int a = m.Allocate(), b = m.Allocate(), c = m.Allocate();
  m.Publish(a, base, toks);
  m.Publish(b, m.Tag(a), toks + 2);
  m.Publish(c, m.Tag(a), toks + 2);  // same key as b: b stays the cached copy
  EXPECT_EQ(m.Match(base, toks, 3), (std::vector<int>{a, b}));
  EXPECT_EQ(m.Match(base, toks, 1), (std::vector<int>{a}));
  EXPECT_TRUE(m.Match(lora, toks, 3).empty());  // another adapter's root
  EXPECT_TRUE(m.Match(base, toks + 2, 3).empty());
  m.Release(c);
  m.Release(b);
  m.Release(a);
  EXPECT_EQ(m.free_count(), 4);  // plain: the two never-published ones; idle: a, b
  EXPECT_EQ(m.cached_count(), 2);
  // Taking the hits back holds them: they leave the free count.
  EXPECT_FALSE(m.Acquire({a, b}, 3));  // 2 idle + 3 > 4
  ASSERT_TRUE(m.Acquire({a, b}, 2));
  EXPECT_EQ(m.free_count(), 2);
  EXPECT_EQ(m.cached_count(), 0);
  m.Allocate();
  m.Allocate();
  EXPECT_EQ(m.evictions(), 0);  // plain blocks go first
  m.Release(b);
  m.Release(a);  // LRU order now: b, then a
  ASSERT_TRUE(m.Reserve(1));
  EXPECT_EQ(m.Allocate(), b);
  EXPECT_EQ(m.evictions(), 1);
  EXPECT_EQ(m.Match(base, toks, 3), (std::vector<int>{a}));
  ASSERT_TRUE(m.Reserve(1));
  EXPECT_EQ(m.Allocate(), a);
  EXPECT_TRUE(m.Match(base, toks, 3).empty());
}

TEST(SampleBlockManager, AReusedBlockIdNeverMatchesItsOldChildren) {
  BlockManager m(3, 1);
  const uint64_t root = m.RootTag("");
  const int32_t x[] = {7, 8}, y[] = {9, 8};
  ASSERT_TRUE(m.Reserve(2));
  const int p = m.Allocate(), q = m.Allocate();
  m.Publish(p, root, x);
  m.Publish(q, m.Tag(p), x + 1);
  m.Release(p);  // head first, so the LRU evicts p while its child q stays cached
  m.Release(q);
  ASSERT_TRUE(m.Reserve(2));
  m.Allocate();  // the plain free block
  ASSERT_EQ(m.Allocate(), p);
  EXPECT_EQ(m.cached_count(), 1);  // q
  m.Publish(p, root, y);
  // p now holds y[0]; q's K/V were computed after x[0]: never a match.
  EXPECT_EQ(m.Match(root, y, 2), (std::vector<int>{p}));
  EXPECT_TRUE(m.Match(root, x, 2).empty());
}

TEST(SampleDetokenizer, DecodesByteLevelVocabAndAddedTokens) {
  auto d = Detokenizer::Parse(testmodel::MakeTokenizerJson(512));
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ((*d)->size(), 512);
  for (int b = 0; b < 256; ++b) EXPECT_EQ((*d)->Bytes(b), std::string(1, static_cast<char>(b))) << b;
  EXPECT_EQ((*d)->Bytes(511), "<|endoftext|>");
  // ids 256.. are two-symbol strings over {space, a..z}: 256 = "  ", 257 = " a".
  EXPECT_EQ((*d)->Bytes(256), "  ");
  EXPECT_EQ((*d)->Bytes(257), " a");
  EXPECT_EQ((*d)->Decode({'h', 'i', 257}), "hi a");
  EXPECT_EQ((*d)->Bytes(9999), "");
  EXPECT_FALSE(Detokenizer::Parse("{\"model\": {}}").ok());
  EXPECT_EQ(Detokenizer::Load("/nonexistent/tokenizer.json").status().code(), Code::kNotFound);
}

TEST(SampleStopStrings, MatchOnlyWhenTheNewestBytesCompleteIt) {
  EXPECT_TRUE(EndsWithStop("hello world", 3, {"wor"}));     // ends inside the new bytes "rld"
  EXPECT_TRUE(EndsWithStop("hello world", 2, {"world"}));
  EXPECT_FALSE(EndsWithStop("hello world", 2, {"hello"}));  // completed earlier
  EXPECT_FALSE(EndsWithStop("hello", 5, {"xyz", ""}));
  EXPECT_TRUE(EndsWithStop("ab", 1, {"zzz", "ab"}));
}

TEST(SamplePrng, DrawsAreKeyedAndUniform) {
  EXPECT_EQ(UniformDraw(1, 2, 3), UniformDraw(1, 2, 3));
  std::set<double> seen;
  double sum = 0;
  for (uint64_t step = 0; step < 4000; ++step) {
    const double u = UniformDraw(7, 0, step);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    seen.insert(u);
  }
  EXPECT_EQ(seen.size(), 4000u);
  EXPECT_NEAR(sum / 4000, 0.5, 0.02);
  EXPECT_NE(UniformDraw(7, 0, 5), UniformDraw(7, 1, 5));
  EXPECT_NE(UniformDraw(7, 0, 5), UniformDraw(8, 0, 5));
}

// A temperature so small that 1/T overflows fp32 samples as its limit,
// greedy, with a finite logprob, plain or truncated; the other rows of the
// step draw as usual.
TEST(SampleChoice, TinyTemperatureIsItsGreedyLimit) {
  const at::Tensor logits = at::tensor({0.0f, 1.0f, -2.0f, 3.0f, 2.5f, 0.0f}).view({1, 6}).repeat({3, 1});
  std::vector<RowChoiceParams> rows(3);
  rows[0].temperature = 1e-45;
  rows[0].u = 0.999;
  rows[1].temperature = 1e-300;
  rows[1].top_p = 0.9;
  rows[1].u = 0.5;
  rows[2].temperature = 1.0;
  rows[2].u = 0.0;  // the first token of the cdf with mass above 0
  const Choices c = ChooseTokens(logits, rows);
  EXPECT_EQ(c.tokens[0], 3);
  EXPECT_EQ(c.tokens[1], 3);
  EXPECT_EQ(c.tokens[2], 0);
  for (float lp : c.logprobs) EXPECT_TRUE(std::isfinite(lp));
}

// Each drawing row takes the inverse CDF of softmax(logits / T) over token-id
// order at its u, and reports the token's logprob under the unscaled
// logits: at temperature 1 (no scaling pass) and below it, and the same
// whether or not a greedy row shares the step (the argmax pass then runs,
// and the draws write their rows alone).
TEST(SampleChoice, DrawsAreTheInverseCdfWithOrWithoutAGreedyRow) {
  at::manual_seed(3);
  const at::Tensor logits = at::randn({3, 40}) * 2;
  const double temps[] = {1.0, 0.5, 1.0};
  const int64_t want[] = {7, 19, 33};
  std::vector<RowChoiceParams> rows(3);
  for (int64_t r = 0; r < 3; ++r) {
    // u in the middle of token want[r]'s share of the cdf: no rounding moves it out.
    const at::Tensor p = at::softmax(logits[r].to(at::kDouble) / temps[r], -1);
    const at::Tensor cdf = at::cumsum(p, -1);
    const double lo = cdf[want[r] - 1].item<double>(), hi = cdf[want[r]].item<double>();
    rows[static_cast<size_t>(r)].temperature = temps[r];
    rows[static_cast<size_t>(r)].u = (lo + hi) / 2 / cdf[39].item<double>();
  }
  const at::Tensor lsm = at::log_softmax(logits, -1);
  const Choices drawn = ChooseTokens(logits, rows);
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(drawn.tokens[static_cast<size_t>(r)], want[r]) << r;
    EXPECT_NEAR(drawn.logprobs[static_cast<size_t>(r)], lsm[r][want[r]].item<float>(), 1e-5) << r;
  }
  // A greedy row beside them.
  const at::Tensor greedy = at::randn({1, 40});
  std::vector<RowChoiceParams> with = rows;
  with.push_back(RowChoiceParams{});
  with.back().temperature = 0.0;
  const Choices mixed = ChooseTokens(at::cat({logits, greedy}), with);
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(mixed.tokens[r], drawn.tokens[r]) << r;
  EXPECT_EQ(mixed.tokens[3], greedy.argmax(-1).item<int64_t>());
}

}  // namespace
}  // namespace loom::engine::sample
