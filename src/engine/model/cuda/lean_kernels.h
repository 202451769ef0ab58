// The trainer's fused elementwise kernels (model/lean_ops.h), for CUDA
// tensors: the backward passes of the lean RMSNorm and SwiGLU nodes, and the
// q/k/v tail of a decoder layer (the LoRA delta added to the fused
// projection, the per-head RMSNorm and RoPE) forward and backward. Each
// replaces an ATen sequence of ~10 elementwise and reduction kernels with
// fp32 intermediates in memory.
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
// n = x * inv; g, x, dx [rows, width], w [width], inv [rows] fp32. With add
// [rows, width] (the gradient the normed input also gets along the residual
// stream), dx = T(that + add).
void RmsNormGrad(bool bf16, const void* g, const void* x, const void* w, const float* inv, void* dx, int64_t rows,
                 int64_t width, cudaStream_t stream, const void* add = nullptr);

// For gate_up = [g, u] [rows, 2 * inter] and dy [rows, inter], in fp32 and
// rounded once to T: d_gate = dy * u * s * (1 + g (1 - s)), d_up = dy * g * s
// with s = sigmoid(g), written as [d_gate, d_up] [rows, 2 * inter].
void SwiGluGrad(bool bf16, const void* gate_up, const void* dy, void* d_gate_up, int64_t rows, int64_t inter,
                cudaStream_t stream);

// The q/k/v tail of a decoder layer. qkv (and its LoRA delta, or null)
// [rows, (H + 2 KVH) * hd], each token's H query heads, then KVH key and KVH
// value heads; cos and sin [rows, hd] (the pass's RoPE tables). Per token s
// and head h, with v = T(qkv + delta):
//   value heads  v_out [rows, KVH, hd] = v;
//   q and k      out = rope(T(w * T(v * inv))) with the head's norm weight
//                (q_norm or k_norm; both null: no norm, out = rope(v)),
//                inv = rsqrt(mean(v^2) + eps), rope(y) = T(T(y cos) +
//                T(rotate_half(y) sin)), into q_out [rows, H, hd] and
//                k_out [rows, KVH, hd];
//   and, with a norm, v into sum_out (null: not written; the caller keeps
//   qkv when delta is null) and inv into inv_out [rows, H + KVH] (may be null).
// head_dim: QkvHeadDimSupported (one warp per head; others are not launched).
inline bool QkvHeadDimSupported(int64_t head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }
void QkvNormRope(bool bf16, const void* qkv, const void* delta, const void* q_norm, const void* k_norm,
                 const void* cos, const void* sin, void* sum_out, float* inv_out, void* q_out, void* k_out,
                 void* v_out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps,
                 cudaStream_t stream);

// Its backward: d_qkv [rows, (H + 2 KVH) * hd] from dq, dk, dv (each may be
// null: zero), with sum the saved v (qkv when there was no delta) and inv
// the saved 1/rms. Per q/k head: d = T(T(g cos) + rotate_half^T(T(g sin))),
// then with a norm RmsNormGrad's formula over the head; value heads: dv.
void QkvNormRopeGrad(bool bf16, const void* sum, const void* q_norm, const void* k_norm, const float* inv,
                     const void* cos, const void* sin, const void* dq, const void* dk, const void* dv, void* d_qkv,
                     int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream);

}  // namespace loom::engine::cuda
