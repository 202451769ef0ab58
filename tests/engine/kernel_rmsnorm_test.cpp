// RmsNorm (engine/sample/cuda/rmsnorm.h) against ATen: the norm alone, and
// fused with the residual add and that add's LoRA delta, fp32 and bf16.
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include "engine/sample/cuda/rmsnorm.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

constexpr float kEps = 1e-6f;

// out = w * T(v * rsqrt(mean(v^2) + eps)) with v = T(x + T(add + T(delta))).
void Check(at::ScalarType t, int64_t rows, int64_t n, bool add, bool delta) {
  at::manual_seed(7);
  const at::Tensor x = Randn({rows, n}, t), w = Randn({n}, t), a = Randn({rows, n}, t);
  const at::Tensor d = Randn({rows, n}, t, 0.1);
  at::Tensor sum = at::zeros({rows, n}, On(t)), out = at::empty({rows, n}, On(t));
  cuda::RmsNorm(t == at::kBFloat16, x.data_ptr(), add ? a.data_ptr() : nullptr,
                add && delta ? d.data_ptr() : nullptr, sum.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, kEps,
                Stream());

  at::Tensor v = x.to(at::kFloat);
  if (add) {
    const at::Tensor a2 = delta ? AddDelta(a.to(at::kFloat), d.to(at::kFloat), t) : a.to(at::kFloat);
    v = Round(v + a2, t);
  }
  const at::Tensor inv = at::rsqrt(v.pow(2).mean({1}, /*keepdim=*/true) + kEps);
  const at::Tensor want = w.to(at::kFloat) * Round(v * inv, t);
  const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + " n=" + std::to_string(n) +
                           (add ? " add" : "") + (delta ? " delta" : "");
  ExpectClose(out, Round(want, t), Rtol(t), Atol(t), what + ": out");
  if (add) ExpectClose(sum, v, Rtol(t), Atol(t), what + ": sum");
}

TEST(RmsNormKernel, MatchesATenAloneAndFusedWithTheResidualAdd) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    for (int64_t n : {64, 896, 2560}) {
      Check(t, 3, n, false, false);
      Check(t, 3, n, true, false);
      Check(t, 3, n, true, true);
    }
  }
}

}  // namespace
}  // namespace loom::engine
#else
TEST(RmsNormKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
