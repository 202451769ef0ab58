// LtGemm (engine/sample/cuda/lt_gemm.h) against ATen: y = x W^T in bf16 with
// each shape's tuned cuBLASLt algorithm, at a decode step's row counts; an
// untuned shape, or an operand less aligned than the tuning's, launches nothing.
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include <string>
#include <tuple>
#include <vector>

#include "engine/sample/cuda/lt_gemm.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

TEST(LtGemmKernel, TunedShapesMatchATen) {
  LOOM_SKIP_WITHOUT_CUDA();
  at::manual_seed(23);
  cuda::LtGemm gemm;
  for (const auto& [rows, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {8, 200, 1024}, {64, 1000, 512}, {256, 384, 2048}, {16, 4096, 256}}) {
    const at::Tensor x = Randn({rows, k}, at::kBFloat16);
    // Three weights of the shape, as a step's layers: tuned over all, each used.
    std::vector<at::Tensor> ws;
    std::vector<const void*> ptrs;
    for (int l = 0; l < 3; ++l) {
      ws.push_back(Randn({n, k}, at::kBFloat16, 0.05));
      ptrs.push_back(ws.back().data_ptr());
    }
    const std::string what = "rows " + std::to_string(rows) + " n " + std::to_string(n) + " k " + std::to_string(k);
    EXPECT_FALSE(gemm.Run(x.data_ptr(), ws[0].data_ptr(), nullptr, rows, n, k, Stream())) << what << ": not tuned yet";
    at::Tensor scratch = at::empty({rows, n}, On(at::kBFloat16));
    EXPECT_FALSE(gemm.Tuned(rows, n, k)) << what;
    std::string line;
    ASSERT_TRUE(gemm.Tune(rows, n, k, ptrs, x.data_ptr(), scratch.data_ptr(), Stream(), &line)) << what;
    EXPECT_NE(line.find("candidate"), std::string::npos) << line;
    std::printf("[ figure ] LtGemm %s\n", line.c_str());
    std::string again;
    EXPECT_TRUE(gemm.Tune(rows, n, k, ptrs, x.data_ptr(), scratch.data_ptr(), Stream(), &again));
    EXPECT_TRUE(again.empty()) << "a shape is tuned once";
    EXPECT_TRUE(gemm.Tuned(rows, n, k)) << what;
    for (const at::Tensor& w : ws) {
      at::Tensor y = at::empty({rows, n}, On(at::kBFloat16));
      ASSERT_TRUE(gemm.Run(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, n, k, Stream())) << what;
      const at::Tensor want = Round(at::matmul(x.to(at::kFloat), w.to(at::kFloat).t()), at::kBFloat16);
      // fp32 sums of k products in another order (split-K among them), rounded to bf16.
      ExpectClose(y, want, Rtol(at::kBFloat16), 2 * Atol(at::kBFloat16), what);
    }
    EXPECT_FALSE(gemm.Run(x.data_ptr(), ws[0].data_ptr(), nullptr, rows + 1, n, k, Stream())) << what;
    // An output less aligned than the tuning's operands: refused, nothing written.
    at::Tensor off = at::zeros({rows * n + 1}, On(at::kBFloat16));
    EXPECT_FALSE(gemm.Run(x.data_ptr(), ws[0].data_ptr(), static_cast<char*>(off.data_ptr()) + 2, rows, n, k, Stream()))
        << what;
    EXPECT_EQ(off.abs().max().item<float>(), 0.0f) << what;
  }
}

// The caller's own path as the baseline: a cuBLASLt algorithm is chosen
// only where it beats it. A baseline that launches nothing (0 us) always
// wins: the shape is tuned with no algorithm, Run declines it (the caller
// runs its own path) and the line says so. One that cannot run is left out.
TEST(LtGemmKernel, BaselineKeptWhereNoCandidateBeatsIt) {
  LOOM_SKIP_WITHOUT_CUDA();
  at::manual_seed(29);
  cuda::LtGemm gemm;
  const int64_t rows = 64, n = 512, k = 1024;
  const at::Tensor x = Randn({rows, k}, at::kBFloat16), w = Randn({n, k}, at::kBFloat16, 0.05);
  at::Tensor y = at::empty({rows, n}, On(at::kBFloat16));
  const std::vector<const void*> ptrs{w.data_ptr()};
  int launched = 0;
  std::string line;
  EXPECT_FALSE(gemm.Tune(rows, n, k, ptrs, x.data_ptr(), y.data_ptr(), Stream(), &line, [&](size_t) {
    ++launched;
    return true;
  }));
  EXPECT_GT(launched, 1) << "the baseline is timed over several runs";
  EXPECT_NE(line.find("cublasGemmEx kept"), std::string::npos) << line;
  EXPECT_TRUE(gemm.Tuned(rows, n, k));
  EXPECT_FALSE(gemm.Run(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, n, k, Stream()));

  // A baseline that cannot run: the candidates alone, as without one.
  const int64_t n2 = 256;
  const at::Tensor w2 = Randn({n2, k}, at::kBFloat16, 0.05);
  at::Tensor y2 = at::empty({rows, n2}, On(at::kBFloat16));
  line.clear();
  ASSERT_TRUE(gemm.Tune(rows, n2, k, {w2.data_ptr()}, x.data_ptr(), y2.data_ptr(), Stream(), &line,
                        [](size_t) { return false; }));
  EXPECT_NE(line.find("candidate"), std::string::npos) << line;
  EXPECT_EQ(line.find("cublasGemmEx"), std::string::npos) << line;
  ASSERT_TRUE(gemm.Run(x.data_ptr(), w2.data_ptr(), y2.data_ptr(), rows, n2, k, Stream()));
  ExpectClose(y2, Round(at::matmul(x.to(at::kFloat), w2.to(at::kFloat).t()), at::kBFloat16), Rtol(at::kBFloat16),
              2 * Atol(at::kBFloat16), "candidates alone");
}

}  // namespace
}  // namespace loom::engine
#endif
