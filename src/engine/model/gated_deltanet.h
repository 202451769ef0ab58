// Gated DeltaNet (the linear-attention layer of qwen3_next and qwen3_5_moe,
// as transformers' modeling_qwen3_5_moe / modeling_qwen3_next compute it),
// one of the decoder layer's shared blocks: the pieces between the layer's
// projections, each a pure function over at::Tensor. Per token, with Hk key
// heads of width dk, Hv value heads of width dv (Hv a multiple of Hk) and a
// convolution of K taps (linear_conv_kernel_dim):
//   [q | k | v] = in_proj_qkv(h)  (q, k: Hk * dk each; v: Hv * dv; in that
//                 order, each block head-major);
//   [q | k | v] = SiLU(causal depthwise conv over the sequence, K taps, no
//                 bias)                                        GdnCausalConv
//   z = in_proj_z(h) [Hv, dv];  b = in_proj_b(h), a = in_proj_a(h) [Hv];
//   beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias) (<= 0,
//                 fp32)                                        GdnGates
//   o = the gated delta rule over (q, k, v, g, beta), value head h reading
//       key head h / (Hv / Hk) (consecutive value heads share a key head);
//       q and k are L2-normalised and q scaled by dk^-0.5 inside it
//                                                              GatedDeltaRule*
//   y = out_proj(GatedRmsNorm(o, z) per value head)            GatedRmsNorm
// The rule, per value head, with state S [dk, dv] (zeros at a sequence's
// start unless carried in):
//   S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
// Two forms with the same values: the token-by-token recurrence (HF's
// torch_recurrent_gated_delta_rule; the decode step) and the chunked form
// (HF's torch_chunk_gated_delta_rule, chunks of 64; what training runs):
// within a chunk the C updates are one unit-lower-triangular solve (the
// WY/UT form of the delta rule), and only the chunk-to-chunk state hand-off
// is sequential. Both compute in fp32 whatever the inputs' dtype, return the
// outputs in q's dtype and the recurrent state in fp32, and are
// differentiable through autograd (every input, the initial state included).
//
// A packed batch is one token axis over several sequences, seq_begin its
// S+1 cumulative offsets (PackedBatch); no sequence ever reads another's
// rows. The sampler caches each token's pre-conv row and a, b (so the
// conv's state is the last K-1 of them) and carries each running
// sequence's recurrent state [Hv, dk, dv] (fp32) in a slot: a prefill
// leaves it there (GdnMix), a decode step steps it (GdnMixStep;
// transformer_decode.cpp).
//
// Threading: pure functions of their arguments; the engine or sampler thread.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace loom::engine {

// HF's chunk length (torch_chunk_gated_delta_rule's chunk_size).
constexpr int64_t kGdnChunk = 64;

struct GdnResult {
  at::Tensor out;    // [n, Hv, dv] (packed: [T, Hv, dv]) in q's dtype
  at::Tensor state;  // [Hv, dk, dv] (packed, step: [S, Hv, dk, dv]) fp32
};

// One Gated DeltaNet layer's frozen weights (the decoder layer runs its
// projections through the batch's LoRA: targets linear_attn.in_proj_qkv,
// in_proj_z, in_proj_b, in_proj_a, out_proj).
struct GdnWeights {
  at::Tensor in_qkv_w, in_z_w, in_b_w, in_a_w, out_w;  // [C, hidden], [Hv dv, hidden], [Hv, hidden] x2, [hidden, Hv dv]
  at::Tensor conv_w;                                   // [C, K]
  at::Tensor A_log, dt_bias;                           // [Hv]
  at::Tensor norm_w;                                   // [dv]: GatedRmsNorm's
  int64_t key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0;
  bool defined() const { return in_qkv_w.defined(); }
};

// The layer's token mixing over a packed batch, between its projections:
// mixed [T, C] (in_proj_qkv's output, before the conv), a and b [T, Hv];
// the conv (GdnCausalConv), the split into q, k, v, the gates (GdnGates)
// and the chunked rule, each sequence from zero state. Returns the rule's
// output [T, Hv, dv] in mixed's dtype (GatedRmsNorm with z comes after) and
// each sequence's final recurrent state [S, Hv, dk, dv] (fp32).
GdnResult GdnMix(const GdnWeights& w, const at::Tensor& mixed, const at::Tensor& a, const at::Tensor& b,
                 const std::vector<int64_t>& seq_begin);
// One new token of each of S sequences (the sampler's decode step): its
// rows mixed [S, C], a, b [S, Hv], the K-1 pre-conv rows before it (before
// [S, C, K-1], oldest first, zeros before a sequence's start) and the
// recurrent state after them (state [S, Hv, dk, dv], fp32). Returns the
// rule's output [S, Hv, dv] and the new states: GdnMix's values for the
// token, at O(1) a step (the recurrence's arithmetic).
GdnResult GdnMixStep(const GdnWeights& w, const at::Tensor& mixed, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& before, const at::Tensor& state);

struct GdnConvResult {
  at::Tensor y;      // [T, C], x's dtype
  at::Tensor state;  // [S, C, K-1], x's dtype: each sequence's last K-1 inputs
};

// The causal depthwise convolution with SiLU over a packed batch: x [T, C]
// (the rows of S sequences, seq_begin S+1 offsets), weight [C, K] (HF's
// conv1d.weight [C, 1, K] squeezed; tap K-1 multiplies the current row).
// Row t of a sequence is SiLU(sum_j weight[:, j] * x[t - (K-1) + j]), where
// rows before the sequence's first are its initial_state [S, C, K-1] (the
// K-1 inputs that came before, oldest first; zeros where undefined). As HF's
// causal_conv1d_fn (conv1d with K-1 padding, cut to the sequence) and
// causal_conv1d_update (one token after a cached state); computed in fp32
// (HF convolves in the weight's dtype: one rounding of the pre-activation
// apart in bf16), returned in x's dtype. The final state of a sequence
// shorter than K-1 still holds part of its initial state.
GdnConvResult GdnCausalConv(const at::Tensor& x, const at::Tensor& weight, const std::vector<int64_t>& seq_begin,
                            const at::Tensor& initial_state = {});

// The gates of a row: a, b [.., Hv] (in_proj_a, in_proj_b outputs), A_log
// and dt_bias [Hv]. Returns {g, beta}: g = -exp(A_log) * softplus(a +
// dt_bias) in fp32 (A_log and a cast up first, as HF), beta = sigmoid(b) in
// b's dtype.
std::pair<at::Tensor, at::Tensor> GdnGates(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                                           const at::Tensor& dt_bias);


// The gated delta rule over one sequence: q, k [n, Hk, dk], v [n, Hv, dv],
// g [n, Hv] (log decay, <= 0), beta [n, Hv], initial_state [Hv, dk, dv] or
// undefined (zeros). All are cast to fp32; q and k are repeated to Hv heads
// (head h = key head h / (Hv / Hk)) and L2-normalised over dk there
// (x * rsqrt(sum x^2 + 1e-6), HF's l2norm with use_qk_l2norm_in_kernel),
// then q is scaled by dk^-0.5. Chunked: chunks of `chunk` tokens (the last
// padded with zero rows, which leave the state alone).
GdnResult GatedDeltaRuleChunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, const at::Tensor& initial_state = {},
                                int64_t chunk = kGdnChunk);
// The same values token by token.
GdnResult GatedDeltaRuleRecurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, const at::Tensor& initial_state = {});

// One token of each of S sequences (the sampler's decode step): q, k
// [S, Hk, dk], v [S, Hv, dv], g, beta [S, Hv], state [S, Hv, dk, dv] or
// undefined. Returns out [S, Hv, dv] and the new states; the recurrence's
// arithmetic exactly.
GdnResult GatedDeltaStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                         const at::Tensor& beta, const at::Tensor& state = {});

enum class GdnForm { kChunked, kRecurrent };

// The rule over a packed batch: q, k [T, Hk, dk], v [T, Hv, dv], g, beta
// [T, Hv], seq_begin S+1 offsets, initial_state [S, Hv, dk, dv] or
// undefined. The sequences are gathered into a right-padded [S, L] layout
// (L the longest, rounded up to the chunk when chunked; pad rows are zero
// and leave the state alone), run as one batch, and the real rows scattered
// back: out [T, Hv, dv] and each sequence's final state [S, Hv, dk, dv]
// (its initial state for an empty sequence). Equal to the one-sequence
// calls row by row.
GdnResult GatedDeltaRulePacked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const std::vector<int64_t>& seq_begin,
                               const at::Tensor& initial_state = {}, GdnForm form = GdnForm::kChunked,
                               int64_t chunk = kGdnChunk);

// HF's RMSNormGated (norm before gate) over the last dim d: x, z [.., d],
// weight [d] (initialised to ones: a plain x * w RMSNorm, not the layers'
// 1 + w). In fp32, x * rsqrt(mean(x^2) + eps), rounded to x's dtype, times
// weight (in the promoted dtype of the two), times SiLU(z) in fp32; returned
// in x's dtype. The op order is HF's, so the bf16 roundings match.
at::Tensor GatedRmsNorm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps);

}  // namespace loom::engine
