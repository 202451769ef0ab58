// MoeRoute and MoeCombine (engine/model/cuda/moe_route.h) against the ATen
// ops they replace in a decode step's MoE block: the router's softmax,
// top-k and normalisation (moe.cpp's Route), and the weighting and sum of
// the (token, choice) pairs' outputs.
#include <gtest/gtest.h>

#include <cmath>

#if LOOM_CUDA_KERNELS
#include "engine/model/cuda/moe_route.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

// Logits with no two equal in a row, in bf16 as in fp32: E distinct values
// exact in bf16 (128 mantissa steps in each binade from 2^-4 up, so 1,024
// experts span 8 binades; equal spacing would tie in bf16 past 128 experts,
// where ATen's top-k and the kernel may break the tie differently), in a
// random order per row.
at::Tensor DistinctLogits(int64_t T, int64_t E, at::ScalarType t) {
  const auto f = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor k = at::arange(E, f);
  const at::Tensor values = (k.remainder(128) + 128) / 128 * at::pow(2.0, at::floor(k / 128) - 4);
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < T; ++i) rows.push_back(values.index_select(0, at::randperm(E, f.dtype(at::kLong))));
  return at::stack(rows).to(at::kCUDA, t);
}

TEST(MoeRouteKernel, MatchesSoftmaxTopKAndTopKSoftmax) {
  LOOM_SKIP_WITHOUT_CUDA();
  at::manual_seed(31);
  struct Case {
    int64_t E, K;
    cuda::MoeRouteKind kind;
    bool norm;
  };
  for (const Case& c : {Case{128, 8, cuda::MoeRouteKind::kSoftmaxTopK, true},
                        Case{128, 8, cuda::MoeRouteKind::kSoftmaxTopK, false},
                        Case{32, 4, cuda::MoeRouteKind::kTopKSoftmax, false}, Case{60, 6, cuda::MoeRouteKind::kSoftmaxTopK, true},
                        Case{1024, 32, cuda::MoeRouteKind::kSoftmaxTopK, true}}) {
    for (at::ScalarType t : {at::kBFloat16, at::kFloat}) {
      for (int64_t T : {1, 3, 8}) {
        const at::Tensor logits = DistinctLogits(T, c.E, t);
        at::Tensor weights = at::empty({T, c.K}, On(t));
        at::Tensor experts = at::empty({T, c.K}, On(at::kLong));
        ASSERT_TRUE(cuda::MoeRoute(t == at::kBFloat16, c.kind, c.norm, logits.data_ptr(), weights.data_ptr(),
                                   experts.data_ptr<int64_t>(), T, c.E, c.K, Stream()));
        at::Tensor want_p, want_e;
        if (c.kind == cuda::MoeRouteKind::kTopKSoftmax) {
          std::tie(want_p, want_e) = logits.topk(c.K, -1);
          want_p = at::softmax(want_p, -1, t);
        } else {
          std::tie(want_p, want_e) = at::softmax(logits.to(at::kFloat), -1).topk(c.K, -1);
          if (c.norm) want_p = want_p / want_p.sum(-1, true);
          want_p = want_p.to(t);
        }
        const std::string what = "E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) + " T=" + std::to_string(T) +
                                 (t == at::kBFloat16 ? " bf16" : " fp32") + (c.norm ? " norm" : "");
        EXPECT_TRUE(at::equal(experts, want_e)) << what;
        // The same fp32 ops, summed in another order: at most one rounding of T apart.
        ExpectClose(weights, want_p.to(at::kFloat), t == at::kBFloat16 ? 8e-3 : 1e-5, 1e-6, what);
      }
    }
  }
  // Ties go to the lower expert; past the limits nothing is launched.
  const at::Tensor tied = at::tensor(std::vector<float>{1, 3, 3, 0, 3}, On(at::kFloat)).unsqueeze(0);
  at::Tensor w = at::empty({1, 2}, On(at::kFloat)), e = at::empty({1, 2}, On(at::kLong));
  ASSERT_TRUE(cuda::MoeRoute(false, cuda::MoeRouteKind::kTopKSoftmax, false, tied.data_ptr(), w.data_ptr(),
                             e.data_ptr<int64_t>(), 1, 5, 2, Stream()));
  EXPECT_EQ(e.cpu()[0][0].item<int64_t>(), 1);
  EXPECT_EQ(e.cpu()[0][1].item<int64_t>(), 2);
  // A NaN ranks first, as at::topk ranks it: a real expert, never index E.
  const at::Tensor nan = at::tensor(std::vector<float>{1, NAN, 3, 0, 3}, On(at::kFloat)).unsqueeze(0);
  ASSERT_TRUE(cuda::MoeRoute(false, cuda::MoeRouteKind::kTopKSoftmax, false, nan.data_ptr(), w.data_ptr(),
                             e.data_ptr<int64_t>(), 1, 5, 2, Stream()));
  EXPECT_EQ(e.cpu()[0][0].item<int64_t>(), 1);
  EXPECT_EQ(e.cpu()[0][1].item<int64_t>(), 2);
  EXPECT_FALSE(cuda::MoeRoute(false, cuda::MoeRouteKind::kTopKSoftmax, false, tied.data_ptr(), w.data_ptr(),
                              e.data_ptr<int64_t>(), 1, 5, 6, Stream()));
  EXPECT_FALSE(cuda::MoeRoute(false, cuda::MoeRouteKind::kSoftmaxTopK, false, tied.data_ptr(), w.data_ptr(),
                              e.data_ptr<int64_t>(), 1, cuda::kMoeRouteMaxExperts + 1, 2, Stream()));
}

// The pairs' outputs weighted (each product rounded to T) and summed per
// token, as (y * weights).view(T, K, n).sum(1) computes it; weights in T
// or fp32 (the grouped routers').
TEST(MoeRouteKernel, CombineMatchesTheWeightedSum) {
  LOOM_SKIP_WITHOUT_CUDA();
  at::manual_seed(37);
  const int64_t n = 2048 + 40;
  for (at::ScalarType t : {at::kBFloat16, at::kFloat}) {
    for (bool f32 : {false, true}) {
      for (auto [T, K] : {std::pair<int64_t, int64_t>{1, 8}, {4, 8}, {8, 4}}) {
        const at::Tensor y = Randn({T * K, n}, t), weights = at::rand({T, K}, On(f32 ? at::kFloat : t));
        at::Tensor out = at::empty({T, n}, On(t));
        cuda::MoeCombine(t == at::kBFloat16, y.data_ptr(), weights.data_ptr(), f32, out.data_ptr(), T, K, n, Stream());
        const at::Tensor want = (y * weights.reshape({-1}).unsqueeze(1)).to(t).view({T, K, n}).sum(1);
        const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + (f32 ? " f32 weights" : "") +
                                 " T=" + std::to_string(T);
        // Sums of K rounded products in another order: within one rounding of T.
        ExpectClose(out, want.to(at::kFloat), Rtol(t), Atol(t), what);
      }
    }
  }
}

}  // namespace
}  // namespace loom::engine
#else
TEST(MoeRouteKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
