// The trainer's memory levers against their plain references: the lean
// RMSNorm, SwiGLU, RoPE and split nodes (same forward bits, autograd's gradients to
// rounding), layer recomputation (the same values and gradients as keeping
// every activation), and, on CUDA, the bf16 trainer's gap to the fp32
// reference, printed for docs/compatibility.md.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <tuple>
#include <vector>

#include "engine/model/attention.h"
#include "engine/model/lean_ops.h"
#include "tiny_model.h"

namespace loom::engine {
namespace {

std::vector<at::Device> Devices() {
  std::vector<at::Device> d{at::kCPU};
  if (at::hasCUDA()) d.emplace_back(at::kCUDA, 0);
  return d;
}

// The lean forward against the plain ops': bit for bit on the CPU; on CUDA
// the fused kernels sum a row in another order (and round once where the
// plain ops round once), so within one rounding of the dtype.
void ExpectSameForward(const at::Tensor& lean, const at::Tensor& plain, const at::Device device, at::ScalarType dtype) {
  if (device.is_cpu()) {
    EXPECT_TRUE(at::equal(plain, lean)) << dtype;
    return;
  }
  EXPECT_LT(RelDiff(lean.to(at::kFloat), plain.to(at::kFloat)), dtype == at::kFloat ? 1e-6 : 1e-2) << dtype;
}

// Value and input gradient of f(x) for the upstream gradient g.
std::pair<at::Tensor, at::Tensor> ValueAndGrad(const std::function<at::Tensor(const at::Tensor&)>& f,
                                               const at::Tensor& x0, const at::Tensor& g) {
  const at::Tensor x = x0.detach().clone().requires_grad_(true);
  const at::Tensor y = f(x);
  y.backward(g);
  return {y.detach(), x.grad()};
}

TEST(LeanOps, RmsNormHasThePlainValuesAndAutogradsGradient) {
  for (const at::Device device : Devices())
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16})
      for (const std::vector<int64_t>& shape : {std::vector<int64_t>{37, 48}, std::vector<int64_t>{9, 4, 16}}) {
        at::manual_seed(3);
        const auto opts = at::TensorOptions().device(device);
        const at::Tensor x = (2.0 * at::randn(shape, opts)).to(dtype);
        const at::Tensor w = (1.0 + 0.2 * at::randn({shape.back()}, opts)).to(dtype);
        const at::Tensor g = at::randn(shape, opts).to(dtype);
        const auto [y_plain, gx_plain] = ValueAndGrad([&](const at::Tensor& v) { return RmsNormPlain(v, w, 1e-6); }, x, g);
        const auto [y_lean, gx_lean] = ValueAndGrad([&](const at::Tensor& v) { return RmsNormLean(v, w, 1e-6); }, x, g);
        ExpectSameForward(y_lean, y_plain, device, dtype);
        // fp32: summation order only; bf16: one rounding of the result either way.
        const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
        EXPECT_LT(RelDiff(gx_lean.to(at::kFloat), gx_plain.to(at::kFloat)), tol) << device << " " << dtype;
        EXPECT_GT(gx_plain.abs().max().item<double>(), 1e-3);
      }
}

TEST(LeanOps, SwiGluHasThePlainValuesAndAutogradsGradient) {
  for (const at::Device device : Devices())
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      at::manual_seed(4);
      const auto opts = at::TensorOptions().device(device);
      const at::Tensor x = (3.0 * at::randn({29, 2 * 24}, opts)).to(dtype);
      const at::Tensor g = at::randn({29, 24}, opts).to(dtype);
      const auto [y_plain, gx_plain] = ValueAndGrad(SwiGluPlain, x, g);
      const auto [y_lean, gx_lean] = ValueAndGrad(SwiGluLean, x, g);
      ExpectSameForward(y_lean, y_plain, device, dtype);
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      EXPECT_LT(RelDiff(gx_lean.to(at::kFloat), gx_plain.to(at::kFloat)), tol) << device << " " << dtype;
    }
}

TEST(LeanOps, RopeHasThePlainValuesAndAutogradsGradient) {
  for (const at::Device device : Devices())
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      at::manual_seed(5);
      const auto opts = at::TensorOptions().device(device);
      const at::Tensor x = at::randn({13, 4, 16}, opts).to(dtype);
      const at::Tensor angle = at::randn({13, 1, 8}, opts);
      const at::Tensor cos = at::cat({angle.cos(), angle.cos()}, -1).to(dtype);
      const at::Tensor sin = at::cat({angle.sin(), angle.sin()}, -1).to(dtype);
      const at::Tensor g = at::randn({13, 4, 16}, opts).to(dtype);
      const auto [y_plain, gx_plain] = ValueAndGrad([&](const at::Tensor& v) { return RopePlain(v, cos, sin); }, x, g);
      const auto [y_lean, gx_lean] = ValueAndGrad([&](const at::Tensor& v) { return RopeLean(v, cos, sin); }, x, g);
      EXPECT_TRUE(at::equal(y_plain, y_lean)) << device << " " << dtype;
      const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
      EXPECT_LT(RelDiff(gx_lean.to(at::kFloat), gx_plain.to(at::kFloat)), tol) << device << " " << dtype;
      EXPECT_GT(gx_plain.abs().max().item<double>(), 1e-2);
    }
}

TEST(LeanOps, SplitGivesViewsAndTheSumOfItsBlocksGradients) {
  for (const at::Device device : Devices()) {
    at::manual_seed(6);
    const auto opts = at::TensorOptions().device(device);
    const at::Tensor x0 = at::randn({7, 12}, opts);
    const at::Tensor w = at::randn({7, 12}, opts);
    // Blocks used unequally (one unused), as q, k, v are.
    const auto loss = [&](const std::vector<at::Tensor>& b) {
      return (b[0] * w.narrow(1, 0, 6)).sum() + (b[1] * b[1]).sum();
    };
    const at::Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
    const std::vector<at::Tensor> plain{xa.narrow(1, 0, 6), xa.narrow(1, 6, 3), xa.narrow(1, 9, 3)};
    const std::vector<at::Tensor> lean = SplitLean(xb, {6, 3, 3});
    ASSERT_EQ(lean.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(lean[i], plain[i])) << i;
    loss(plain).backward();
    loss(lean).backward();
    EXPECT_TRUE(at::equal(xa.grad(), xb.grad())) << device;
    EXPECT_TRUE(at::equal(xb.grad().narrow(1, 9, 3), at::zeros({7, 3}, opts)));
  }
}

// The residual add and the next norm against the plain ops, with the
// gradients of both outputs (the residual stream and the normed rows) into
// x, o and the delta. On CUDA this is the fused kernel pair.
TEST(LeanOps, AddRmsNormHasThePlainValuesAndAutogradsGradients) {
  for (const at::Device device : Devices())
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16})
      for (const bool with_delta : {false, true}) {
        at::manual_seed(8);
        const auto opts = at::TensorOptions().device(device);
        const at::Tensor x0 = (2.0 * at::randn({19, 48}, opts)).to(dtype), o0 = at::randn({19, 48}, opts).to(dtype),
                         d0 = (0.3 * at::randn({19, 48}, opts)).to(dtype);
        const at::Tensor w = (1.0 + 0.2 * at::randn({48}, opts)).to(dtype);
        const at::Tensor gs = at::randn({19, 48}, opts).to(dtype), gh = at::randn({19, 48}, opts).to(dtype);
        std::vector<at::Tensor> values[2], grads[2];
        for (int lean = 0; lean < 2; ++lean) {
          const at::Tensor x = x0.clone().requires_grad_(true), o = o0.clone().requires_grad_(true),
                           d = d0.clone().requires_grad_(true);
          at::Tensor sum, h;
          if (lean) {
            std::tie(sum, h) = AddRmsNormLean(x, o, with_delta ? d : at::Tensor(), w, 1e-6);
          } else {
            sum = x + (with_delta ? o + d : o);
            h = RmsNormPlain(sum, w, 1e-6);
          }
          ((sum.to(at::kFloat) * gs.to(at::kFloat)).sum() + (h.to(at::kFloat) * gh.to(at::kFloat)).sum()).backward();
          values[lean] = {sum.detach(), h.detach()};
          grads[lean] = {x.grad(), o.grad()};
          if (with_delta) grads[lean].push_back(d.grad());
        }
        const std::string what = device.str() + " " + std::string(c10::toString(dtype)) + (with_delta ? " delta" : "");
        EXPECT_TRUE(at::equal(values[1][0], values[0][0])) << what;  // the sum rounds the same way
        ExpectSameForward(values[1][1], values[0][1], device, dtype);
        const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
        for (size_t i = 0; i < grads[0].size(); ++i) {
          ASSERT_TRUE(grads[1][i].defined()) << what << " grad " << i;
          EXPECT_LT(RelDiff(grads[1][i].to(at::kFloat), grads[0][i].to(at::kFloat)), tol) << what << " grad " << i;
        }
      }
}

// The q/k/v tail (split, q/k norms, RoPE) against the plain ops with
// autograd, with and without a delta and a norm, for the heads' values and
// the gradients into qkv and the delta. On CUDA this is the fused kernel pair.
TEST(LeanOps, QkvTailHasThePlainValuesAndAutogradsGradients) {
  const int64_t T = 11, H = 4, KVH = 2, hd = 64, width = (H + 2 * KVH) * hd;
  for (const at::Device device : Devices())
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16})
      for (const bool norm : {false, true})
        for (const bool with_delta : {false, true}) {
          at::manual_seed(7);
          const auto opts = at::TensorOptions().device(device);
          const at::Tensor qkv0 = (2.0 * at::randn({T, width}, opts)).to(dtype);
          const at::Tensor delta0 = (0.5 * at::randn({T, width}, opts)).to(dtype);
          const at::Tensor qn = norm ? (1.0 + 0.2 * at::randn({hd}, opts)).to(dtype) : at::Tensor();
          const at::Tensor kn = norm ? (1.0 + 0.2 * at::randn({hd}, opts)).to(dtype) : at::Tensor();
          const at::Tensor angle = at::randn({T, 1, hd / 2}, opts);
          const at::Tensor cos = at::cat({angle.cos(), angle.cos()}, -1).to(dtype);
          const at::Tensor sin = at::cat({angle.sin(), angle.sin()}, -1).to(dtype);
          const at::Tensor gq = at::randn({T, H, hd}, opts).to(dtype), gk = at::randn({T, KVH, hd}, opts).to(dtype),
                           gv = at::randn({T, KVH, hd}, opts).to(dtype);
          std::vector<at::Tensor> values[2], grads[2];
          for (int lean = 0; lean < 2; ++lean) {
            const at::Tensor qkv = qkv0.clone().requires_grad_(true), delta = delta0.clone().requires_grad_(true);
            QkvHeads out;
            if (lean) {
              out = QkvTailLean(qkv, with_delta ? delta : at::Tensor(), qn, kn, cos, sin, H, KVH, hd, 1e-6);
            } else {
              const at::Tensor x = with_delta ? qkv + delta : qkv;
              at::Tensor q = x.narrow(1, 0, H * hd).reshape({T, H, hd});
              at::Tensor k = x.narrow(1, H * hd, KVH * hd).reshape({T, KVH, hd});
              out.v = x.narrow(1, (H + KVH) * hd, KVH * hd).reshape({T, KVH, hd});
              if (norm) {
                q = RmsNormPlain(q, qn, 1e-6);
                k = RmsNormPlain(k, kn, 1e-6);
              }
              out.q = RopePlain(q, cos, sin);
              out.k = RopePlain(k, cos, sin);
            }
            (((out.q.to(at::kFloat) * gq.to(at::kFloat)).sum() + (out.k.to(at::kFloat) * gk.to(at::kFloat)).sum() +
              (out.v.to(at::kFloat) * gv.to(at::kFloat)).sum()))
                .backward();
            values[lean] = {out.q.detach(), out.k.detach(), out.v.detach()};
            grads[lean] = {qkv.grad()};
            if (with_delta) grads[lean].push_back(delta.grad());
          }
          const std::string what = device.str() + " " + std::string(c10::toString(dtype)) + (norm ? " norm" : "") +
                                   (with_delta ? " delta" : "");
          for (size_t i = 0; i < 3; ++i) {
            SCOPED_TRACE(what + " value " + std::to_string(i));
            ExpectSameForward(values[1][i], values[0][i], device, dtype);
          }
          // The plain graph rounds the upstream gradient's bf16 cast differently (one rounding).
          const double tol = dtype == at::kFloat ? 1e-5 : 3e-2;
          for (size_t i = 0; i < grads[0].size(); ++i) {
            ASSERT_TRUE(grads[1][i].defined()) << what << " grad " << i;
            EXPECT_LT(RelDiff(grads[1][i].to(at::kFloat), grads[0][i].to(at::kFloat)), tol) << what << " grad " << i;
            EXPECT_GT(grads[0][i].abs().max().item<double>(), 1e-2) << what;
          }
        }
}

struct PassResult {
  at::Tensor logprobs;
  std::vector<at::Tensor> grads;  // every target's A and B gradient
};

std::vector<std::vector<int32_t>> PassSeqs() { return {Seq(9, 1), Seq(4, 2), Seq(13, 3), Seq(6, 4)}; }
const std::vector<int> kPassSlots = {0, -1, 1, 0};

// One packed forward and backward over four sequences on slots {0, -1, 1, 0}
// (slot 1 trains the MLP only), with the first `recompute` layers recomputed.
PassResult Pass(const Transformer& model, SlotBank& bank, int64_t recompute) {
  for (auto& t : bank.targets()) {
    if (t.A.grad().defined()) t.A.mutable_grad().zero_();
    if (t.B.grad().defined()) t.B.mutable_grad().zero_();
  }
  const std::vector<std::vector<int32_t>> seqs = PassSeqs();
  const PackedBatch batch = PackedBatch::Make(seqs, kPassSlots, model.device());
  const at::Tensor lp = model.TargetLogprobs(model.Hidden(batch, bank, recompute),
                                             NextTokens(seqs).to(model.device()), batch, bank, 8);
  (lp * at::linspace(0.5, 1.5, lp.size(0), lp.options())).sum().backward();
  PassResult r;
  r.logprobs = lp.detach().cpu().to(at::kFloat);
  for (auto& t : bank.targets())
    for (const at::Tensor& p : {t.A, t.B})
      r.grads.push_back(p.grad().defined() ? p.grad().cpu() : at::zeros(p.sizes()));
  return r;
}

void BindBoth(SlotBank& bank, at::Device device) {
  for (int s = 0; s < 2; ++s) {
    LoraConfig c;
    c.rank = 4;
    c.alpha = 8.0;
    c.seed = 40 + s;
    c.train_attn = s == 0;
    ASSERT_TRUE(bank.Bind(s, c).ok());
    c10::NoGradGuard no_grad;
    at::manual_seed(50 + s);
    for (auto& t : bank.targets())
      if (s == 0 || t.group != TargetGroup::kAttn)
        t.B.select(0, s).copy_(0.2 * at::randn(t.FactorShape(false, 4)).to(device));
  }
}

class RecomputeArch : public ::testing::TestWithParam<std::string> {};

// Recomputing one layer or all of them gives the values and gradients of
// keeping every activation, bit for bit on the CPU.
TEST_P(RecomputeArch, GivesTheSameValuesAndGradients) {
  auto model = Tiny(GetParam(), 2);
  SlotBank bank(2, 4, at::kCPU, model->LoraTargets());
  BindBoth(bank, at::kCPU);
  const PassResult kept = Pass(*model, bank, 0);
  double grad_scale = 0;
  for (const at::Tensor& g : kept.grads) grad_scale = std::max(grad_scale, g.abs().max().item<double>());
  EXPECT_GT(grad_scale, 1e-3);
  for (int64_t layers : {1, 2, 99}) {
    const PassResult re = Pass(*model, bank, layers);
    EXPECT_TRUE(at::equal(re.logprobs, kept.logprobs)) << layers;
    for (size_t i = 0; i < kept.grads.size(); ++i)
      EXPECT_TRUE(at::equal(re.grads[i], kept.grads[i])) << "layers " << layers << " grad " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Qwen, RecomputeArch, ::testing::Values("qwen2", "qwen3", "qwen3-bias", "qwen3_moe"),
                         [](const auto& info) { return std::string(info.param == "qwen3-bias" ? "qwen3_bias" : info.param); });

// On CUDA: recomputation against keeping all (to rounding: CUDA's index_add
// accumulates in any order), and the bf16 trainer against the fp32
// reference on the same weights, with the LoRA arithmetic in fp32 (PEFT's
// way) and in bf16 (the default): the bf16 LoRA may not widen the gap that
// bf16 base weights already make by more than half.
TEST(RecomputeCuda, Bf16GapToTheFp32Reference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Device device(at::kCUDA, 0);
  const ModelConfig c = TinyConfig("qwen3");
  const auto weights = RandomWeights(c, 6);
  // A bf16 pass takes the varlen flash kernel until its shape recurs, then
  // cuDNN (TrainOnVarlenFlash): the two round differently, so a kept pass and
  // its recomputed twin compared across that switch differ by bf16 rounding.
  // Every pass of this test's shape takes cuDNN: counted as recurring first.
  for (int64_t i = 0; i < kCudnnAfterPasses; ++i)
    TrainOnVarlenFlash(PackedBatch::Make(PassSeqs(), kPassSlots, at::kCPU).seq_begin, c.num_attention_heads,
                       c.num_key_value_heads, c.head_dim, device, at::kBFloat16);
  std::vector<PassResult> results;  // fp32; bf16 with fp32 LoRA; bf16
  for (int run = 0; run < 3; ++run) {
    auto model = Transformer::FromTensors(c, weights, device, run == 0 ? at::kFloat : at::kBFloat16);
    ASSERT_TRUE(model.ok());
    SlotBank bank(2, 4, device, (*model)->LoraTargets());
    bank.set_lora_fp32(run == 1);
    BindBoth(bank, device);
    const PassResult kept = Pass(**model, bank, 0);
    const PassResult re = Pass(**model, bank, 99);
    EXPECT_LT(MaxDiff(re.logprobs, kept.logprobs), 1e-6);
    for (size_t i = 0; i < kept.grads.size(); ++i)
      EXPECT_LT(RelDiff(re.grads[i], kept.grads[i]), 1e-5) << "run " << run << " grad " << i;
    results.push_back(kept);
  }
  double lp_gap[3] = {0, 0, 0}, grad_gap[3] = {0, 0, 0};
  for (int run = 1; run < 3; ++run) {
    lp_gap[run] = MaxDiff(results[run].logprobs, results[0].logprobs);
    for (size_t i = 0; i < results[0].grads.size(); ++i)
      grad_gap[run] = std::max(grad_gap[run], RelDiff(results[run].grads[i], results[0].grads[i]));
    std::printf("[ figure ] %s vs fp32 on CUDA: logprobs max |diff| %.4g, LoRA gradients max relative diff %.4g\n",
                run == 1 ? "bf16 weights + fp32 LoRA" : "bf16 weights + bf16 LoRA", lp_gap[run], grad_gap[run]);
  }
  EXPECT_LT(lp_gap[2], 0.25);  // bf16 rounding (the CPU's Bf16EngineIsCloseToFp32 bound)
  EXPECT_LT(lp_gap[2], 1.5 * lp_gap[1] + 0.02);
  EXPECT_LT(grad_gap[2], 1.5 * grad_gap[1] + 0.02);
}

}  // namespace
}  // namespace loom::engine
