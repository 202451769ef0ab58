// Padded attention (one SDPA over the right-padded batch) against the
// per-sequence math reference: values and gradients into q, k, v, with
// grouped-query heads, unequal lengths and an empty sequence; and the
// sinks-and-window variant's flash path on CUDA against its math path.
#include "engine/model/attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

namespace loom::engine {
namespace {

TEST(PaddedAttention, LayoutIndexesRoundTrip) {
  const std::vector<int64_t> seq_begin = {0, 3, 3, 8, 10};
  const PaddedLayout l = PaddedLayout::Make(seq_begin, at::kCPU);
  EXPECT_EQ(l.seqs, 3);
  EXPECT_EQ(l.max_len, 5);
  ASSERT_EQ(l.gather.numel(), 15);
  ASSERT_EQ(l.scatter.numel(), 10);
  // Every packed row comes back from its own padded slot.
  EXPECT_TRUE(at::equal(l.gather.index_select(0, l.scatter), at::arange(10, at::kLong)));
  // Pads repeat the sequence's first row: sequence 2 is rows [8, 10).
  EXPECT_EQ(l.gather[11].item<int64_t>(), 9);
  EXPECT_EQ(l.gather[12].item<int64_t>(), 8);
  EXPECT_EQ(l.gather[14].item<int64_t>(), 8);
  EXPECT_FALSE(PaddedLayout::Prefer(seq_begin, at::kCPU));  // 1.5x padding: too much for the CPU
  EXPECT_TRUE(PaddedLayout::Prefer({0, 64, 128, 190}, at::kCPU));
  EXPECT_FALSE(PaddedLayout::Prefer({0, 64}, at::kCPU));  // one sequence: nothing to batch
}

TEST(PaddedAttention, MatchesPerSequenceMathWithGradients) {
  at::manual_seed(21);
  const std::vector<int64_t> seq_begin = {0, 7, 7, 10, 22, 23};
  const int64_t T = 23, H = 6, KVH = 2, hd = 8;
  const at::Tensor q0 = at::randn({T, H, hd}), k0 = at::randn({T, KVH, hd}), v0 = at::randn({T, KVH, hd});
  const at::Tensor gy = at::randn({T, H * hd});
  const PaddedLayout layout = PaddedLayout::Make(seq_begin, at::kCPU);
  std::vector<at::Tensor> out, grads;
  // 0: per-sequence math (the reference), 1: padded SDPA, 2: padded batched math.
  for (int variant = 0; variant < 3; ++variant) {
    at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    const at::Tensor y =
        variant == 0 ? PackedCausalAttention(q, k, v, seq_begin, AttentionKernel::kMath)
                     : PackedCausalAttention(q, k, v, seq_begin,
                                             variant == 1 ? AttentionKernel::kSdpa : AttentionKernel::kMath, &layout);
    ASSERT_EQ(y.sizes(), (at::IntArrayRef{T, H * hd}));
    (y * gy).sum().backward();
    out.push_back(y.detach());
    for (const at::Tensor& t : {q, k, v}) grads.push_back(t.grad());
  }
  for (int variant = 1; variant < 3; ++variant) {
    EXPECT_LT((out[variant] - out[0]).abs().max().item<double>(), 1e-5) << "variant " << variant;
    for (int i = 0; i < 3; ++i) {
      EXPECT_GT(grads[i].abs().max().item<double>(), 1e-2);
      EXPECT_LT((grads[3 * variant + i] - grads[i]).abs().max().item<double>(), 1e-5)
          << "variant " << variant << " grad " << i;
    }
  }
  // Causality across the padding: the first row of the longest sequence
  // attends only to itself, so its output is its own value row.
  for (int variant = 1; variant < 3; ++variant) {
    const at::Tensor row = out[variant][10].view({H, hd});
    EXPECT_LT((row - v0[10].repeat_interleave(H / KVH, 0)).abs().max().item<double>(), 1e-6);
  }
}

// The packed batch both CUDA flash tests below run: grouped-query heads,
// sequences of different lengths and an empty one, fp32 inputs and an
// output gradient; and the relative error the tests compare.
struct CudaFlashCase {
  const std::vector<int64_t> seq_begin = {0, 5, 45, 45, 68};
  const int64_t T = 68, H = 8, KVH = 2, hd = 64;
  at::Tensor q0, k0, v0, gy;
  explicit CudaFlashCase(uint64_t seed) {
    at::manual_seed(seed);
    const auto cuda = at::TensorOptions().device(at::kCUDA);
    q0 = at::randn({T, H, hd}, cuda);
    k0 = at::randn({T, KVH, hd}, cuda);
    v0 = at::randn({T, KVH, hd}, cuda);
    gy = at::randn({T, H * hd}, cuda);
  }
  static double Rel(const at::Tensor& a, const at::Tensor& ref) {
    return (a - ref).abs().max().item<double>() / ref.abs().max().item<double>();
  }
};

// gpt_oss's sinks and sliding window through the varlen flash kernel on
// CUDA (bf16), against the per-sequence math path in fp32 (the reference)
// and in bf16: outputs and gradients into q, k and v, with grouped-query
// heads, a sequence longer than the window, and a window of 0 (full).
TEST(VariantAttention, FlashSinksAndWindowMatchTheMathPathOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!VariantFlashAvailable()) GTEST_SKIP() << "no varlen flash kernel in this libtorch";
  const CudaFlashCase c(5);
  const auto& [seq_begin, T, H, KVH, hd, q0, k0, v0, gy] = c;
  const at::Tensor sinks0 = at::randn({H}, at::TensorOptions().device(at::kCUDA));
  for (const int64_t window : {int64_t{16}, int64_t{0}}) {
    // 0: math fp32 (reference), 1: math bf16, 2: flash bf16.
    std::vector<at::Tensor> out, grads;
    for (int path = 0; path < 3; ++path) {
      const at::ScalarType t = path == 0 ? at::kFloat : at::kBFloat16;
      at::Tensor q = q0.to(t).clone().requires_grad_(), k = k0.to(t).clone().requires_grad_(),
                 v = v0.to(t).clone().requires_grad_();
      AttentionVariant var;
      var.sinks = sinks0.to(t);
      var.window = window;
      const at::Tensor y = PackedCausalAttention(q, k, v, seq_begin,
                                                 path == 2 ? AttentionKernel::kSdpa : AttentionKernel::kMath, nullptr, &var);
      ASSERT_EQ(y.sizes(), (at::IntArrayRef{T, H * hd}));
      (y.to(at::kFloat) * gy).sum().backward();
      out.push_back(y.detach().to(at::kFloat));
      for (const at::Tensor& x : {q, k, v}) grads.push_back(x.grad().to(at::kFloat));
    }
    const auto rel = CudaFlashCase::Rel;
    const double math_out = rel(out[1], out[0]), flash_out = rel(out[2], out[0]);
    std::printf("sink flash window %lld: output rel err flash %.2e (bf16 math %.2e)", static_cast<long long>(window),
                flash_out, math_out);
    EXPECT_LT(flash_out, std::max(2 * math_out, 1e-2)) << "window " << window;
    for (int i = 0; i < 3; ++i) {
      const double m = rel(grads[3 + i], grads[i]), f = rel(grads[6 + i], grads[i]);
      std::printf(", grad %c flash %.2e (math %.2e)", "qkv"[i], f, m);
      EXPECT_GT(grads[i].abs().max().item<double>(), 1e-3);
      EXPECT_LT(f, std::max(2 * m, 2e-2)) << "window " << window << " grad " << i;
    }
    std::printf("\n");
  }
}

// The trainer's choice between cuDNN and the varlen flash kernel counts
// each shape's passes: a shape recurs once seen `after` times before.
TEST(ShapeRecurrence, AShapeRecursAfterItsEarlierPassesAndANewOneStaysNew) {
  ShapeRecurrence shapes(/*after=*/2, /*max_shapes=*/2);
  EXPECT_FALSE(shapes.Count({4, 2048}));
  EXPECT_FALSE(shapes.Count({4, 2048}));
  EXPECT_TRUE(shapes.Count({4, 2048}));
  EXPECT_TRUE(shapes.Count({4, 2048}));
  EXPECT_FALSE(shapes.Count({92, 319}));  // another shape counts alone
  EXPECT_FALSE(shapes.Count({92, 319}));
  EXPECT_TRUE(shapes.Count({92, 319}));
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(shapes.Count({7, 320})) << i;  // beyond max_shapes: never counted
  EXPECT_TRUE(shapes.Count({4, 2048}));
}

// Without the varlen flash kernel (the CPU, libtorch 1.13) a pass never
// takes it, whatever its shape's history.
TEST(ShapeRecurrence, OnTheCpuNoPassTakesTheVarlenKernel) {
  for (int i = 0; i < 3; ++i)
    EXPECT_FALSE(TrainOnVarlenFlash({0, 5, 45, 68}, 8, 2, 64, at::kCPU, at::kFloat));
}

// A plain training pass on the varlen flash kernel (PaddedLayout::varlen,
// as TrainOnVarlenFlash sets it) on CUDA in bf16, against the per-sequence
// math path in fp32 (the reference) and in bf16, and against the padded
// SDPA path: outputs and gradients into q, k and v, grouped-query heads,
// sequences of different lengths and an empty one.
TEST(PackedAttention, VarlenFlashMatchesTheMathPathOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!VariantFlashAvailable()) GTEST_SKIP() << "no varlen flash kernel in this libtorch";
  const CudaFlashCase c(6);
  const auto& [seq_begin, T, H, KVH, hd, q0, k0, v0, gy] = c;
  // 0: math fp32 (reference), 1: math bf16, 2: varlen flash bf16, 3: padded SDPA bf16.
  std::vector<at::Tensor> out, grads;
  for (int path = 0; path < 4; ++path) {
    const at::ScalarType t = path == 0 ? at::kFloat : at::kBFloat16;
    at::Tensor q = q0.to(t).clone().requires_grad_(), k = k0.to(t).clone().requires_grad_(),
               v = v0.to(t).clone().requires_grad_();
    PaddedLayout layout = path == 3 ? PaddedLayout::Make(seq_begin, at::kCUDA) : PaddedLayout{};
    if (path == 2) layout.SetVarlen(seq_begin, at::kCUDA);
    const at::Tensor y = PackedCausalAttention(q, k, v, seq_begin, path >= 2 ? AttentionKernel::kSdpa : AttentionKernel::kMath,
                                               layout.get());
    ASSERT_EQ(y.sizes(), (at::IntArrayRef{T, H * hd}));
    (y.to(at::kFloat) * gy).sum().backward();
    out.push_back(y.detach().to(at::kFloat));
    for (const at::Tensor& x : {q, k, v}) grads.push_back(x.grad().to(at::kFloat));
  }
  const auto rel = CudaFlashCase::Rel;
  const double math_out = rel(out[1], out[0]), flash_out = rel(out[2], out[0]), sdpa_out = rel(out[3], out[0]);
  std::printf("varlen flash: output rel err %.2e (bf16 math %.2e, padded SDPA %.2e)", flash_out, math_out, sdpa_out);
  EXPECT_LT(flash_out, std::max(2 * math_out, 1e-2));
  for (int i = 0; i < 3; ++i) {
    const double m = rel(grads[3 + i], grads[i]), f = rel(grads[6 + i], grads[i]), p = rel(grads[9 + i], grads[i]);
    std::printf(", grad %c %.2e (math %.2e, SDPA %.2e)", "qkv"[i], f, m, p);
    EXPECT_GT(grads[i].abs().max().item<double>(), 1e-3);
    EXPECT_LT(f, std::max(2 * m, 2e-2)) << "grad " << i;
  }
  std::printf("\n");
}

}  // namespace
}  // namespace loom::engine
