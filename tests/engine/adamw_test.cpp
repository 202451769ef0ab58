// Per-slot AdamW: the batched row update against a scalar double-precision
// reference, global-norm clipping over a slot's trained targets, isolation
// between slots (non-finite skip, unstepped slots), and parameter checks.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "engine/train/cuda/adamw_kernels.h"
#endif

#include <cmath>
#include <tuple>

#include "engine/lora/slot_bank.h"
#include "engine/train/adamw.h"

namespace loom::engine::train {
namespace {

std::vector<double> ToVec(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kDouble).contiguous().cpu();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

// torch.optim.AdamW on one flat vector, in double, written out by hand.
struct RefAdamW {
  std::vector<double> p, m, v;
  int64_t t = 0;
  void Step(const std::vector<double>& g_in, const AdamParams& a, double scale) {
    ++t;
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = g_in[i] * scale;
      p[i] *= 1 - a.learning_rate * a.weight_decay;
      m[i] = a.beta1 * m[i] + (1 - a.beta1) * g;
      v[i] = a.beta2 * v[i] + (1 - a.beta2) * g * g;
      const double bc1 = 1 - std::pow(a.beta1, t), bc2 = 1 - std::pow(a.beta2, t);
      p[i] -= a.learning_rate / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + a.eps);
    }
  }
};

void ExpectNearVec(const std::vector<double>& got, const std::vector<double>& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], rel * std::max(1e-3, std::abs(want[i]))) << what << " element " << i;
}

TEST(AdamWRows, MatchesHandReferenceOverSeveralSteps) {
  at::manual_seed(3);
  at::Tensor param = at::randn({3, 4, 5});
  at::Tensor m = at::zeros_like(param), v = at::zeros_like(param);
  const at::Tensor untouched = param.select(0, 1).clone();
  AdamParams a0{1e-2, 0.9, 0.95, 1e-8, 0.1, 0};
  AdamParams a2{3e-3, 0.8, 0.99, 1e-12, 0.0, 0};
  RefAdamW r0{ToVec(param.select(0, 0)), std::vector<double>(20), std::vector<double>(20)};
  RefAdamW r2{ToVec(param.select(0, 2)), std::vector<double>(20), std::vector<double>(20)};
  for (int step = 1; step <= 4; ++step) {
    at::Tensor grad = at::randn({3, 4, 5});
    const double scale2 = 0.5;  // a clip factor for row 2
    AdamWRows rows = AdamWRows::Make({0, 2}, {a0, a2}, {step, step}, {1.0, scale2}, at::kCPU);
    AdamWUpdateRows(param, grad, m, v, rows);
    r0.Step(ToVec(grad.select(0, 0)), a0, 1.0);
    r2.Step(ToVec(grad.select(0, 2)), a2, scale2);
    ExpectNearVec(ToVec(param.select(0, 0)), r0.p, 1e-5, "row 0 param");
    ExpectNearVec(ToVec(m.select(0, 0)), r0.m, 1e-5, "row 0 exp_avg");
    ExpectNearVec(ToVec(v.select(0, 2)), r2.v, 1e-5, "row 2 exp_avg_sq");
    ExpectNearVec(ToVec(param.select(0, 2)), r2.p, 1e-5, "row 2 param");
  }
  EXPECT_TRUE(at::equal(param.select(0, 1), untouched));
  EXPECT_EQ(at::count_nonzero(m.select(0, 1)).item<int64_t>(), 0);
}

TEST(AdamWParams, RejectNamesTheField) {
  AdamParams p;
  p.beta1 = 1.0;
  Status s = ValidateAdamParams(p);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("beta1"), std::string::npos);
  p = AdamParams{};
  p.learning_rate = NAN;
  s = ValidateAdamParams(p);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("learning_rate"), std::string::npos);
  p = AdamParams{};
  p.grad_clip_norm = -1;
  EXPECT_FALSE(ValidateAdamParams(p).ok());
  EXPECT_TRUE(ValidateAdamParams(AdamParams{}).ok());
}

// A bank of three slots over three targets, one per group.
struct SlotOptimizerTest : ::testing::Test {
  SlotBank bank{3, 4, at::kCPU,
                {{"q", TargetGroup::kAttn, 6, 5}, {"gate", TargetGroup::kMlp, 4, 7}, {"lm_head", TargetGroup::kUnembed, 6, 9}}};
  SlotOptimizer opt{bank};

  void SetUp() override {
    LoraConfig all;
    all.rank = 2;
    all.alpha = 4;
    all.seed = 1;
    LoraConfig attn_only;
    attn_only.rank = 4;
    attn_only.seed = 2;
    attn_only.train_mlp = attn_only.train_unembed = false;
    ASSERT_TRUE(bank.Bind(0, all).ok());
    ASSERT_TRUE(bank.Bind(1, attn_only).ok());
    ASSERT_TRUE(bank.Bind(2, all).ok());
    at::manual_seed(5);
    c10::NoGradGuard ng;
    for (auto& t : bank.targets()) {
      // Nonzero B so that "rows < rank only" is visible, and gradients that
      // are zero outside each slot's rank (as autograd produces them).
      t.B.normal_();
      for (int s = 0; s < 3; ++s) t.B.select(0, s).narrow(1, bank.slot(s).config.rank, 4 - bank.slot(s).config.rank).zero_();
      t.A.mutable_grad().copy_(at::randn_like(t.A) * 0.1);
      t.B.mutable_grad().copy_(at::randn_like(t.B) * 0.1);
      for (int s = 0; s < 3; ++s) {
        const int r = bank.slot(s).config.rank;
        t.A.mutable_grad().select(0, s).narrow(0, r, 4 - r).zero_();
        t.B.mutable_grad().select(0, s).narrow(1, r, 4 - r).zero_();
      }
    }
  }
  // Flat values of slot s's trained rows (rank r) over its trained targets.
  std::vector<double> Slot(int s, bool grads) {
    std::vector<double> out;
    const int r = bank.slot(s).config.rank;
    for (auto& t : bank.targets()) {
      if (!bank.trains(s, t.group)) continue;
      for (auto a : {ToVec((grads ? t.A.grad() : t.A).select(0, s).narrow(0, 0, r)),
                     ToVec((grads ? t.B.grad() : t.B).select(0, s).narrow(1, 0, r))})
        out.insert(out.end(), a.begin(), a.end());
    }
    return out;
  }
};

TEST_F(SlotOptimizerTest, StepMatchesReferenceWithGlobalNormClipping) {
  const std::vector<double> g0 = Slot(0, true), g1 = Slot(1, true);
  RefAdamW r0{Slot(0, false), std::vector<double>(g0.size()), std::vector<double>(g0.size())};
  RefAdamW r1{Slot(1, false), std::vector<double>(g1.size()), std::vector<double>(g1.size())};
  double n0 = 0, n1 = 0;
  for (double g : g0) n0 += g * g;
  for (double g : g1) n1 += g * g;
  n0 = std::sqrt(n0);
  n1 = std::sqrt(n1);
  AdamParams p0{1e-2, 0.9, 0.95, 1e-12, 0.05, n0 / 3};  // clip active: scale ≈ 1/3
  AdamParams p1{2e-2, 0.85, 0.9, 1e-8, 0.0, 0.0};       // clip off
  const at::Tensor mlp_slot1 = bank.targets()[1].A.select(0, 1).clone();
  auto res = opt.Step(bank, {{0, p0}, {1, p1}});
  ASSERT_TRUE(res[0].ok() && res[1].ok());
  EXPECT_NEAR(res[0]->metrics["grad_norm"], n0, 1e-5 * n0);
  EXPECT_NEAR(res[1]->metrics["grad_norm"], n1, 1e-5 * n1);  // attn only: untrained groups excluded
  EXPECT_EQ(res[0]->metrics["step"], 1);
  EXPECT_FALSE(res[0]->skipped);
  r0.Step(g0, p0, (n0 / 3) / (n0 + 1e-6));
  r1.Step(g1, p1, 1.0);
  ExpectNearVec(Slot(0, false), r0.p, 1e-5, "slot 0");
  ExpectNearVec(Slot(1, false), r1.p, 1e-5, "slot 1");
  // Untrained group of slot 1 stays as it was; rows ≥ rank stay zero.
  EXPECT_TRUE(at::equal(bank.targets()[1].A.select(0, 1), mlp_slot1));
  EXPECT_EQ(at::count_nonzero(bank.targets()[0].A.select(0, 0).narrow(0, 2, 2)).item<int64_t>(), 0);
  EXPECT_EQ(at::count_nonzero(bank.targets()[0].B.select(0, 0).narrow(1, 2, 2)).item<int64_t>(), 0);
  // Stepped slots' gradients are zero; slot 2 keeps its own.
  EXPECT_EQ(at::count_nonzero(bank.targets()[0].A.grad().select(0, 0)).item<int64_t>(), 0);
  EXPECT_GT(at::count_nonzero(bank.targets()[0].A.grad().select(0, 2)).item<int64_t>(), 0);
  EXPECT_EQ(bank.slot(0).step, 1);
  EXPECT_EQ(bank.slot(2).step, 0);
  // A second step uses the slot's own bias correction (t = 2).
  const std::vector<double> g0b(g0.size(), 0.0);
  res = opt.Step(bank, {{0, p0}});
  r0.Step(g0b, p0, 1.0);
  ExpectNearVec(Slot(0, false), r0.p, 1e-5, "slot 0 step 2");
  EXPECT_EQ(res[0]->metrics["step"], 2);
}

TEST_F(SlotOptimizerTest, NonFiniteGradientSkipsOnlyThatSlot) {
  // Twin bank with the same state, where slot 1 steps alone.
  SlotBank twin{3, 4, at::kCPU,
                {{"q", TargetGroup::kAttn, 6, 5}, {"gate", TargetGroup::kMlp, 4, 7}, {"lm_head", TargetGroup::kUnembed, 6, 9}}};
  for (int s = 0; s < 3; ++s) ASSERT_TRUE(twin.Bind(s, bank.slot(s).config).ok());
  {
    c10::NoGradGuard ng;
    for (size_t i = 0; i < 3; ++i) {
      twin.targets()[i].A.copy_(bank.targets()[i].A);
      twin.targets()[i].B.copy_(bank.targets()[i].B);
      twin.targets()[i].A.mutable_grad().copy_(bank.targets()[i].A.grad().clone());
      twin.targets()[i].B.mutable_grad().copy_(bank.targets()[i].B.grad().clone());
    }
  }
  SlotOptimizer twin_opt{twin};
  bank.targets()[2].B.mutable_grad()[0][3][1] = NAN;  // slot 0, lm_head
  const at::Tensor a0 = bank.targets()[0].A.select(0, 0).clone();
  const at::Tensor a2 = bank.targets()[0].A.select(0, 2).clone();
  const at::Tensor g2 = bank.targets()[0].A.grad().select(0, 2).clone();
  AdamParams p{1e-2, 0.9, 0.95, 1e-12, 0.0, 1.0};
  auto res = opt.Step(bank, {{0, p}, {1, p}});
  auto alone = twin_opt.Step(twin, {{1, p}});
  ASSERT_TRUE(res[0].ok() && res[1].ok() && alone[0].ok());
  EXPECT_TRUE(res[0]->skipped);
  EXPECT_EQ(res[0]->metrics.count("grad_norm"), 0u);  // NaN never reaches JSON
  EXPECT_EQ(res[0]->metrics["step"], 0);
  EXPECT_EQ(bank.slot(0).step, 0);
  EXPECT_TRUE(at::equal(bank.targets()[0].A.select(0, 0), a0));
  for (auto& t : bank.targets()) {
    EXPECT_EQ(at::count_nonzero(at::nan_to_num(t.B.grad().select(0, 0), 1.0)).item<int64_t>(), 0) << t.module;
    EXPECT_EQ(at::count_nonzero(opt.a(0).exp_avg.select(0, 0)).item<int64_t>(), 0);
  }
  EXPECT_FALSE(res[1]->skipped);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::allclose(bank.targets()[i].A.select(0, 1), twin.targets()[i].A.select(0, 1), 1e-6, 1e-7));
    EXPECT_TRUE(at::allclose(bank.targets()[i].B.select(0, 1), twin.targets()[i].B.select(0, 1), 1e-6, 1e-7));
  }
  EXPECT_NEAR(res[1]->metrics["grad_norm"], alone[0]->metrics["grad_norm"], 1e-9);
  // Slot 2 was not in the call: weights and gradients untouched.
  EXPECT_TRUE(at::equal(bank.targets()[0].A.select(0, 2), a2));
  EXPECT_TRUE(at::equal(bank.targets()[0].A.grad().select(0, 2), g2));
}

TEST_F(SlotOptimizerTest, ErrorsFailOnlyTheirCallAndRepeatsStepTwice) {
  AdamParams bad;
  bad.beta2 = 1.5;
  bank.Release(1);
  auto res = opt.Step(bank, {{0, bad}, {1, AdamParams{}}, {7, AdamParams{}}, {2, AdamParams{}}, {2, AdamParams{}}});
  ASSERT_EQ(res.size(), 5u);
  EXPECT_FALSE(res[0].ok());
  EXPECT_NE(res[0].status().message().find("beta2"), std::string::npos);
  EXPECT_FALSE(res[1].ok());  // released slot
  EXPECT_FALSE(res[2].ok());
  EXPECT_NE(res[2].status().message().find("slot"), std::string::npos);
  ASSERT_TRUE(res[3].ok() && res[4].ok());
  EXPECT_EQ(res[3]->metrics["step"], 1);
  EXPECT_EQ(res[4]->metrics["step"], 2);
  EXPECT_EQ(res[4]->metrics["grad_norm"], 0.0);  // the first step zeroed the gradients
  EXPECT_EQ(bank.slot(0).step, 0);
}


// The multi-tensor (_foreach_*) path against the row path on twin banks:
// three rounds with clipping, a rank-4 attn-only slot and a slot listed twice.
// The foreach path on `device` (on CUDA, the AdamW kernel: adamw_kernels.h)
// against the CPU rows path, over three rounds of four calls.
void ExpectForeachMatchesRows(SlotOptimizerTest& f, at::Device device) {
  SlotBank& bank = f.bank;
  SlotOptimizer& opt = f.opt;
  SlotBank twin{3, 4, device,
                {{"q", TargetGroup::kAttn, 6, 5}, {"gate", TargetGroup::kMlp, 4, 7}, {"lm_head", TargetGroup::kUnembed, 6, 9}}};
  for (int s = 0; s < 3; ++s) ASSERT_TRUE(twin.Bind(s, bank.slot(s).config).ok());
  SlotOptimizer twin_opt{twin};
  ASSERT_EQ(opt.path(), SlotOptimizer::Path::kRows);  // CPU default: the reference
  twin_opt.set_path(SlotOptimizer::Path::kForeach);
  AdamParams p0{1e-2, 0.9, 0.95, 1e-12, 0.05, 0.05};  // clip active
  AdamParams p1{2e-2, 0.85, 0.9, 1e-8, 0.0, 0.0};
  for (int round = 0; round < 3; ++round) {
    {
      c10::NoGradGuard ng;
      at::manual_seed(100 + round);
      for (size_t i = 0; i < 3; ++i) {
        auto& t = bank.targets()[i];
        if (round > 0) {  // fresh gradients, zero outside each slot's rank
          t.A.mutable_grad().copy_(at::randn_like(t.A) * 0.1);
          t.B.mutable_grad().copy_(at::randn_like(t.B) * 0.1);
          for (int s = 0; s < 3; ++s) {
            const int r = bank.slot(s).config.rank;
            t.A.mutable_grad().select(0, s).narrow(0, r, 4 - r).zero_();
            t.B.mutable_grad().select(0, s).narrow(1, r, 4 - r).zero_();
          }
        }
        if (round == 0) {
          twin.targets()[i].A.copy_(t.A);
          twin.targets()[i].B.copy_(t.B);
        }
        twin.targets()[i].A.mutable_grad().copy_(t.A.grad().clone());
        twin.targets()[i].B.mutable_grad().copy_(t.B.grad().clone());
      }
    }
    const std::vector<OptimStepCall> calls{{0, p0}, {1, p1}, {2, p1}, {0, p0}};
    auto want = opt.Step(bank, calls);
    auto got = twin_opt.Step(twin, calls);
    for (size_t c = 0; c < calls.size(); ++c) {
      ASSERT_TRUE(want[c].ok() && got[c].ok());
      EXPECT_NEAR(got[c]->metrics["grad_norm"], want[c]->metrics["grad_norm"],
                  1e-6 * std::max(1e-3, want[c]->metrics["grad_norm"]));
      EXPECT_EQ(got[c]->metrics["step"], want[c]->metrics["step"]);
    }
    for (size_t i = 0; i < 3; ++i) {
      const auto& w = bank.targets()[i];
      const auto& g = twin.targets()[i];
      ExpectNearVec(ToVec(g.A.cpu()), ToVec(w.A), 1e-6, "A");
      ExpectNearVec(ToVec(g.B.cpu()), ToVec(w.B), 1e-6, "B");
      ExpectNearVec(ToVec(twin_opt.b(i).exp_avg.cpu()), ToVec(opt.b(i).exp_avg), 1e-6, "exp_avg");
      ExpectNearVec(ToVec(twin_opt.a(i).exp_avg_sq.cpu()), ToVec(opt.a(i).exp_avg_sq), 1e-6, "exp_avg_sq");
      EXPECT_EQ(at::count_nonzero(g.A.grad()).item<int64_t>(), 0);
    }
  }
  // The update moved the weights at all (the comparison is not vacuous).
  EXPECT_GT(bank.slot(0).step, 3);
}

TEST_F(SlotOptimizerTest, ForeachPathMatchesRowPath) { ExpectForeachMatchesRows(*this, at::kCPU); }

TEST_F(SlotOptimizerTest, CudaKernelMatchesRowPath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  ExpectForeachMatchesRows(*this, at::Device(at::kCUDA, 0));
}

}  // namespace
}  // namespace loom::engine::train

namespace loom::engine::train {
namespace {

// Both update paths: a step whose result would not be finite is not taken
// (weights, moments, gradients and step of the slot unchanged, bit for bit)
// and fails its call only; the slot stepped beside it gets exactly what it
// gets when stepped alone.
TEST_F(SlotOptimizerTest, StepThatWouldOverflowIsRefusedOnBothPaths) {
  AdamParams huge_lr;
  huge_lr.learning_rate = 1e300;
  AdamParams huge_wd;
  huge_wd.weight_decay = 1e300;
  AdamParams sane;
  sane.learning_rate = 1e-2;
  for (SlotOptimizer::Path path : {SlotOptimizer::Path::kRows, SlotOptimizer::Path::kForeach}) {
    // Twins: one steps all three slots, the other slot 1 alone.
    auto copy = [&](SlotBank& to) {
      c10::NoGradGuard ng;
      for (int s = 0; s < 3; ++s) ASSERT_TRUE(to.Bind(s, bank.slot(s).config).ok());
      for (size_t i = 0; i < 3; ++i) {
        to.targets()[i].A.copy_(bank.targets()[i].A);
        to.targets()[i].B.copy_(bank.targets()[i].B);
        to.targets()[i].A.mutable_grad().copy_(bank.targets()[i].A.grad().clone());
        to.targets()[i].B.mutable_grad().copy_(bank.targets()[i].B.grad().clone());
      }
    };
    SlotBank all{3, 4, at::kCPU, {{"q", TargetGroup::kAttn, 6, 5}, {"gate", TargetGroup::kMlp, 4, 7},
                                  {"lm_head", TargetGroup::kUnembed, 6, 9}}};
    SlotBank alone{3, 4, at::kCPU, {{"q", TargetGroup::kAttn, 6, 5}, {"gate", TargetGroup::kMlp, 4, 7},
                                    {"lm_head", TargetGroup::kUnembed, 6, 9}}};
    copy(all);
    copy(alone);
    SlotOptimizer opt_all{all}, opt_alone{alone};
    opt_all.set_path(path);
    opt_alone.set_path(path);
    std::vector<at::Tensor> before;
    for (int s : {0, 2})
      for (size_t i = 0; i < 3; ++i)
        for (const at::Tensor& t : {all.targets()[i].A, all.targets()[i].B, all.targets()[i].A.grad(),
                                    all.targets()[i].B.grad(), opt_all.a(i).exp_avg, opt_all.b(i).exp_avg_sq})
          before.push_back(t.select(0, s).clone());
    auto res = opt_all.Step(all, {{0, huge_lr}, {1, sane}, {2, huge_wd}});
    auto ref = opt_alone.Step(alone, {{1, sane}});
    const char* name = path == SlotOptimizer::Path::kRows ? "rows" : "foreach";
    for (size_t c : {0u, 2u}) {
      ASSERT_FALSE(res[c].ok()) << name << " call " << c;
      EXPECT_EQ(res[c].status().code(), Code::kInvalidArgument);
      EXPECT_NE(res[c].status().message().find("non-finite"), std::string::npos) << res[c].status().message();
    }
    ASSERT_TRUE(res[1].ok() && ref[0].ok()) << name;
    size_t k = 0;
    for (int s : {0, 2})
      for (size_t i = 0; i < 3; ++i)
        for (const at::Tensor& t : {all.targets()[i].A, all.targets()[i].B, all.targets()[i].A.grad(),
                                    all.targets()[i].B.grad(), opt_all.a(i).exp_avg, opt_all.b(i).exp_avg_sq})
          EXPECT_TRUE(at::equal(t.select(0, s), before[k++])) << name << " slot " << s << " target " << i;
    EXPECT_EQ(all.slot(0).step, 0);
    EXPECT_EQ(all.slot(2).step, 0);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::equal(all.targets()[i].A.select(0, 1), alone.targets()[i].A.select(0, 1))) << name;
      EXPECT_TRUE(at::equal(all.targets()[i].B.select(0, 1), alone.targets()[i].B.select(0, 1))) << name;
    }
  }
}

// The multi-tensor path checks each slot's flat rows as one entry: when a
// neighbouring slot with the same factors cannot step, the stable one still
// steps, exactly as it would alone.
TEST_F(SlotOptimizerTest, ForeachRefusesOnlyTheUnstableNeighbourSlot) {
  AdamParams sane;
  sane.learning_rate = 1e-2;  // no clipping: both slots share every factor
  sane.eps = 0;
  auto make = [] {
    return SlotBank{2, 4, at::kCPU, {{"q", TargetGroup::kAttn, 6, 5}, {"gate", TargetGroup::kMlp, 4, 7}}};
  };
  SlotBank both = make(), alone = make();
  for (SlotBank* b : {&both, &alone}) {
    c10::NoGradGuard ng;
    for (int s = 0; s < 2; ++s) ASSERT_TRUE(b->Bind(s, bank.slot(s).config).ok());
    for (size_t i = 0; i < 2; ++i) {
      b->targets()[i].A.copy_(bank.targets()[i].A.narrow(0, 0, 2));
      b->targets()[i].B.copy_(bank.targets()[i].B.narrow(0, 0, 2));
      b->targets()[i].A.mutable_grad().copy_(bank.targets()[i].A.grad().narrow(0, 0, 2).clone());
      b->targets()[i].B.mutable_grad().copy_(bank.targets()[i].B.grad().narrow(0, 0, 2).clone());
    }
  }
  // Slot 0's gradient is finite and nonzero, but its square underflows
  // fp32: with eps 0 the update divides the first moment by zero.
  both.targets()[0].A.mutable_grad().select(0, 0).fill_(1e-30);
  SlotOptimizer opt_both{both}, opt_alone{alone};
  opt_both.set_path(SlotOptimizer::Path::kForeach);
  opt_alone.set_path(SlotOptimizer::Path::kForeach);
  auto res = opt_both.Step(both, {{0, sane}, {1, sane}});
  auto ref = opt_alone.Step(alone, {{1, sane}});
  ASSERT_FALSE(res[0].ok());
  EXPECT_NE(res[0].status().message().find("non-finite"), std::string::npos) << res[0].status().message();
  ASSERT_TRUE(res[1].ok()) << res[1].status().message();
  ASSERT_TRUE(ref[0].ok());
  EXPECT_EQ(both.slot(0).step, 0);
  EXPECT_EQ(both.slot(1).step, 1);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(both.targets()[i].A.select(0, 1), alone.targets()[i].A.select(0, 1))) << i;
    EXPECT_TRUE(at::equal(both.targets()[i].B.select(0, 1), alone.targets()[i].B.select(0, 1))) << i;
  }
}

}  // namespace
}  // namespace loom::engine::train

namespace loom::engine::train {
namespace {

// Moments on the host, staged through a device buffer one slot at a time:
// the same numbers as the resident multi-tensor path, bit for bit, over
// repeated, refused and out-of-range calls, and the moments a checkpoint
// reads (the a()/b() views) are the host's, up to date after each Step.
TEST_F(SlotOptimizerTest, HostMomentsMatchResidentMomentsBitForBit) {
  SlotBank twin{3, 4, at::kCPU,
                {{"q", TargetGroup::kAttn, 6, 5}, {"gate", TargetGroup::kMlp, 4, 7}, {"lm_head", TargetGroup::kUnembed, 6, 9}}};
  for (int s = 0; s < 3; ++s) ASSERT_TRUE(twin.Bind(s, bank.slot(s).config).ok());
  SlotOptimizer host{twin, /*moments_on_host=*/true, /*stage_bytes=*/1};
  ASSERT_TRUE(host.moments_on_host());
  ASSERT_EQ(host.stage_rows(), 1);  // every chunk is one slot
  ASSERT_EQ(host.path(), SlotOptimizer::Path::kForeach);
  EXPECT_THROW(host.set_path(SlotOptimizer::Path::kRows), std::invalid_argument);
  opt.set_path(SlotOptimizer::Path::kForeach);
  AdamParams p0{1e-2, 0.9, 0.95, 1e-12, 0.05, 0.05};
  AdamParams p1{2e-2, 0.85, 0.9, 1e-8, 0.0, 0.0};
  AdamParams blowup{1e38, 0.9, 0.95, 1e-30, 0.0, 0.0};  // refused: the weights would overflow
  for (int round = 0; round < 3; ++round) {
    {
      c10::NoGradGuard ng;
      at::manual_seed(200 + round);
      for (size_t i = 0; i < 3; ++i) {
        auto& t = bank.targets()[i];
        if (round > 0) {
          t.A.mutable_grad().copy_(at::randn_like(t.A) * 0.1);
          t.B.mutable_grad().copy_(at::randn_like(t.B) * 0.1);
        }
        if (round == 0) {
          twin.targets()[i].A.copy_(t.A);
          twin.targets()[i].B.copy_(t.B);
        }
        twin.targets()[i].A.mutable_grad().copy_(t.A.grad().clone());
        twin.targets()[i].B.mutable_grad().copy_(t.B.grad().clone());
      }
    }
    const std::vector<OptimStepCall> calls{{0, p0}, {1, p1}, {7, p0}, {2, round == 1 ? blowup : p1}, {0, p0}};
    auto want = opt.Step(bank, calls);
    auto got = host.Step(twin, calls);
    for (size_t c = 0; c < calls.size(); ++c) {
      ASSERT_EQ(got[c].ok(), want[c].ok()) << "call " << c;
      if (!want[c].ok()) {
        EXPECT_EQ(got[c].status().message(), want[c].status().message());
        continue;
      }
      EXPECT_EQ(got[c]->metrics["grad_norm"], want[c]->metrics["grad_norm"]);
      EXPECT_EQ(got[c]->metrics["step"], want[c]->metrics["step"]);
    }
    EXPECT_FALSE(want[2].ok());                 // slot 7 is out of range
    EXPECT_EQ(want[3].ok(), round != 1);        // the blow-up is refused
    for (size_t i = 0; i < 3; ++i) {
      const auto& w = bank.targets()[i];
      const auto& g = twin.targets()[i];
      EXPECT_TRUE(at::equal(g.A, w.A));
      EXPECT_TRUE(at::equal(g.B, w.B));
      for (const auto& [h, r] : {std::pair{&host.a(i), &opt.a(i)}, std::pair{&host.b(i), &opt.b(i)}}) {
        EXPECT_TRUE(h->exp_avg.device().is_cpu());
        EXPECT_TRUE(at::equal(h->exp_avg, r->exp_avg));
        EXPECT_TRUE(at::equal(h->exp_avg_sq, r->exp_avg_sq));
      }
    }
  }
  EXPECT_GT(bank.slot(0).step, 3);
  EXPECT_GT(at::count_nonzero(host.a(0).exp_avg_sq).item<int64_t>(), 0);  // not vacuous
  host.Reset(0);
  opt.Reset(0);
  EXPECT_TRUE(at::equal(host.a(0).exp_avg, opt.a(0).exp_avg));
}


#if LOOM_CUDA_KERNELS
// The gradient norms' sums of squares on CUDA (SquaredSums), straight from
// strided rows by slot id, on the 16-byte path and the element-wise one,
// against the fp64 sum of squares of the gathered rows.
TEST(SquaredSums, CudaKernelIsTheFp64SumOfSquares) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Tensor slots = at::tensor(std::vector<int64_t>{4, 1, 1}, at::kLong).to(at::kCUDA);
  for (const auto& [ld, begin, len] : {std::tuple<int64_t, int64_t, int64_t>{4096, 0, 4000}, {4099, 3, 1001}}) {
    const at::Tensor x = at::randn({5, ld}, at::TensorOptions().device(at::kCUDA)) * 10;
    at::Tensor partial = at::empty({3, cuda::SquaredSumBlocks(len)}, x.options().dtype(at::kDouble));
    cuda::SquaredSums(x.data_ptr<float>() + begin, ld, slots.data_ptr<int64_t>(), 3, len, partial.data_ptr<double>(),
                      c10::cuda::getCurrentCUDAStream().stream());
    const at::Tensor got = partial.sum(1).cpu();
    const at::Tensor want = x.narrow(1, begin, len).index_select(0, slots).to(at::kDouble).square().sum(1).cpu();
    for (int u = 0; u < 3; ++u)
      EXPECT_NEAR(got[u].item<double>(), want[u].item<double>(), 1e-12 * want[u].item<double>()) << ld << " " << u;
  }
}
#endif

}  // namespace
}  // namespace loom::engine::train
