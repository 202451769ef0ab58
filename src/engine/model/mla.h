// Multi-head latent attention (MLA: deepseek_v2, deepseek_v3, as
// transformers' modeling_deepseek_v2/_v3), one of the decoder layer's
// shared blocks. Per token, with H heads, dn = qk_nope_head_dim, dr =
// qk_rope_head_dim, dv = v_head_dim, R = kv_lora_rank:
//   q    = q_proj(h), or q_b_proj(RMSNorm(q_a_proj(h))) with q compression;
//          per head [dn nope | dr rope];
//   kv_a = kv_a_proj_with_mqa(h) = [c (R) | k_rope (dr, one for all heads)];
//   c    = RMSNorm(c); kv_b_proj(c) per head = [k_nope (dn) | v (dv)];
//   q_rope and k_rope are rotated (RoPE over dr: adjacent pairs when
//   interleaved, as DeepSeek's complex RoPE; halves otherwise), in fp32;
//   attention of [q_nope | q_rope] over [k_nope | k_rope] (k_rope the same
//   for every head) with the softmax scale `scale`, values v, out [H * dv].
// The decoder layer (transformer_impl.h) runs the projections through the
// batch's LoRA (targets q_proj or q_a_proj and q_b_proj, kv_a_proj_with_mqa,
// kv_b_proj, o_proj) and this file's rotation; the trainer attends over the
// expanded keys and values (attention.h). The sampler caches only the
// latent row [c | rotated k_rope] (R + dr values a token and layer, against
// 2 H (dn + dr) expanded) and attends in the latent space: scores are
// (q_nope W_k,h) . c + q_rope . k_rope, the output W_v,h (probs . c), with
// W_k,h and W_v,h head h's rows of the (slot's LoRA'd) kv_b_proj.
//
// Threading: pure functions of their arguments; the engine or sampler thread.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "engine/lora/slot_bank.h"
#include "engine/model/dsa.h"

namespace loom::engine {

struct MlaWeights {
  at::Tensor q_w;                            // [H (dn + dr), hidden]; undefined with q compression
  at::Tensor q_a_w, q_a_b, q_a_norm, q_b_w;  // [Rq, hidden], [Rq] or undefined, [Rq], [H (dn + dr), Rq]
  at::Tensor kv_a_w, kv_a_b;                 // [R + dr, hidden], [R + dr] or undefined
  at::Tensor kv_a_norm;                      // [R]; both norms with kNormEps
  at::Tensor kv_b_w;                         // [H (dn + dv), R]
  int64_t heads = 0, nope = 0, rope = 0, v = 0, rank = 0;
  double scale = 0;         // the softmax scale (1/sqrt(dn + dr), times deepseek_v3's YaRN mscale^2)
  bool interleave = true;   // RoPE on adjacent pairs (else on halves)
  DsaIndexerWeights indexer;  // glm_moe_dsa's sparse attention (dsa.h), or undefined
  bool defined() const { return kv_a_w.defined(); }
  int64_t qk() const { return nope + rope; }
  // HF builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default
  // eps, not config.rms_norm_eps (GLM-5's 1e-5 differs; DeepSeek's 1e-6 hid it).
  static constexpr double kNormEps = 1e-6;
};

// RoPE over x [T, n, dr] with the fp32 tables cos, sin [T, 1, dr] (each
// frequency twice, halves layout, already scaled: transformer_impl.h's
// Rope), computed in fp32 and returned in x's dtype. Interleaved: pair
// (2j, 2j + 1) turns by frequency j; else pair (j, j + dr/2).
at::Tensor MlaRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave);

// The sampler's decode attention in the latent space: one query row per
// sequence, q [S, H, dn + dr] (post-RoPE, scaled as the trainer's), the
// latent pool [rows, 1, R + dr], the context rows/mask [S, L] as
// DecodeAttention takes them. kv_b is the bank's kv_b_proj target (null:
// no LoRA), used for sequence i's row with slot seq_slot[i] where that slot
// trains the attention group. Returns [S, H * dv] in q's dtype.
at::Tensor MlaDecodeAttention(const MlaWeights& w, const at::Tensor& q, const at::Tensor& pool, const at::Tensor& rows,
                              const at::Tensor& mask, const SlotBank& bank, const LoraTarget* kv_b,
                              const std::vector<int>& seq_slot);

// Cached latent rows lat [n, R + dr] expanded as the trainer computes them:
// keys [n, H, dn + dr] and values [n, H, dv] through kv_b_proj with slot's
// LoRA (slot -1 or one that does not train attention: the base's).
std::pair<at::Tensor, at::Tensor> MlaExpandLatent(const MlaWeights& w, const at::Tensor& lat, const SlotBank& bank,
                                                  const LoraTarget* kv_b, int slot);

}  // namespace loom::engine
