// lean_ops: the decoder layer's elementwise pieces as autograd nodes that
// keep less for the backward pass than ATen's op-by-op graph does, with the
// backward written out. The forward values are those of the plain ops, bit
// for bit (the same ATen calls in the same order, run without a graph); the
// gradients equal autograd's through the plain ops to float rounding
// (tests/engine/lean_ops_test.cpp compares them, on CUDA too).
//
//   RmsNormLean   keeps x (its own dtype) and 1/rms [.., 1] fp32, where the
//                 op-by-op graph keeps an fp32 copy of x, its square and the
//                 normed rows: for bf16 rows of width D, 2D + 4 bytes a row
//                 instead of about 12D. The weight is frozen (no gradient).
//   SwiGluLean    silu(gate) * up over the fused [.., 2I] projection; keeps
//                 that input only (the graph also keeps silu(gate)).
//
// Without grad mode (the sampler) both are the plain ops.
//
// Threading: pure functions; any thread.
#pragma once
#include <ATen/ATen.h>

namespace loom::engine {

// RMSNorm as Hugging Face computes it: normalise in fp32, cast back to the
// input dtype, then scale by the weight. The plain op sequence.
at::Tensor RmsNormPlain(const at::Tensor& x, const at::Tensor& weight, double eps);
// The same values; differentiable into x only, keeping x and 1/rms.
at::Tensor RmsNormLean(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(g) * u for gate_up = [g, u] over its last dimension (each of width
// I): the plain ops, and the lean node keeping only gate_up.
at::Tensor SwiGluPlain(const at::Tensor& gate_up);
at::Tensor SwiGluLean(const at::Tensor& gate_up);

}  // namespace loom::engine
