// lean_ops: the decoder layer's elementwise pieces as autograd nodes that
// keep less for the backward pass than ATen's op-by-op graph does, with the
// backward written out. On the CPU the forward values are those of the
// plain ops, bit for bit (the same ATen calls in the same order, run without
// a graph); the gradients equal autograd's through the plain ops to float
// rounding (tests/engine/recompute_test.cpp compares them, on CUDA too).
//
//   RmsNormLean   keeps x (its own dtype) and 1/rms [.., 1] fp32, where the
//                 op-by-op graph keeps an fp32 copy of x, its square and the
//                 normed rows: for bf16 rows of width D, 2D + 4 bytes a row
//                 instead of about 12D. The weight is frozen (no gradient).
//   SwiGluLean    silu(gate) * up over the fused [.., 2I] projection; keeps
//                 that input only (the graph also keeps silu(gate)).
//   RopeLean      x * cos + rotate_half(x) * sin; keeps cos and sin only,
//                 and its backward is g * cos + rotate_half^T(g * sin), where
//                 the graph makes a dense zero gradient per half slice.
//                 Tables narrower than x (partial RoPE) turn its first
//                 cos.size(-1) dims only.
//   SplitLean     column blocks of one [T, n] tensor (the fused q/k/v
//                 projection) as views; the backward is one cat of the
//                 blocks' gradients, where the graph makes a dense zero
//                 [T, n] gradient per block and adds them.
//
// Without grad mode (the sampler) all are the plain ops on the CPU. On CUDA
// (bf16 or fp32, in grad mode or not) RMSNorm and SwiGLU run as one kernel
// forward (the decode kernels, sample/cuda/rmsnorm.h and silu.h) and one
// backward (model/cuda/lean_kernels.h), and the q/k/v tail (QkvTailLean) as
// one kernel each way; their values are then the plain ops' to float
// rounding (a row's sum is taken in another order), not bit for bit.
//
// Threading: pure functions; any thread.
#pragma once
#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace loom::engine {

// RMSNorm as Hugging Face computes it: normalise in fp32, cast back to the
// input dtype, then scale by the weight; with an fp32 weight on lower-precision
// x (gpt_oss), scale in fp32 and then cast. The plain op sequence.
at::Tensor RmsNormPlain(const at::Tensor& x, const at::Tensor& weight, double eps);
// The same values; differentiable into x only, keeping x and 1/rms.
at::Tensor RmsNormLean(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(g) * u for gate_up = [g, u] over its last dimension (each of width
// I): the plain ops, and the lean node keeping only gate_up.
at::Tensor SwiGluPlain(const at::Tensor& gate_up);
at::Tensor SwiGluLean(const at::Tensor& gate_up);

// HF's rotary embedding x * cos + rotate_half(x) * sin, rotate_half([x1,
// x2]) = [-x2, x1] over the last dimension; cos and sin broadcast against x
// and are constants (no gradient).
at::Tensor RopePlain(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor RopeLean(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// x [T, sum(widths)] as the views x[:, b_i : b_i + widths[i]].
std::vector<at::Tensor> SplitLean(const at::Tensor& x, const std::vector<int64_t>& widths);

// The q/k/v tail of a decoder layer: from the fused projection qkv [T, (H +
// 2 KVH) * hd] plus its LoRA delta (same shape, or undefined), the heads
// q [T, H, hd], k and v [T, KVH, hd], with q and k per-head RMS-normed
// (q_norm / k_norm [hd], both undefined: no norm) and rotated (RoPE tables
// cos and sin [T, 1, hd]). The plain path is SplitLean, RmsNormLean and
// RopeLean over qkv + delta; on CUDA it is one kernel forward and one
// backward (model/cuda/lean_kernels.h), with gradients into qkv and delta.
// The residual add of a block's output o (plus its LoRA delta, or
// undefined) and the next RMSNorm: {x + (o + delta), RmsNormLean of that}.
// On CUDA one kernel each way (the decode RmsNorm forward takes the add and
// the delta; the backward adds the residual stream's gradient).
std::pair<at::Tensor, at::Tensor> AddRmsNormLean(const at::Tensor& x, const at::Tensor& o, const at::Tensor& delta,
                                                 const at::Tensor& weight, double eps);

struct QkvHeads {
  at::Tensor q, k, v;
};
// v_dim: the values' width when it differs from head_dim (mimo_v2_flash;
// 0: head_dim); such a split takes the plain path.
QkvHeads QkvTailLean(const at::Tensor& qkv, const at::Tensor& delta, const at::Tensor& q_norm,
                     const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, double eps, int64_t v_dim = 0);

}  // namespace loom::engine
