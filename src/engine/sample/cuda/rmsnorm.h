// RmsNorm: the decode step's RMS norms, fused with the residual add
// (and the LoRA delta of the projection that feeds it).
//
// Conventions of every decode kernel (the model dtype T, where results
// round, streams and buffer ownership): engine/sample/cuda/device.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// The widest row RmsNorm takes (the hidden size; the row is held in
// registers, 12 elements per thread of 1024).
constexpr int64_t kMaxNormWidth = 12288;

// out[r] = w * T(norm(x[r] + add'[r])) for r < rows, n <= kMaxNormWidth
// columns, with norm(v) = v * rsqrt(mean(v^2) + eps) in fp32, and add' =
// T(add + add_delta) (add_delta: add's LoRA delta from LoraExpand, or
// null). When add is given, the sum x + add' (rounded to T) is also
// written to sum_out (which may alias x); add may be null (no sum).
// inv_out [rows] fp32, when given, gets each row's rsqrt(mean(v^2) + eps)
// (the trainer's RMSNorm keeps it for the backward, model/lean_ops.h).
void RmsNorm(bool bf16, const void* x, const void* add, const void* add_delta, void* sum_out, const void* w,
             void* out, int64_t rows, int64_t n, float eps, cudaStream_t stream, float* inv_out = nullptr);

}  // namespace loom::engine::cuda
