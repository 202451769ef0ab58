// The backward passes of the lean RMSNorm and SwiGLU nodes (model/lean_ops.h)
// as one kernel each, for CUDA tensors: the ATen sequence they replace is ~10
// elementwise and reduction kernels with fp32 intermediates in memory.
//
// Conventions: raw pointers and a stream (no libtorch: these build in the
// CUDA kernels' own library), contiguous row-major buffers, T the model
// dtype (bf16 or fp32, chosen by `bf16`). Each kernel rounds where the ATen
// sequence does (to T after an op ATen runs in T, fp32 elsewhere), so its
// result is that sequence's to float rounding (the order of one row's sum
// differs). Asynchronous on `stream`.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// The widest row RmsNormGrad takes (12 elements per thread of 1024).
constexpr int64_t kMaxNormGradWidth = 12288;

// dx = T(inv * (dn - n * mean(dn * n))) per row, with dn = T(g * w) in fp32,
// n = x * inv; g, x, dx [rows, width], w [width], inv [rows] fp32.
void RmsNormGrad(bool bf16, const void* g, const void* x, const void* w, const float* inv, void* dx, int64_t rows,
                 int64_t width, cudaStream_t stream);

// For gate_up = [g, u] [rows, 2 * inter] and dy [rows, inter], in fp32 and
// rounded once to T: d_gate = dy * u * s * (1 + g (1 - s)), d_up = dy * g * s
// with s = sigmoid(g), written as [d_gate, d_up] [rows, 2 * inter].
void SwiGluGrad(bool bf16, const void* gate_up, const void* dy, void* d_gate_up, int64_t rows, int64_t inter,
                cudaStream_t stream);

}  // namespace loom::engine::cuda
