// Gemv: the matrix-vector kernel for decode projections of a few rows
// (cuBLAS is slower there).
//
// Conventions of every decode kernel (the model dtype T, where results
// round, streams and buffer ownership): engine/sample/cuda/device.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// y [rows, n] = x [rows, k] @ W[n, k]^T (+ bias[n]) for a few rows (the
// decode step's matrix-vector products), fp32 accumulation rounded to T;
// y_f32 stores those T-rounded values as fp32 (the logits). Returns false,
// launching nothing, when rows > kGemvMaxRows or the operands are not
// 16-byte aligned rows (the caller then uses cuBLAS).
constexpr int64_t kGemvMaxRows = 4;
bool Gemv(bool bf16, const void* x, int64_t ldx, const void* W, const void* bias, void* y, bool y_f32, int64_t rows,
          int64_t n, int64_t k, cudaStream_t stream);

}  // namespace loom::engine::cuda
