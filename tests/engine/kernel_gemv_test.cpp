// Gemv (engine/model/cuda/gemv.h) against ATen: x W^T (+ b) for 1-4 rows,
// rounded to T, or those values as fp32 (the logits); more rows or a
// misaligned operand are refused (the caller then uses cuBLAS).
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include "engine/model/cuda/gemv.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

constexpr int64_t kN = 200, kK = 1024;

void Check(at::ScalarType t, int64_t rows, bool bias, bool y_f32) {
  at::manual_seed(19);
  // x as the first kK columns of a wider buffer: a row stride (ldx) of its own.
  const at::Tensor x_buf = Randn({rows, kK + 64}, t), W = Randn({kN, kK}, t, 0.05), b = Randn({kN}, t);
  const at::Tensor x = x_buf.narrow(1, 0, kK);
  at::Tensor y = at::empty({rows, kN}, On(y_f32 ? at::kFloat : t));
  ASSERT_TRUE(cuda::Gemv(t == at::kBFloat16, x.data_ptr(), x_buf.stride(0), W.data_ptr(), bias ? b.data_ptr() : nullptr,
                         y.data_ptr(), y_f32, rows, kN, kK, Stream()));

  at::Tensor want = at::matmul(x.to(at::kFloat), W.to(at::kFloat).t());
  if (bias) want = want + b.to(at::kFloat);
  const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + " rows=" + std::to_string(rows) +
                           (bias ? " bias" : "") + (y_f32 ? " f32" : "");
  // fp32 sums of 1024 products in another order: a little more than a few ulps.
  const bool bf16 = t == at::kBFloat16;
  ExpectClose(y, Round(want, t), bf16 ? Rtol(t) : 1e-4, bf16 ? Atol(t) : 1e-4, what);
}

TEST(GemvKernel, MatchesATenForOneToFourRows) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    for (int64_t rows = 1; rows <= cuda::kGemvMaxRows; ++rows) {
      Check(t, rows, false, false);
      Check(t, rows, true, false);
      Check(t, rows, false, true);
    }
  }
}

TEST(GemvKernel, RefusesMoreRowsAndMisalignedOperands) {
  LOOM_SKIP_WITHOUT_CUDA();
  const at::Tensor x = Randn({8, kK + 8}, at::kFloat), W = Randn({kN, kK}, at::kFloat);
  at::Tensor y = at::empty({8, kN}, On(at::kFloat));
  EXPECT_FALSE(cuda::Gemv(false, x.data_ptr(), x.stride(0), W.data_ptr(), nullptr, y.data_ptr(), false,
                          cuda::kGemvMaxRows + 1, kN, kK, Stream()));
  // x one element in: not 16-byte aligned.
  EXPECT_FALSE(cuda::Gemv(false, x.data_ptr<float>() + 1, x.stride(0), W.data_ptr(), nullptr, y.data_ptr(), false, 1,
                          kN, kK, Stream()));
}

// The mixture-of-experts form: pair p reads x row p / x_div and expert
// experts[p]'s matrix and bias.
TEST(GemvKernel, ExpertFormMatchesEachPairsOwnExpert) {
  LOOM_SKIP_WITHOUT_CUDA();
  at::manual_seed(23);
  const int64_t E = 6, T = 3, K = 2, P = T * K, n = 96, k = 256;
  for (at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = Randn({T, k}, t), W = Randn({E, n, k}, t, 0.05), b = Randn({E, n}, t);
    const at::Tensor experts = at::tensor(std::vector<int64_t>{5, 0, 2, 2, 1, 4}, at::TensorOptions().dtype(at::kLong)).to(x.device());
    for (bool bias : {false, true}) {
      at::Tensor y = at::empty({P, n}, On(t));
      ASSERT_TRUE(cuda::ExpertGemv(t == at::kBFloat16, x.data_ptr(), k, K, W.data_ptr(), bias ? b.data_ptr() : nullptr,
                                   experts.data_ptr<int64_t>(), y.data_ptr(), P, n, k, Stream()));
      std::vector<at::Tensor> want;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t e = experts[p].item<int64_t>();
        at::Tensor r = at::matmul(W[e].to(at::kFloat), x[p / K].to(at::kFloat));
        if (bias) r = r + b[e].to(at::kFloat);
        want.push_back(r);
      }
      const bool bf16 = t == at::kBFloat16;
      ExpectClose(y, Round(at::stack(want), t), bf16 ? Rtol(t) : 1e-4, bf16 ? Atol(t) : 1e-4,
                  std::string(bf16 ? "bf16" : "fp32") + (bias ? " bias" : ""));
    }
  }
  at::Tensor y = at::empty({cuda::kExpertGemvMaxPairs + 1, 8}, On(at::kFloat));
  const at::Tensor x = Randn({1, 64}, at::kFloat), W = Randn({2, 8, 64}, at::kFloat);
  const at::Tensor experts = at::zeros({cuda::kExpertGemvMaxPairs + 1}, at::TensorOptions().dtype(at::kLong)).to(x.device());
  EXPECT_FALSE(cuda::ExpertGemv(false, x.data_ptr(), 64, 1, W.data_ptr(), nullptr, experts.data_ptr<int64_t>(),
                                y.data_ptr(), cuda::kExpertGemvMaxPairs + 1, 8, 64, Stream()));
}

}  // namespace
}  // namespace loom::engine
#else
TEST(GemvKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
