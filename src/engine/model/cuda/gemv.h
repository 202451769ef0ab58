// Gemv: the matrix-vector kernel for decode projections of a few rows
// (cuBLAS is slower there), and its mixture-of-experts form.
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

// The mixture-of-experts form, for a decode step's few (token, expert)
// pairs: y [pairs, n] row p = x row (p / x_div) @ W[experts[p]]^T
// (+ bias[experts[p]]), W [E, n, k], bias [E, n] or null, experts [pairs]
// int64 on the device (read there: a CUDA graph can hold the launch). Each
// pair reads only its expert's matrix. Rounded to T. False, launching
// nothing, past kExpertGemvMaxPairs pairs or on misaligned operands.
constexpr int64_t kExpertGemvMaxPairs = 32;
bool ExpertGemv(bool bf16, const void* x, int64_t ldx, int64_t x_div, const void* W, const void* bias,
                const int64_t* experts, void* y, int64_t pairs, int64_t n, int64_t k, cudaStream_t stream);

}  // namespace loom::engine::cuda
