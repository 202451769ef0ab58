// Shared by the decode kernels' reference checks (kernel_*_test.cpp): each
// runs one kernel family of engine/sample/cuda on the GPU and compares it
// with the same math written as plain ATen ops, rounded where the kernel
// rounds (to the model dtype T). Included only where the kernels are built
// (LOOM_CUDA_KERNELS); the tests skip without a CUDA device.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#define LOOM_SKIP_WITHOUT_CUDA() \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device"

namespace loom::engine::kernel_check {

// The stream the ATen ops of the test run on (the kernels launch there too).
inline cudaStream_t Stream() { return at::cuda::getCurrentCUDAStream().stream(); }

inline at::TensorOptions On(at::ScalarType t) { return at::TensorOptions().dtype(t).device(at::kCUDA); }

// Normal(0, scale) values in dtype t on the GPU (drawn in fp32).
inline at::Tensor Randn(at::IntArrayRef shape, at::ScalarType t, double scale = 1.0) {
  return (at::randn(shape, On(at::kFloat)) * scale).to(t);
}

// v (fp32) rounded through t, back in fp32: where the kernel rounds to T.
inline at::Tensor Round(const at::Tensor& v, at::ScalarType t) { return v.to(t).to(at::kFloat); }

// y + T(delta), rounded to T: how the eager path adds a LoRA delta.
inline at::Tensor AddDelta(const at::Tensor& y, const at::Tensor& delta, at::ScalarType t) {
  return Round(y + Round(delta, t), t);
}

// Tolerance of results in dtype t (values of order 1): a few float ulps;
// in bf16 two ulps, and an absolute 1e-2 for a rounding of an
// intermediate that a sum in another order moved by one ulp before a
// cancellation.
inline double Rtol(at::ScalarType t) { return t == at::kBFloat16 ? 1.6e-2 : 2e-5; }
inline double Atol(at::ScalarType t) { return t == at::kBFloat16 ? 1e-2 : 1e-5; }

// Every element of got within atol + rtol |want| of want (both any dtype).
inline void ExpectClose(const at::Tensor& got, const at::Tensor& want, double rtol, double atol,
                        const std::string& what) {
  ASSERT_TRUE(got.sizes() == want.sizes()) << what;
  const at::Tensor g = got.to(at::kFloat).cpu(), w = want.to(at::kFloat).cpu();
  const at::Tensor excess = (g - w).abs() - (w.abs() * rtol + atol);
  const double worst = excess.max().item<double>();
  const double diff = (g - w).abs().max().item<double>();
  EXPECT_LE(worst, 0.0) << what << ": max |got - want| " << diff;
  EXPECT_FALSE(std::isnan(diff)) << what << ": NaN";
}

}  // namespace loom::engine::kernel_check
