// Attention over a packed batch: causal within each sequence, never across
// sequences. One function with two kernels that must agree: a plain math
// reference (the obviously-correct path tests compare against) and SDPA (the
// fused op of the libtorch in use). No padding and no T x T mask: each
// sequence [seq_begin[i], seq_begin[i+1]) is attended on its own.
//
// Pure function of its inputs; any thread.
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace loom::engine {

enum class AttentionKernel {
  kMath,  // explicit q k^T, causal -inf mask, fp32 softmax (as HF's eager path)
  kSdpa,  // scaled_dot_product_attention (fused on libtorch 2.x)
};

// The faster kernel for this libtorch build: SDPA on 2.x; math on 1.13,
// where the private SDPA is a slower composite of the same math.
AttentionKernel DefaultAttentionKernel();

// q [T, H, hd]; k, v [T, KVH, hd], H a multiple of KVH (grouped-query).
// seq_begin: S+1 cumulative offsets with seq_begin.back() == T.
// Returns [T, H * hd] in q's dtype; differentiable into q, k, v.
at::Tensor PackedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::vector<int64_t>& seq_begin, AttentionKernel kernel);

}  // namespace loom::engine
