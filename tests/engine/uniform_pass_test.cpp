// The uniform layout (train/uniform_pass.h) against the packed pass: the
// same logprobs, per-token losses, loss sums and per-slot gradients, for
// slots of different ranks and trained groups, padded sequences and padded
// sequence counts, cross_entropy and an RL loss; passes that do not fit, mix
// losses or ask for no backward keep the packed path; a non-finite loss
// hands the pass back, which then fails that call alone. On CUDA the same
// passes replayed as CUDA graphs (pass_graphs.h), over new data and slots.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "engine/train/forward_backward.h"
#include "engine/train/pass_graphs.h"
#include "tiny_model.h"

namespace loom::engine {
namespace {

using train::PassGraphs;

// Slot 0 trains everything at rank 4; slot 1 rank 2 without the MLP; slot 2
// rank 3 without the unembed. B is random so every LoRA path is non-zero.
void BindSlots(SlotBank& bank) {
  BindRandom(bank, 0, 4, 8.0, 11);
  for (int s : {1, 2}) {
    LoraConfig c;
    c.rank = s == 1 ? 2 : 3;
    c.alpha = 5.0;
    c.seed = static_cast<uint64_t>(20 + s);
    c.train_mlp = s != 1;
    c.train_unembed = s != 2;
    ASSERT_TRUE(bank.Bind(s, c).ok());
    at::manual_seed(30 + s);
    c10::NoGradGuard no_grad;
    for (auto& t : bank.targets())
      t.B.select(0, s).narrow(1, 0, c.rank).copy_(0.2 * at::randn({t.d_out, c.rank}).to(t.B.device()));
  }
}

Datum MakeDatum(int len, int salt, const std::string& loss) {
  Datum d;
  d.tokens = Seq(len, salt);
  std::vector<int64_t> targets;
  std::vector<float> a, b;
  for (int i = 0; i < len; ++i) {
    targets.push_back((i * 5 + salt) % 61);
    a.push_back(0.25f + 0.05f * static_cast<float>((i + salt) % 7));
    b.push_back(-4.0f + 0.1f * static_cast<float>((i * 3 + salt) % 5));
  }
  d.loss_fn_inputs["target_tokens"] = Array::Ints(targets);
  if (loss == "cross_entropy") {
    d.loss_fn_inputs["weights"] = Array::Floats(a);
  } else {
    d.loss_fn_inputs["advantages"] = Array::Floats(a);
    d.loss_fn_inputs["logprobs"] = Array::Floats(b);
  }
  return d;
}

ForwardBackwardCall Call(int slot, const std::vector<int>& lens, int salt, const std::string& loss = "cross_entropy") {
  ForwardBackwardCall c;
  c.slot = slot;
  c.loss_fn = loss;
  if (loss == "ppo") c.loss_fn_config = {{"clip_low_threshold", 0.9}, {"clip_high_threshold", 1.1}};
  for (size_t i = 0; i < lens.size(); ++i) c.data.push_back(MakeDatum(lens[i], salt + static_cast<int>(i), loss));
  return c;
}

struct Outcome {
  std::vector<Result<ForwardBackwardOutput>> results;
  std::vector<at::Tensor> grads;  // every target's A.grad and B.grad, in order
};

Outcome Pass(const Transformer& model, SlotBank& bank, const std::vector<ForwardBackwardCall>& calls,
         PassGraphs* graphs) {
  for (int s = 0; s < bank.num_slots(); ++s) bank.ZeroGrad(s);
  Outcome r;
  r.results = train::ForwardBackward(model, bank, calls, model.config().vocab_size, 0, 0, graphs);
  for (const auto& t : bank.targets())
    for (const at::Tensor& f : {t.A, t.B})
      r.grads.push_back(f.grad().defined() ? f.grad().detach().to(at::kFloat).cpu().clone()
                                           : at::zeros(f.sizes(), at::kFloat));
  return r;
}

void ExpectSame(const Outcome& got, const Outcome& want, double tol) {
  ASSERT_EQ(got.results.size(), want.results.size());
  for (size_t c = 0; c < want.results.size(); ++c) {
    ASSERT_EQ(got.results[c].ok(), want.results[c].ok()) << "call " << c;
    if (!want.results[c].ok()) continue;
    const auto& g = got.results[c].value();
    const auto& w = want.results[c].value();
    EXPECT_NEAR(g.metrics.at("loss:sum"), w.metrics.at("loss:sum"), tol * std::max(1.0, std::abs(w.metrics.at("loss:sum"))));
    ASSERT_EQ(g.outputs.size(), w.outputs.size());
    for (size_t d = 0; d < w.outputs.size(); ++d)
      for (const char* key : {"logprobs", "elementwise_loss"}) {
        const auto& ga = g.outputs[d].at(key).f32;
        const auto& wa = w.outputs[d].at(key).f32;
        ASSERT_EQ(ga.size(), wa.size()) << key;
        for (size_t i = 0; i < wa.size(); ++i) EXPECT_NEAR(ga[i], wa[i], tol * std::max(1.0f, std::abs(wa[i]))) << key;
      }
  }
  ASSERT_EQ(got.grads.size(), want.grads.size());
  double scale = 0;
  for (size_t i = 0; i < want.grads.size(); ++i) {
    EXPECT_LE(RelDiff(got.grads[i], want.grads[i]), tol) << "factor " << i;
    scale = std::max(scale, want.grads[i].abs().max().item<double>());
  }
  EXPECT_GT(scale, 1e-4);  // the gradients compared are not all zero
}

TEST(UniformPass, SameValuesAndGradientsAsThePackedPass) {
  for (const std::string arch : {"qwen2", "qwen3", "qwen3-bias"})
    for (const std::string loss : {"cross_entropy", "ppo"}) {
      auto model = Tiny(arch);
      auto bank = Bank(*model, 4, 4);
      BindSlots(*bank);
      // 5 datums (padded to 8 sequences of 64 rows), the slots in no order;
      // and 3 (4 sequences: few enough that each group's factors are cast
      // once for the pass and q/k/v and gate/up take one joint LoRA node).
      const std::vector<std::vector<ForwardBackwardCall>> cases{
          {Call(1, {17, 30}, 1, loss), Call(0, {5}, 4, loss), Call(2, {64, 9}, 7, loss)},
          {Call(1, {17}, 1, loss), Call(0, {5}, 4, loss), Call(2, {30}, 7, loss)}};
      for (const auto& calls : cases) {
        const Outcome packed = Pass(*model, *bank, calls, nullptr);
        PassGraphs graphs(PassGraphs::Options{4096, false});
        const Outcome uniform = Pass(*model, *bank, calls, &graphs);
        EXPECT_EQ(graphs.stats().passes, 1) << arch << " " << loss;
        ExpectSame(uniform, packed, 1e-5);
      }
    }
}

TEST(UniformPass, PassesItCannotTakeKeepThePackedPath) {
  auto model = Tiny("qwen3");
  auto bank = Bank(*model, 4, 4);
  BindSlots(*bank);
  PassGraphs graphs(PassGraphs::Options{256, false});
  // 5 sequences pad to 8 x 64 = 512 tokens: over 256.
  const std::vector<ForwardBackwardCall> wide{Call(0, {5, 6, 7}, 1), Call(1, {8, 9}, 2)};
  ExpectSame(Pass(*model, *bank, wide, &graphs), Pass(*model, *bank, wide, nullptr), 0);
  // Two losses in one pass; a forward-only call.
  const std::vector<ForwardBackwardCall> mixed{Call(0, {5}, 1), Call(1, {6}, 2, "ppo")};
  ExpectSame(Pass(*model, *bank, mixed, &graphs), Pass(*model, *bank, mixed, nullptr), 0);
  std::vector<ForwardBackwardCall> fwd{Call(0, {5}, 1), Call(1, {6}, 2)};
  fwd[1].forward_only = true;
  const Outcome got = Pass(*model, *bank, fwd, &graphs);
  ExpectSame(got, Pass(*model, *bank, fwd, nullptr), 0);
  EXPECT_EQ(graphs.stats().passes, 0);
}

TEST(UniformPass, NonFiniteLossFailsThatCallAloneAndAddsNothingForIt) {
  auto model = Tiny("qwen3");
  auto bank = Bank(*model, 4, 4);
  BindSlots(*bank);
  std::vector<ForwardBackwardCall> calls{Call(0, {12}, 1, "importance_sampling"),
                                         Call(1, {9}, 2, "importance_sampling")};
  // exp(lp - q) overflows for q = -1e30.
  for (float& q : calls[1].data[0].loss_fn_inputs["logprobs"].f32) q = -1e30f;
  PassGraphs graphs(PassGraphs::Options{4096, false});
  const Outcome got = Pass(*model, *bank, calls, &graphs);
  EXPECT_EQ(graphs.stats().not_finite, 1);
  EXPECT_EQ(graphs.stats().passes, 0);
  ASSERT_TRUE(got.results[0].ok());
  EXPECT_FALSE(got.results[1].ok());
  // The good call's values and gradients are those of a pass without the bad one.
  const Outcome alone = Pass(*model, *bank, {calls[0]}, nullptr);
  ExpectSame(Outcome{{got.results[0]}, got.grads}, alone, 1e-5);  // another batch shape: rounding only
}

TEST(UniformPass, CudaGraphsReplayOverNewDataAndSlots) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto t = Transformer::FromTensors(TinyConfig("qwen3"), RandomWeights(TinyConfig("qwen3"), 1), at::Device(at::kCUDA, 0),
                                    at::kFloat);
  ASSERT_TRUE(t.ok()) << t.status().message();
  auto& model = *t.value();
  SlotBank bank(4, 4, model.device(), model.LoraTargets());
  BindSlots(bank);
  PassGraphs graphs(PassGraphs::Options{4096, true});
  // Three passes of one shape (3 sequences -> 4 x 64): the first runs
  // eagerly and captures, the next two replay with other slots and data.
  const std::vector<std::vector<ForwardBackwardCall>> passes{
      {Call(0, {17, 30}, 1), Call(1, {5}, 4)},
      {Call(2, {40}, 9), Call(0, {3, 60}, 2)},
      {Call(1, {8, 8}, 5), Call(0, {8}, 6)}};
  for (const auto& calls : passes) {
    const Outcome want = Pass(model, bank, calls, nullptr);
    const Outcome got = Pass(model, bank, calls, &graphs);
    ExpectSame(got, want, 1e-4);
  }
  EXPECT_EQ(graphs.stats().captures, 1);
  EXPECT_EQ(graphs.stats().replays, 2);
  EXPECT_GT(graphs.stats().pool_bytes, 0);

  // No room for a new shape: the pass keeps the packed path, nothing captured.
  PassGraphs tight(PassGraphs::Options{4096, true, [](int64_t) { return false; }});
  const Outcome want = Pass(model, bank, passes[0], nullptr);
  ExpectSame(Pass(model, bank, passes[0], &tight), want, 1e-5);  // attention backward may use atomics
  EXPECT_EQ(tight.stats().passes, 0);
  EXPECT_EQ(tight.stats().captures, 0);
}

}  // namespace
}  // namespace loom::engine
