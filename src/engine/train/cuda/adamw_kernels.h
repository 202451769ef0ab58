// The optimizer's update on CUDA (train/adamw.h, the foreach path): one
// kernel over a contiguous span of fp32 weights, gradients and moments,
// the whole AdamW update per element in registers, where the multi-tensor
// ATen sequence makes about 25 passes over memory; and the gradient norms'
// sums of squares read straight from the bank's rows (no gathered copy).
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

// Sums of squares over U spans of one fp32 buffer, accumulated in fp64:
// span u is x[slots[u] * ld + j] for j < len. Writes `blocks` partial sums
// a span, partial [U, blocks] (SquaredSumBlocks(len) of them), for the caller
// to add up in a fixed order (no atomics: the same bits every run).
int64_t SquaredSumBlocks(int64_t len);
void SquaredSums(const float* x, int64_t ld, const int64_t* slots, int64_t U, int64_t len, double* partial,
                 cudaStream_t stream);

}  // namespace loom::engine::cuda
