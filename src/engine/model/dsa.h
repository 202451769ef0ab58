// DeepSeek sparse attention (DSA: glm_moe_dsa, GLM-5 and GLM-5.2, as
// transformers' modeling_glm_moe_dsa), one of MLA's (mla.h) shared blocks.
// Each layer has a lightning indexer, frozen (no LoRA, no gradient), that
// picks the keys its queries attend to. Per token, with Hi = index_n_heads,
// Di = index_head_dim, dr = qk_rope_head_dim:
//   iq = wq_b(q_resid) per head [Hi, Di], q_resid the layer's normed
//        q_a_proj output (with the slot's LoRA, as PEFT's model computes it);
//   ik = LayerNorm(wk(h)) [Di], h the layer's normed input;
//   the first dr dims of iq and ik turn by RoPE (adjacent pairs, the MLA's tables);
//   iw = weights_proj(h) [Hi] (fp32) * Hi^-1/2 * Di^-1/2;
//   score(query s, key t) = sum_h iw[s, h] relu(iq[s, h] . ik[t]);
// and query s attends to the index_topk keys of best score among those it
// may see (causal): all of them while it sees at most index_topk. A
// "shared" layer (ModelConfig::indexer_types) reuses the choice of the
// nearest full layer below it. The trainer and the sampler's prefill take
// the explicit-mask attention path (attention.h, AttentionVariant::keep)
// only where a sequence is longer than index_topk (else the choice is every
// earlier key: plain causal attention); the sampler caches each token's ik
// beside its latent row (the V pool of a full layer: [1, Di]) and chooses
// a decode row's keys over its whole cached context.
//
// Threading: pure functions of their arguments; the engine or sampler thread.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "engine/model/attention.h"

namespace loom::engine {

struct DsaIndexerWeights {
  at::Tensor wq_b;                // [Hi * Di, q_lora_rank]
  at::Tensor wk;                  // [Di, hidden]
  at::Tensor k_norm_w, k_norm_b;  // [Di]: LayerNorm (eps 1e-6)
  at::Tensor weights_proj;        // [Hi, hidden], fp32 (HF keeps it so)
  int64_t heads = 0, dim = 0, rope = 0, topk = 0;
  int64_t source = 0;  // the layer whose choice this layer's queries take (ModelConfig::DsaSource)
  bool defined() const { return topk > 0; }
};

// One layer's indexer over rows [T]: iq [T, Hi, Di] and iw [T, Hi] in
// fp32 (iw with both scales folded in), ik [T, Di] in the model dtype.
struct DsaIndex {
  at::Tensor q, w, k;
  DsaIndex Rows(int64_t begin, int64_t n) const { return {q.narrow(0, begin, n), w.narrow(0, begin, n), k.narrow(0, begin, n)}; }
};

// The indexer of rows with normed input h [T, hidden] and q_resid [T,
// q_lora_rank], RoPE from the MLA's fp32 tables cos, sin [T, 1, dr]. No
// gradient reaches its inputs.
DsaIndex DsaIndexRows(const DsaIndexerWeights& w, const at::Tensor& h, const at::Tensor& q_resid,
                      const at::Tensor& cos, const at::Tensor& sin);

// Scores [S, n, L] (fp32) of queries (iq [S, n, Hi, Di], iw [S, n, Hi])
// over keys ik [S, L, Di]; also unbatched ([n, ..] and [L, Di] -> [n, L]).
at::Tensor DsaScores(const at::Tensor& iq, const at::Tensor& iw, const at::Tensor& ik);

// The keys each query keeps: the topk best-scoring of the ones it may see
// (visible, bool, the scores' shape), all of them where it sees at most
// topk; of equal scores the earlier key (HF's top-k leaves ties to its kernel).
at::Tensor DsaChoose(const at::Tensor& scores, const at::Tensor& visible, int64_t topk);

// One sequence's choice: its n queries are the last n of the L positions
// whose keys are ik [L, Di] (query i sees keys 0..L-n+i). Undefined when
// L <= topk: every query then keeps every key it sees. Made in blocks of
// query rows, so that a block's [rows, Hi, L] scores stay near 256 MiB
// (rows_per_block > 0 fixes the block, for tests).
at::Tensor DsaCausalChoice(const DsaIndex& queries, const at::Tensor& ik, int64_t topk, int64_t rows_per_block = 0);

// Attention of one sequence's queries q [n, H, hd] (the last n positions)
// over k [L, H, hd], v [L, H, dv] with the keys `keep` [n, L] (from
// DsaCausalChoice; undefined: plain causal, on `kernel`). [n, H * dv].
// Without grad mode in blocks of query rows as above (the same values).
at::Tensor DsaAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep,
                        AttentionKernel kernel, int64_t rows_per_block = 0);

// One layer's attention over a packed batch (sequences seq_begin) in the
// trainer or a prefill: the layer's choice per sequence is made from `index`
// where it runs its own indexer and kept in choices[layer] (one entry a
// sequence; the vector is sized to the layers), else it is
// choices[w.source]'s. No sequence longer than topk: the plain packed path
// (kernel, padded); else one sequence at a time, explicit masks.
at::Tensor DsaPackedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::vector<int64_t>& seq_begin, AttentionKernel kernel,
                              const PaddedLayout* padded, const DsaIndexerWeights& w, const DsaIndex* index,
                              size_t layer, std::vector<std::vector<at::Tensor>>& choices);

}  // namespace loom::engine
