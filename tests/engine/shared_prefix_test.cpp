// Shared prefixes (engine/train/shared_prefix.h): which rows a call's datums
// share, and a pass that trains them once against the same pass with every
// datum whole: the same logprobs, per-row losses, loss sums and slot
// gradients, on each family whose layers allow it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/train/forward_backward.h"
#include "engine/train/shared_prefix.h"
#include "tiny_model.h"

namespace loom::engine {
namespace {

using train::PlanSharedPrefixes;
using train::PrefixGroup;

// An importance_sampling datum of an RL group: prompt then completion, the
// prompt's rows without advantage (so the same in every datum of the group).
Datum RlDatum(const std::vector<int32_t>& prompt, const std::vector<int32_t>& completion, float advantage) {
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), completion.begin(), completion.end());
  Datum d;
  d.tokens.assign(all.begin(), all.end() - 1);
  std::vector<int64_t> targets(all.begin() + 1, all.end());
  std::vector<float> logprobs(targets.size(), 0.0f), advantages(targets.size(), 0.0f);
  for (size_t k = prompt.size() - 1; k < targets.size(); ++k) {
    logprobs[k] = -1.5f - 0.1f * static_cast<float>(k % 5);
    advantages[k] = advantage;
  }
  d.loss_fn_inputs["target_tokens"] = Array::Ints(std::move(targets));
  d.loss_fn_inputs["logprobs"] = Array::Floats(std::move(logprobs));
  d.loss_fn_inputs["advantages"] = Array::Floats(std::move(advantages));
  return d;
}

// A group of `count` completions (distinct first tokens) of one prompt.
std::vector<Datum> Group(int prompt_len, int count, int salt) {
  std::vector<Datum> data;
  const std::vector<int32_t> prompt = Seq(prompt_len, salt);
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> c = Seq(5 + 3 * i, salt + 7 * i + 1);
    c[0] = (salt + 11 * i + 1) % 61;
    data.push_back(RlDatum(prompt, c, 0.5f - 0.25f * static_cast<float>(i)));
  }
  return data;
}

TEST(SharedPrefix, AGroupSharesItsPromptUpToTheFirstDifferentLossInput) {
  const std::vector<Datum> data = Group(20, 4, 3);
  // The prompt's 20 tokens are 19 rows of input and targets inside the
  // prompt; row 19 predicts each completion's (different) first token.
  EXPECT_EQ(train::CommonRows(data[0], data[1], 1000), 19);
  const std::vector<PrefixGroup> g = PlanSharedPrefixes(data, 8);
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].first, 0u);
  EXPECT_EQ(g[0].count, 4u);
  EXPECT_EQ(g[0].rows, 19);
  // Below min_rows, or off: every datum whole.
  EXPECT_EQ(PlanSharedPrefixes(data, 20).size(), 4u);
  EXPECT_EQ(PlanSharedPrefixes(data, 0).size(), 4u);

  // A loss input that differs inside the prompt ends the shared rows there.
  std::vector<Datum> other = data;
  other[2].loss_fn_inputs["advantages"].f32[12] = 1.0f;
  EXPECT_EQ(train::CommonRows(other[0], other[2], 1000), 12);
  const std::vector<PrefixGroup> g2 = PlanSharedPrefixes(other, 8);
  // Datum 2 would cut the group's rows from 19 to 12 (saving 3 x 12 < 1 x 19
  // ... no: 2 x 12 = 24 > 19), so it joins; datum 3 then shares 12 as well.
  ASSERT_EQ(g2.size(), 1u);
  EXPECT_EQ(g2[0].rows, 12);
  // A different key set never shares.
  other = data;
  other[1].loss_fn_inputs.erase("logprobs");
  EXPECT_EQ(train::CommonRows(data[0], other[1], 1000), 0);
}

TEST(SharedPrefix, ADatumJoinsOnlyWhileTheGroupSavesMore) {
  // Three datums share 30 rows; a fourth shares only 9 with them: joining
  // would save 3 x 9 = 27 rows instead of 2 x 30 = 60, so it starts a group
  // of its own (alone: whole).
  std::vector<Datum> data = Group(31, 3, 5);
  std::vector<Datum> tail = Group(31, 1, 5);
  tail[0].tokens[9] = (tail[0].tokens[9] + 1) % 61;
  data.push_back(tail[0]);
  const std::vector<PrefixGroup> g = PlanSharedPrefixes(data, 8);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].count, 3u);
  EXPECT_EQ(g[0].rows, 30);
  EXPECT_EQ(g[1].first, 3u);
  EXPECT_EQ(g[1].rows, 0);
  ForwardBackwardCall call;
  call.data = data;
  int64_t all = 0;
  for (const Datum& d : data) all += static_cast<int64_t>(d.tokens.size());
  EXPECT_EQ(train::SharedPassRows({call}, 8), all - 60);
  EXPECT_EQ(train::SharedPassRows({call}, 0), all);
}

TEST(SharedPrefix, SavingsBelowTheFloorShareNothing) {
  // Two datums sharing 9 rows of about 60 each save under an eighth.
  std::vector<Datum> data = Group(10, 2, 9);
  for (Datum& d : data) {
    const std::vector<int32_t> extra = Seq(50, 4);
    d.tokens.insert(d.tokens.end(), extra.begin(), extra.end());
    for (auto& [key, a] : d.loss_fn_inputs) {
      a.shape[0] += 50;
      if (a.dtype == Array::DType::kInt64)
        a.i64.insert(a.i64.end(), 50, 1);
      else
        a.f32.insert(a.f32.end(), 50, 0.0f);
    }
  }
  EXPECT_EQ(train::CommonRows(data[0], data[1], 1000), 9);
  EXPECT_EQ(PlanSharedPrefixes(data, 8).size(), 2u);
}

TEST(SharedPrefix, SliceKeepsEveryInputsRowWidth) {
  Datum d;
  d.tokens = {1, 2, 3, 4};
  Array topk;
  topk.dtype = Array::DType::kInt64;
  topk.shape = {4, 2};
  topk.i64 = {1, 2, 3, 4, 5, 6, 7, 8};
  d.loss_fn_inputs["target_tokens"] = topk;
  d.loss_fn_inputs["weights"] = Array::Floats({0.5f, 1.0f, 1.5f, 2.0f});
  const Datum s = train::SliceDatum(d, 1, 3);
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(s.loss_fn_inputs.at("target_tokens").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(s.loss_fn_inputs.at("target_tokens").i64, (std::vector<int64_t>{3, 4, 5, 6}));
  EXPECT_EQ(s.loss_fn_inputs.at("weights").f32, (std::vector<float>{1.0f, 1.5f}));
}

// Slot s's gradients, flattened.
at::Tensor Grads(SlotBank& bank, int s) {
  std::vector<at::Tensor> g;
  for (auto& t : bank.targets())
    for (const at::Tensor* p : {&t.A, &t.B})
      g.push_back(p->grad().defined() ? p->grad().select(0, s).flatten().to(at::kCPU, at::kFloat)
                                      : at::zeros({p->select(0, s).numel()}));
  return at::cat(g);
}

at::Tensor Floats(const Array& a) { return at::tensor(a.f32); }

// A cross_entropy datum weighted on every row, prompt included (a
// supervised batch whose examples share a system prompt that is trained).
Datum WeightedDatum(const Datum& rl) {
  Datum d;
  d.tokens = rl.tokens;
  d.loss_fn_inputs["target_tokens"] = rl.loss_fn_inputs.at("target_tokens");
  std::vector<float> w(d.tokens.size());
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + 0.1f * static_cast<float>(i % 3);
  d.loss_fn_inputs["weights"] = Array::Floats(std::move(w));
  return d;
}

// Three calls (three slots, three losses) whose groups share prompts, plus
// a datum of no group, once with every datum whole and once with shared
// prefixes. The cross_entropy call's shared rows carry loss (the RL calls'
// carry none), so it checks that they count once per datum.
// tol: the largest difference of logprobs, per-row losses and gradients
// (relative to the largest) between the two passes.
void ExpectSharedEqualsWhole(Transformer& model, const std::string& what, double tol = 2e-5) {
  std::vector<Result<ForwardBackwardOutput>> runs[2];
  at::Tensor grads[2][3];
  int64_t rows[2] = {0, 0};
  for (int shared = 0; shared < 2; ++shared) {
    auto bank = std::make_unique<SlotBank>(3, 4, model.device(), model.LoraTargets());
    BindRandom(*bank, 0, 4, 8.0, 21);
    BindRandom(*bank, 1, 4, 8.0, 22);
    BindRandom(*bank, 2, 4, 8.0, 23);
    ForwardBackwardCall a, b, c;
    a.slot = 0;
    a.loss_fn = "importance_sampling";
    a.data = Group(13, 3, 2);
    a.data.push_back(Group(9, 1, 6)[0]);  // no group: whole either way
    b.slot = 1;
    b.loss_fn = "ppo";
    b.data = Group(11, 4, 4);
    c.slot = 2;
    for (const Datum& d : Group(12, 3, 8)) c.data.push_back(WeightedDatum(d));
    runs[shared] = train::ForwardBackward(model, *bank, {a, b, c}, model.config().vocab_size, 0, 0, nullptr,
                                          shared ? 8 : 0);
    rows[shared] = train::SharedPassRows({a, b, c}, shared ? 8 : 0);
    for (int s = 0; s < 3; ++s) grads[shared][s] = Grads(*bank, s);
  }
  // 2 x 12 + 3 x 10 + 2 x 11 rows trained once instead of again.
  EXPECT_EQ(rows[0] - rows[1], 24 + 30 + 22) << what;
  for (size_t c = 0; c < 3; ++c) {
    ASSERT_TRUE(runs[0][c].ok()) << what << runs[0][c].status().message();
    ASSERT_TRUE(runs[1][c].ok()) << what << runs[1][c].status().message();
    const ForwardBackwardOutput &whole = runs[0][c].value(), &shared = runs[1][c].value();
    const double sum = whole.metrics.at("loss:sum");
    EXPECT_NEAR(shared.metrics.at("loss:sum"), sum, tol / 20 * std::max(1.0, std::abs(sum))) << what << " call " << c;
    ASSERT_EQ(shared.outputs.size(), whole.outputs.size());
    for (size_t d = 0; d < whole.outputs.size(); ++d)
      for (const char* key : {"logprobs", "elementwise_loss"}) {
        const Array &x = shared.outputs[d].at(key), &y = whole.outputs[d].at(key);
        ASSERT_EQ(x.shape, y.shape) << what << " " << key;
        EXPECT_LT(RelDiff(Floats(x), Floats(y)), tol) << what << " call " << c << " datum " << d << " " << key;
      }
    EXPECT_GT(grads[0][c].abs().max().item<double>(), 1e-4) << what;
    EXPECT_LT(RelDiff(grads[1][c], grads[0][c]), tol) << what << " slot " << c;
  }
}

TEST(SharedPrefix, APassThatSharesEqualsOneThatDoesNot) {
  for (const char* arch : {"qwen3", "qwen2", "qwen3_moe", "gpt_oss"}) {
    auto model = Tiny(arch, 5);
    ASSERT_TRUE(model->config().SharesPrefixes()) << arch;
    ExpectSharedEqualsWhole(*model, arch);
  }
}

// On a GPU in bf16 a shared pass takes the varlen flash kernel with keys
// that differ from the queries (the prefix's rows gathered before each
// continuation's), sinks and window included (gpt_oss).
TEST(SharedPrefix, APassThatSharesEqualsOneThatDoesNotOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const char* arch : {"qwen3", "gpt_oss"}) {
    auto model = Transformer::FromTensors(TinyConfig(arch), RandomWeights(TinyConfig(arch), 5), at::Device(at::kCUDA, 0),
                                          at::kBFloat16);
    ASSERT_TRUE(model.ok()) << model.status().message();
    ExpectSharedEqualsWhole(*model.value(), std::string(arch) + " cuda bf16", 3e-2);
  }
}

TEST(SharedPrefix, AModelWhoseLayersCannotShareTrainsWhole) {
  ModelConfig c = TinyConfig("qwen3");
  c.index_topk = 2;  // DSA's per-sequence key choice
  EXPECT_FALSE(c.SharesPrefixes());
  c = TinyConfig("qwen3");
  c.layer_types = {"linear_attention", "full_attention"};
  EXPECT_FALSE(c.SharesPrefixes());
}

}  // namespace
}  // namespace loom::engine
