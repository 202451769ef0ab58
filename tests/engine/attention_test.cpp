// Padded attention (one SDPA over the right-padded batch) against the
// per-sequence math reference: values and gradients into q, k, v, with
// grouped-query heads, unequal lengths and an empty sequence.
#include "engine/model/attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace loom::engine
