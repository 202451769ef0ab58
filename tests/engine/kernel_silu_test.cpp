// SiluMul (engine/sample/cuda/silu.h) against ATen: T(silu(gate)) * up
// over the fused gate_up projection, with and without its LoRA delta,
// fp32 and bf16.
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include "engine/sample/cuda/silu.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

void Check(at::ScalarType t, int64_t inter, bool delta) {
  at::manual_seed(17);
  const int64_t rows = 3;
  const at::Tensor gate_up = Randn({rows, 2 * inter}, t, 2.0), d = Randn({rows, 2 * inter}, t, 0.1);
  at::Tensor out = at::empty({rows, inter}, On(t));
  cuda::SiluMul(t == at::kBFloat16, gate_up.data_ptr(), delta ? d.data_ptr() : nullptr, out.data_ptr(), rows, inter,
                Stream());

  const at::Tensor gu = delta ? AddDelta(gate_up.to(at::kFloat), d.to(at::kFloat), t) : gate_up.to(at::kFloat);
  const at::Tensor g = gu.narrow(1, 0, inter), u = gu.narrow(1, inter, inter);
  const at::Tensor want = Round(Round(at::silu(g), t) * u, t);
  const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + " inter=" + std::to_string(inter) +
                           (delta ? " delta" : "");
  ExpectClose(out, want, Rtol(t), Atol(t), what);
}

TEST(SiluMulKernel, MatchesATen) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    for (int64_t inter : {300, 4864}) {
      Check(t, inter, false);
      Check(t, inter, true);
    }
  }
}

}  // namespace
}  // namespace loom::engine
#else
TEST(SiluMulKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
