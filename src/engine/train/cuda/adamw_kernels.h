// The optimizer's update on CUDA (train/adamw.h, the foreach path): one
// kernel over a contiguous span of fp32 weights, gradients and moments,
// the whole AdamW update per element in registers, where the multi-tensor
// ATen sequence makes about 25 passes over memory.
//
// Conventions as model/cuda/lean_kernels.h: raw pointers and a stream,
// asynchronous on `stream`.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// The factors of one span's update, in ForeachAdamW's order (adamw.cpp):
// gradient scale, decay, b1, 1 - b1, b2, 1 - b2, 1 / sqrt(bc2), eps and
// minus the step size.
struct AdamWFactors {
  float f[9];
};

// In place over n elements, in fp32 as ForeachAdamW computes it:
//   gs = g * f0; p *= f1; m = m * f2 + gs * f3; v = v * f4 + f5 * gs * gs;
//   p += f8 * m / (sqrt(v) * f6 + f7).
void AdamWStep(float* p, const float* g, float* m, float* v, int64_t n, const AdamWFactors& f, cudaStream_t stream);

}  // namespace loom::engine::cuda
