// compat: the few places where libtorch 1.13 (Debian, CPU) and 2.x (the
// PyTorch wheel on the GPU machine) differ in API, hidden behind one macro and
// a handful of inline helpers. Include this instead of testing versions
// elsewhere. Never test TORCH_VERSION_PATCH (Debian reports 1.13.0 for 1.13.1).
#pragma once
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>  // c10::NoGradGuard: ATen.h alone lacks it in 2.x
#include <torch/version.h>

#define LOOM_TORCH_AT_LEAST(maj, mnr) \
  (TORCH_VERSION_MAJOR > (maj) || (TORCH_VERSION_MAJOR == (maj) && TORCH_VERSION_MINOR >= (mnr)))

namespace loom::engine::compat {

// True when this libtorch has a public, fused scaled_dot_product_attention
// (2.0+). On 1.13 the private prototype is a plain composite of the same math.
constexpr bool kHasFusedSdpa = LOOM_TORCH_AT_LEAST(2, 0);

// True when this libtorch has the grouped GEMM at::_grouped_mm (2.8+: bf16
// on sm90, widths aligned to 16 bytes), differentiable into both operands.
constexpr bool kHasGroupedMm = LOOM_TORCH_AT_LEAST(2, 8);

// x [P, K] times mat2[g] [K, N] for the rows of group g, groups given by
// offs [G] int32 (each group's end row). Only where kHasGroupedMm.
inline at::Tensor GroupedMm(const at::Tensor& x, const at::Tensor& mat2, const at::Tensor& offs) {
#if LOOM_TORCH_AT_LEAST(2, 8)
  return at::_grouped_mm(x, mat2, offs);
#else
  (void)mat2;
  (void)offs;
  TORCH_CHECK(false, "grouped GEMM needs libtorch 2.8+");
  return x;
#endif
}

// Causal attention of q [1, H, n, hd] over k, v [1, KVH, L, hd] (L >= n,
// the queries being the last n of the L positions: the lower-right causal
// mask), through the flash kernel by name, for inference only: undefined
// where it does not apply (gradients wanted, not CUDA bf16/fp16, head dim
// not a multiple of 8 up to 256, libtorch before 2.1). Why by name: on sm90
// SDPA's dispatch prefers cuDNN, which builds an execution plan per new
// shape, about 25 ms a layer; a sampler's prefills and cached-prefix turns
// are new shapes every time (measured: 900 ms of a 1,040 ms 80-token turn
// over 36 layers). Flash takes any lengths without a plan.
inline at::Tensor FlashCausalInference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if LOOM_TORCH_AT_LEAST(2, 1)
  const auto t = q.scalar_type();
  const int64_t hd = q.size(-1);
  if (at::GradMode::is_enabled() || !q.is_cuda() || (t != at::kBFloat16 && t != at::kHalf) || hd % 8 != 0 || hd > 256)
    return {};
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor kk = group == 1 ? k : k.repeat_interleave(group, 1);
  const at::Tensor vv = group == 1 ? v : v.repeat_interleave(group, 1);
  return std::get<0>(at::_scaled_dot_product_flash_attention(q, kk, vv, 0.0, /*is_causal=*/true));
#else
  (void)q;
  (void)k;
  (void)v;
  return {};
#endif
}

// Causal SDPA over one sequence. q [1, H, L, hd]; k, v [1, KVH, L, hd] with
// H a multiple of KVH (grouped-query attention). Scale is 1/sqrt(hd).
// Without gradients on a GPU: FlashCausalInference.
inline at::Tensor CausalSdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (at::Tensor o = FlashCausalInference(q, k, v); o.defined()) return o;
#if LOOM_TORCH_AT_LEAST(2, 5)
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, {}, /*enable_gqa=*/true);
#else
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor kk = group == 1 ? k : k.repeat_interleave(group, 1);
  const at::Tensor vv = group == 1 ? v : v.repeat_interleave(group, 1);
#if LOOM_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, kk, vv, {}, 0.0, /*is_causal=*/true);
#else
  // 1.13: private prototype returning (out, weights).
  return std::get<0>(at::_scaled_dot_product_attention(q, kk, vv, {}, 0.0, /*need_attn_weights=*/false,
                                                       /*is_causal=*/true));
#endif
#endif
}

}  // namespace loom::engine::compat
