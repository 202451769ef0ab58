// Tinker's five losses (spec §9): values against hand computations,
// gradients against finite differences and the spec's closed forms, packing
// of inputs, and the validation messages.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "engine/train/loss_spec.h"
#include "engine/train/losses.h"

namespace loom::engine::train {
namespace {

constexpr int64_t kVocab = 50;

LossSpec Spec(const std::string& name, std::map<std::string, double> config = {}) {
  auto r = LossSpec::Parse(name, config);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.value();
}

struct Case {
  std::vector<double> lp, q, adv, w;
};

Case RandomCase(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> lp(-4.0, -0.05), d(-0.6, 0.6), a(-2.0, 2.0), w(-1.5, 2.0);
  Case c;
  for (int i = 0; i < n; ++i) {
    c.lp.push_back(lp(rng));
    c.q.push_back(c.lp.back() - d(rng));  // ratio in [e^-0.6, e^0.6]: both clip sides are hit
    c.adv.push_back(a(rng));
    c.w.push_back(w(rng));
  }
  return c;
}

at::Tensor D(const std::vector<double>& v) { return at::tensor(v, at::kDouble); }

LossInputs Inputs(const Case& c) {
  LossInputs in;
  in.weights = D(c.w);
  in.sampler_logprobs = D(c.q);
  in.advantages = D(c.adv);
  return in;
}

// The spec's per-token loss, written out with scalars.
double HandLoss(const LossSpec& s, double lp, double q, double a, double w) {
  const double r = std::exp(lp - q);
  switch (s.kind) {
    case LossKind::kCrossEntropy: return -lp * w;
    case LossKind::kImportanceSampling: return -r * a;
    case LossKind::kPpo: return -std::min(r * a, std::clamp(r, s.clip_low, s.clip_high) * a);
    case LossKind::kCispo: return -std::clamp(r, s.clip_low, s.clip_high) * lp * a;
    case LossKind::kDro: return -(lp * a - 0.5 * s.beta * (lp - q) * (lp - q));
  }
  return 0;
}

// The spec's d(loss)/d(lp) (§9, "Gradient wrt lp_t").
double HandGrad(const LossSpec& s, double lp, double q, double a, double w) {
  const double r = std::exp(lp - q);
  switch (s.kind) {
    case LossKind::kCrossEntropy: return -w;
    case LossKind::kImportanceSampling: return -r * a;
    case LossKind::kPpo: {
      const double clipped = std::clamp(r, s.clip_low, s.clip_high);
      return r * a <= clipped * a ? -r * a : 0.0;
    }
    case LossKind::kCispo: return -std::clamp(r, s.clip_low, s.clip_high) * a;
    case LossKind::kDro: return -a + s.beta * (lp - q);
  }
  return 0;
}

const std::vector<std::string> kLosses = {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"};

TEST(LossSpec, DefaultsFollowTheSpec) {
  EXPECT_DOUBLE_EQ(Spec("ppo").clip_low, 0.8);
  EXPECT_DOUBLE_EQ(Spec("ppo").clip_high, 1.2);
  EXPECT_DOUBLE_EQ(Spec("cispo").clip_low, 0.0);
  EXPECT_DOUBLE_EQ(Spec("cispo").clip_high, 4.0);
  EXPECT_DOUBLE_EQ(Spec("dro").beta, 0.05);
  LossSpec p = Spec("ppo", {{"clip_low_threshold", 0.5}, {"clip_high_threshold", 2.0}});
  EXPECT_DOUBLE_EQ(p.clip_low, 0.5);
  EXPECT_DOUBLE_EQ(p.clip_high, 2.0);
  EXPECT_DOUBLE_EQ(Spec("dro", {{"beta", 0.3}}).beta, 0.3);
}

TEST(LossSpec, RejectsUnknownLossAndKeys) {
  auto r = LossSpec::Parse("mse", {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("loss_fn"), std::string::npos);
  EXPECT_NE(r.status().message().find("mse"), std::string::npos);
  r = LossSpec::Parse("cross_entropy", {{"beta", 1.0}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("loss_fn_config"), std::string::npos);
  EXPECT_NE(r.status().message().find("beta"), std::string::npos);
  r = LossSpec::Parse("ppo", {{"clip_eps", 0.2}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("clip_eps"), std::string::npos);
  r = LossSpec::Parse("ppo", {{"clip_low_threshold", 1.5}});  // above the default high bound
  EXPECT_FALSE(r.ok());
  r = LossSpec::Parse("dro", {{"beta", NAN}});
  EXPECT_FALSE(r.ok());
}

TEST(Losses, ValuesMatchHandComputation) {
  const Case c = RandomCase(64, 7);
  for (const auto& name : kLosses) {
    LossSpec s = Spec(name);
    at::Tensor elem = ElementwiseLoss(s, D(c.lp), Inputs(c));
    ASSERT_EQ(elem.sizes(), at::IntArrayRef({64})) << name;
    double total = 0;
    for (int i = 0; i < 64; ++i) {
      const double want = HandLoss(s, c.lp[i], c.q[i], c.adv[i], c.w[i]);
      EXPECT_NEAR(elem[i].item<double>(), want, 1e-12) << name << " token " << i;
      total += want;
    }
    // Summed, not averaged.
    EXPECT_NEAR(elem.sum().item<double>(), total, 1e-10) << name;
  }
}

TEST(Losses, PpoAndCispoClipBothSides) {
  // Hand-picked ratios below, inside and above the bounds, both signs of A.
  LossSpec ppo = Spec("ppo");
  const std::vector<double> r = {0.5, 1.0, 1.5, 0.5, 1.5};
  const std::vector<double> a = {1.0, 1.0, 1.0, -1.0, -1.0};
  Case c;
  for (size_t i = 0; i < r.size(); ++i) {
    c.q.push_back(-1.0);
    c.lp.push_back(-1.0 + std::log(r[i]));
    c.adv.push_back(a[i]);
    c.w.push_back(1.0);
  }
  at::Tensor elem = ElementwiseLoss(ppo, D(c.lp), Inputs(c));
  // min(r·A, clip(r)·A): A>0 → min(0.5,0.8)=0.5, 1.0, min(1.5,1.2)=1.2; A<0 → min(-0.5,-0.8)=-0.8, min(-1.5,-1.2)=-1.5
  const std::vector<double> want = {-0.5, -1.0, -1.2, 0.8, 1.5};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(elem[i].item<double>(), want[i], 1e-12) << i;
  LossSpec cispo = Spec("cispo", {{"clip_low_threshold", 0.9}, {"clip_high_threshold", 1.1}});
  elem = ElementwiseLoss(cispo, D(c.lp), Inputs(c));
  const std::vector<double> clip = {0.9, 1.0, 1.1, 0.9, 1.1};
  for (size_t i = 0; i < clip.size(); ++i)
    EXPECT_NEAR(elem[i].item<double>(), -clip[i] * c.lp[i] * a[i], 1e-12) << i;
}

TEST(Losses, GradientsMatchFiniteDifferencesAndTheSpec) {
  const Case c = RandomCase(40, 11);
  const double h = 1e-6;
  for (const auto& name : kLosses) {
    LossSpec s = Spec(name);
    at::Tensor lp = D(c.lp).requires_grad_();
    ElementwiseLoss(s, lp, Inputs(c)).sum().backward();
    at::Tensor grad = lp.grad();
    for (int i = 0; i < 40; ++i) {
      // Keep away from PPO's kinks, where the derivative is one-sided.
      const double r = std::exp(c.lp[i] - c.q[i]);
      if (s.kind == LossKind::kPpo && (std::abs(r - s.clip_low) < 1e-4 || std::abs(r - s.clip_high) < 1e-4)) continue;
      // Central difference of the summed loss. CISPO's clip factor is a
      // stop-gradient, so its objective is differenced with the factor held
      // at the current point.
      auto f = [&](double x) {
        if (s.kind == LossKind::kCispo) return -std::clamp(r, s.clip_low, s.clip_high) * x * c.adv[i];
        return HandLoss(s, x, c.q[i], c.adv[i], c.w[i]);
      };
      const double fd = (f(c.lp[i] + h) - f(c.lp[i] - h)) / (2 * h);
      const double g = grad[i].item<double>();
      EXPECT_NEAR(g, fd, 1e-6 * std::max(1.0, std::abs(fd))) << name << " token " << i;
      EXPECT_NEAR(g, HandGrad(s, c.lp[i], c.q[i], c.adv[i], c.w[i]), 1e-12) << name << " token " << i;
    }
  }
}

TEST(Losses, CrossEntropyTopKAndRealWeights) {
  // (N, K) targets: L = Σ_t Σ_k −lp[t,k]·w[t,k], with negative and fractional weights.
  at::Tensor lp = at::tensor(std::vector<double>{-0.1, -2.0, -3.0, -0.7, -1.1, -5.0}, at::kDouble).view({2, 3});
  LossInputs in;
  in.weights = at::tensor(std::vector<double>{0.7, 0.2, 0.1, -1.0, 0.25, 0.0}, at::kDouble).view({2, 3});
  at::Tensor elem = ElementwiseLoss(Spec("cross_entropy"), lp, in);
  const double want = 0.1 * 0.7 + 2.0 * 0.2 + 3.0 * 0.1 + 0.7 * -1.0 + 1.1 * 0.25 + 0.0;
  EXPECT_NEAR(elem.sum().item<double>(), want, 1e-12);
  EXPECT_EQ(elem.sizes(), lp.sizes());
}

Datum CeDatum(std::vector<int32_t> tokens, std::vector<int64_t> targets, std::vector<int64_t> shape,
              std::vector<float> weights = {}) {
  Datum d;
  d.tokens = std::move(tokens);
  Array t = Array::Ints(std::move(targets));
  t.shape = shape;
  d.loss_fn_inputs["target_tokens"] = t;
  if (!weights.empty()) {
    Array w = Array::Floats(std::move(weights));
    w.shape = shape;
    d.loss_fn_inputs["weights"] = w;
  }
  return d;
}

TEST(Losses, PackingPadsTopKAndDefaultsWeightsToOne) {
  Datum a = CeDatum({1, 2}, {3, 4}, {2});  // no weights → 1
  Datum b = CeDatum({5}, {6, 7, 8}, {1, 3}, {0.5f, -0.25f, 2.0f});
  std::vector<const Datum*> data = {&a, &b};
  at::Tensor t = PackTargets(data, 3);
  ASSERT_EQ(t.sizes(), at::IntArrayRef({3, 3}));
  std::vector<int64_t> want_t = {3, 0, 0, 4, 0, 0, 6, 7, 8};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(t.view(-1)[i].item<int64_t>(), want_t[i]) << i;
  LossInputs in = PackLossInputs(Spec("cross_entropy"), data, 3, at::kCPU);
  std::vector<float> want_w = {1, 0, 0, 1, 0, 0, 0.5f, -0.25f, 2.0f};
  for (int i = 0; i < 9; ++i) EXPECT_FLOAT_EQ(in.weights.view(-1)[i].item<float>(), want_w[i]) << i;
  at::Tensor flat = PackTargets({&a}, 0);
  EXPECT_EQ(flat.dim(), 1);
  EXPECT_EQ(flat[1].item<int64_t>(), 4);
}

// Validation: each bad input names the datum and the field.
void ExpectInvalid(const ForwardBackwardCall& call, const std::vector<std::string>& words, int64_t ctx = 0) {
  Status s = ValidateCallData(call, kVocab, ctx);
  ASSERT_FALSE(s.ok()) << "accepted; expected mention of " << words[0];
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  for (const auto& w : words) EXPECT_NE(s.message().find(w), std::string::npos) << s.message() << " lacks " << w;
}

ForwardBackwardCall RlCall(const std::string& loss) {
  ForwardBackwardCall call;
  call.loss_fn = loss;
  Datum ok;
  ok.tokens = {1, 2, 3};
  ok.loss_fn_inputs["target_tokens"] = Array::Ints({2, 3, 4});
  ok.loss_fn_inputs["logprobs"] = Array::Floats({-1, -1, -1});
  ok.loss_fn_inputs["advantages"] = Array::Floats({1, 0, -1});
  call.data = {ok, ok};
  return call;
}

TEST(Validation, AcceptsWellFormedCalls) {
  ForwardBackwardCall ce;
  ce.data = {CeDatum({1, 2}, {2, 3}, {2}), CeDatum({1}, {2, 3}, {1, 2}, {0.5f, -0.5f})};
  EXPECT_TRUE(ValidateCallData(ce, kVocab, 0).ok()) << ValidateCallData(ce, kVocab, 0).message();
  for (const auto& l : {"importance_sampling", "ppo", "cispo", "dro"}) {
    Status s = ValidateCallData(RlCall(l), kVocab, 3);
    EXPECT_TRUE(s.ok()) << l << ": " << s.message();
  }
}

TEST(Validation, MessagesNameTheDatumAndField) {
  ForwardBackwardCall call = RlCall("ppo");
  call.data[1].loss_fn_inputs["advantages"] = Array::Floats({1, 2});
  ExpectInvalid(call, {"data[1]", "advantages", "2", "3"});

  call = RlCall("importance_sampling");
  call.data[1].loss_fn_inputs.erase("logprobs");
  ExpectInvalid(call, {"data[1]", "logprobs", "missing"});

  call = RlCall("dro");
  call.data[0].loss_fn_inputs["target_tokens"] = Array::Ints({2, 3, kVocab});
  ExpectInvalid(call, {"data[0]", "target_tokens", "vocabulary"});

  call = RlCall("dro");
  call.data[1].tokens = {1, -4, 2};
  ExpectInvalid(call, {"data[1]", "model_input", "vocabulary"});

  call = RlCall("cispo");
  call.data[1].tokens.clear();
  ExpectInvalid(call, {"data[1]", "empty"});

  call = RlCall("cispo");
  ExpectInvalid(call, {"data[0]", "context window", "2"}, 2);

  call = RlCall("cispo");
  call.data[0].loss_fn_inputs["weights"] = Array::Floats({1, 1, 1});
  ExpectInvalid(call, {"data[0]", "weights", "unknown"});

  call = RlCall("ppo");
  call.data[1].loss_fn_inputs["logprobs"] = Array::Floats({-1, NAN, -1});
  ExpectInvalid(call, {"data[1]", "logprobs", "finite"});

  call = RlCall("ppo");
  call.loss_fn = "grpo";
  ExpectInvalid(call, {"loss_fn", "grpo"});

  call = RlCall("ppo");
  call.loss_fn_config["beta"] = 0.1;
  ExpectInvalid(call, {"loss_fn_config", "beta"});

  ForwardBackwardCall ce;
  ce.data = {CeDatum({1, 2}, {2, 3}, {2}, {1.0f}), CeDatum({1}, {2}, {1})};
  ce.data[0].loss_fn_inputs["weights"].shape = {1};
  ExpectInvalid(ce, {"data[0]", "weights"});

  ce.data = {CeDatum({1, 2}, {2, 3}, {2}), CeDatum({1}, {2, 3}, {1, 2}, {0.5f, 0.5f})};
  ce.data[1].loss_fn_inputs["weights"].shape = {2, 1};
  ExpectInvalid(ce, {"data[1]", "weights"});

  ce.data = {CeDatum({1, 2}, {2, 3}, {2})};
  ce.data[0].loss_fn_inputs["target_tokens"].dtype = Array::DType::kFloat32;
  ce.data[0].loss_fn_inputs["target_tokens"].f32 = {2, 3};
  ExpectInvalid(ce, {"data[0]", "target_tokens", "int64"});

  ForwardBackwardCall rl2d = RlCall("importance_sampling");
  rl2d.data[0].loss_fn_inputs["target_tokens"] = CeDatum({1, 2, 3}, {1, 2, 3, 4, 5, 6}, {3, 2}).loss_fn_inputs["target_tokens"];
  ExpectInvalid(rl2d, {"data[0]", "target_tokens", "shape"});
}

}  // namespace
}  // namespace loom::engine::train
