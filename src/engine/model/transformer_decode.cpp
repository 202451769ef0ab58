// Transformer::ForwardCached: the sampler's incremental forward. It is
// Hidden() with the attention split in two: keys/values of the new tokens go
// into the paged KV cache, and each query reads its context back from there.
// Every other op is Hidden()'s, in the same order and dtype, so a token's
// hidden state here equals the trainer's to float rounding (the
// trainer/sampler consistency test in tests/engine/sample_*_test.cpp).
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "engine/model/cached_batch.h"
#include "engine/model/transformer.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {
namespace {

// One query token per row over its gathered context, as MathCausal computes
// it: q [S, H, hd]; pools [rows, KVH, hd]; rows/mask [S, L] (column j =
// position j). A non-plain variant also hides the keys outside the window
// of the query's position (positions [S]) and adds its sinks, as the
// trainer's explicit-mask path (attention.h). Returns [S, H*hd].
at::Tensor DecodeAttention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& rows, at::Tensor mask, const AttentionVariant& variant,
                           const at::Tensor& positions) {
  const int64_t S = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_pool.size(1), L = rows.size(1);
  const int64_t group = H / KVH, dv = v_pool.size(2);
  const at::Tensor flat = rows.reshape({-1});
  const at::Tensor k = k_pool.index_select(0, flat).view({S, L, KVH, hd});
  const at::Tensor v = v_pool.index_select(0, flat).view({S, L, KVH, dv});
  const at::Tensor qg = q.reshape({S, KVH, group, 1, hd});
  // [S, KVH, 1, hd, L]
  const at::Tensor kt = k.permute({0, 2, 3, 1}).unsqueeze(2);
  at::Tensor scores = at::matmul(qg, kt) * (1.0 / std::sqrt(static_cast<double>(hd)));  // [S, KVH, G, 1, L]
  if (variant.window > 0) {
    const at::Tensor j = at::arange(L, positions.options()).unsqueeze(0);
    mask = mask.logical_and(j > positions.unsqueeze(1) - variant.window);
  }
  scores = scores.masked_fill(mask.logical_not().view({S, 1, 1, 1, L}), -std::numeric_limits<double>::infinity());
  const at::Tensor probs =
      variant.sinks.defined()
          ? SinkSoftmax(scores, variant.sinks.to(scores.scalar_type()).view({1, KVH, group, 1, 1}))
          : at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  const at::Tensor vv = v.permute({0, 2, 1, 3}).unsqueeze(2);  // [S, KVH, 1, L, dv]
  return at::matmul(probs, vv).reshape({S, H * dv});
}

// A prefill where some rows continue a cached prefix: each such row's new
// queries attend to its cached keys and values, cached(i, rows) for row i's
// cache rows (read back from the pools), followed by its own new keys; rows
// without one take the packed causal path.
using CachedKv = std::function<std::pair<at::Tensor, at::Tensor>(size_t row, const at::Tensor& rows)>;
// A DSA layer's choice for row i (dsa.h), given the cache rows of its
// cached prefix (none: empty), over that prefix and its new tokens, or undefined.
using RowChoice = std::function<at::Tensor(size_t row, const at::Tensor& rows)>;
at::Tensor PrefillOverCachedPrefix(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const CachedBatch& batch, AttentionKernel kernel, const AttentionVariant& variant,
                                   const CachedKv& cached, const RowChoice& choice = nullptr) {
  std::vector<at::Tensor> outs;
  int64_t rows_at = 0;
  for (size_t i = 0; i + 1 < batch.seq_begin.size(); ++i) {
    const int64_t begin = batch.seq_begin[i], n = batch.seq_begin[i + 1] - begin, c = batch.seq_cached[i];
    if (n == 0) continue;
    const at::Tensor qs = q.narrow(0, begin, n), ks = k.narrow(0, begin, n), vs = v.narrow(0, begin, n);
    const at::Tensor rows = batch.cached_rows.narrow(0, rows_at, c);
    rows_at += c;
    const at::Tensor keep = choice ? choice(i, rows) : at::Tensor();
    if (c == 0) {
      outs.push_back(keep.defined() ? DsaAttention(qs, ks, vs, keep, kernel)
                                    : PackedCausalAttention(qs, ks, vs, {0, n}, kernel, nullptr, &variant));
      continue;
    }
    const auto [kc, vc] = cached(i, rows);
    const at::Tensor kall = at::cat({kc.to(ks.scalar_type()), ks}, 0), vall = at::cat({vc.to(vs.scalar_type()), vs}, 0);
    outs.push_back(keep.defined() ? DsaAttention(qs, kall, vall, keep, kernel)
                                  : PrefixCausalAttention(qs, kall, vall, kernel, &variant));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

}  // namespace

KvRowShape Transformer::KvShape(const ModelConfig& c, int64_t layer) {
  if (c.IsMla()) {  // the latent row; a DSA layer that runs its indexer also its keys (dsa.h)
    const bool indexes = c.IsDsa() && c.DsaSource(layer) == layer;
    return {1, c.kv_lora_rank + c.qk_rope_head_dim, indexes ? 1 : 0, indexes ? c.index_head_dim : 0};
  }
  // A Gated DeltaNet layer: each token's pre-conv in_proj_qkv output and its a and b rows (gated_deltanet.h).
  if (c.IsLinearLayer(layer)) return {1, c.LinearConvDim() + 2 * c.linear_num_value_heads, 0, 0};
  const int64_t hd = c.head_dim > 0 ? c.head_dim : c.hidden_size / c.num_attention_heads;
  return {c.KvHeads(layer), hd, c.KvHeads(layer), c.ValueDim()};
}

std::vector<KvRowShape> Transformer::KvShapes(const ModelConfig& c) {
  std::vector<KvRowShape> shapes;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) shapes.push_back(KvShape(c, i));
  return shapes;
}

at::Tensor Transformer::ForwardCached(const CachedBatch& batch, KvCache& cache, const SlotBank& bank) const {
  c10::NoGradGuard no_grad;
  const Impl& m = *impl_;
  const double eps = config_.rms_norm_eps;

  const bool attn_lora = AnyTrains(bank, batch.seq_slot, TargetGroup::kAttn);
  const bool mlp_lora = AnyTrains(bank, batch.seq_slot, TargetGroup::kMlp);
  const BatchLora delta(bank, batch.seq_begin, batch.seq_slot, attn_lora, mlp_lora);
  const bool over_prefix = batch.prefill && std::any_of(batch.seq_cached.begin(), batch.seq_cached.end(),
                                                         [](int64_t c) { return c > 0; });
  // A prefill of many prompts: one batched attention per layer (as Hidden()).
  const PaddedLayout padded = batch.prefill && !over_prefix
                                  ? PaddedLayout::IfPreferred(batch.seq_begin, batch.tokens.device())
                                  : PaddedLayout{};

  auto lora = [&](size_t layer, std::initializer_list<int> ks, const at::Tensor& in, const at::Tensor& w,
                  const at::Tensor& b, bool on) { return delta.Project(layer, ks, in, w, b, on); };
  // New tokens' keys and values go into the paged cache; a prefill attends
  // within its own rows (and its cached prefix), a decode row reads its
  // context back from the cache.
  // DSA models: each indexing layer's choice, per row (dsa.h; a decode
  // step's one entry is all rows' [S, L]); a shared layer reads its source's.
  std::vector<std::vector<at::Tensor>> choices(config_.IsDsa() ? m.layers.size() : 0);
  auto attend = [&](size_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& latent,
                    const DsaIndex* index) {
    if (latent.defined()) {  // MLA: the pool holds each token's latent row
      const MlaWeights& w = m.layers[i].mla;
      const DsaIndexerWeights& dsa = w.indexer;
      cache.k[i].index_copy_(0, batch.write_rows, latent.unsqueeze(1).to(cache.k[i].scalar_type()));
      if (index) cache.v[i].index_copy_(0, batch.write_rows, index->k.unsqueeze(1).to(cache.v[i].scalar_type()));
      const LoraTarget* kv_b = attn_lora ? LayerTarget(bank, i, kTargetKvB) : nullptr;
      if (over_prefix) {  // the prefix's latents expanded as the trainer computed its keys and values
        RowChoice choice;
        if (dsa.defined()) {
          if (index) choices[i].assign(batch.seq_begin.size() - 1, at::Tensor());
          choice = [&](size_t row, const at::Tensor& rows) {
            if (index) {  // this row's queries over its cached indexer keys and its own
              const int64_t begin = batch.seq_begin[row], n = batch.seq_begin[row + 1] - begin;
              const at::Tensor own = index->k.narrow(0, begin, n);
              const at::Tensor keys = at::cat({cache.v[i].index_select(0, rows).squeeze(1).to(own.scalar_type()), own});
              choices[i][row] = DsaCausalChoice(index->Rows(begin, n), keys, dsa.topk);
            }
            return choices[static_cast<size_t>(index ? i : dsa.source)][row];
          };
        }
        return PrefillOverCachedPrefix(q, k, v, batch, attention_kernel_, m.layers[i].attn,
                                       [&](size_t row, const at::Tensor& rows) {
                                         const at::Tensor lat = cache.k[i].index_select(0, rows).squeeze(1);
                                         return MlaExpandLatent(w, lat.to(q.scalar_type()), bank, kv_b,
                                                                batch.seq_slot[row]);
                                       },
                                       choice);
      }
      if (batch.prefill)
        return dsa.defined() ? DsaPackedAttention(q, k, v, batch.seq_begin, attention_kernel_, padded.get(), dsa, index,
                                                  i, choices)
                             : PackedCausalAttention(q, k, v, batch.seq_begin, attention_kernel_, padded.get());
      at::Tensor mask = batch.context_mask;
      if (dsa.defined()) {  // each row's choice over its whole cached context
        if (index) {
          const int64_t S = batch.context_rows.size(0), L = batch.context_rows.size(1);
          const at::Tensor keys = cache.v[i].index_select(0, batch.context_rows.reshape({-1})).view({S, L, dsa.dim});
          choices[i] = {DsaChoose(DsaScores(index->q.unsqueeze(1), index->w.unsqueeze(1), keys).squeeze(1), mask,
                                  dsa.topk)};
        }
        mask = choices[static_cast<size_t>(index ? i : dsa.source)].at(0);
      }
      return MlaDecodeAttention(w, q, cache.k[i], batch.context_rows, mask, bank, kv_b, batch.seq_slot);
    }
    cache.k[i].index_copy_(0, batch.write_rows, k.to(cache.k[i].scalar_type()));
    cache.v[i].index_copy_(0, batch.write_rows, v.to(cache.v[i].scalar_type()));
    const AttentionVariant& variant = m.layers[i].attn;
    if (over_prefix)
      return PrefillOverCachedPrefix(q, k, v, batch, attention_kernel_, variant, [&](size_t, const at::Tensor& rows) {
        return std::pair{cache.k[i].index_select(0, rows), cache.v[i].index_select(0, rows)};
      });
    return batch.prefill ? PackedCausalAttention(q, k, v, batch.seq_begin, attention_kernel_, padded.get(), &variant)
                         : DecodeAttention(q, cache.k[i], cache.v[i], batch.context_rows, batch.context_mask,
                                           variant, batch.positions);
  };
  ExpertLoraRouting experts;
  if (mlp_lora && config_.num_experts > 0)
    experts = ExpertLoraRouting::Make(bank, batch.seq_begin, batch.seq_slot, batch.tokens.device());
  // A step of few rows (a decode step) takes the expert LoRA's pair form:
  // a fixed number of ops, no host read (moe.h).
  auto moe = [&](size_t i, const at::Tensor& h) {
    const auto [gate_up, down] = ExpertTargets(bank, i);
    if (experts.rows.defined() && gate_up && down && PairFormFits(h.size(0) * m.layers[i].moe.top_k, h.device()))
      return MoeForward(m.layers[i].moe, h, bank, gate_up, down, experts.rows);
    return MoeForward(m.layers[i].moe, h, bank, gate_up, down, &experts);
  };
  // A Gated DeltaNet layer's pool holds each token's [mixed | a | b] row.
  // With state slots (batch.seq_state), a decode step convolves the new row
  // with the K-1 rows before it and steps each row's recurrent state (O(1));
  // a prefill mixes each row's whole context (cached rows, then the new
  // ones) as the trainer does and leaves its final state in the slot.
  // Without them, every step mixes each row's whole context again.
  const bool states = !batch.seq_state.empty();
  const at::Tensor state_slots =
      states ? at::tensor(batch.seq_state, at::TensorOptions().dtype(at::kLong)).to(batch.tokens.device()) : at::Tensor();
  auto mix = [&](size_t i, const at::Tensor& mixed, const at::Tensor& a, const at::Tensor& b) {
    const GdnWeights& w = m.layers[i].gdn;
    const int64_t C = mixed.size(1), Hv = w.value_heads, K = w.conv_w.size(1);
    const at::Tensor rows = at::cat({mixed, a, b}, 1);
    at::Tensor& pool = cache.k[i];
    pool.index_copy_(0, batch.write_rows, rows.unsqueeze(1).to(pool.scalar_type()));
    if (states && !batch.prefill) {  // the K-1 rows before each new one, zeros before position 0
      const int64_t S = batch.context_rows.size(0);
      const at::Tensor pos = batch.positions.unsqueeze(1) -
                             at::arange(K - 1, 0, -1, at::TensorOptions().dtype(at::kLong).device(rows.device()));
      const at::Tensor at_rows = batch.context_rows.gather(1, pos.clamp_min(0));
      const at::Tensor before = pool.index_select(0, at_rows.reshape({-1})).view({S, K - 1, -1}).narrow(2, 0, C).to(
                                    rows.scalar_type()) *
                                (pos >= 0).unsqueeze(2).to(rows.scalar_type());
      GdnResult r = GdnMixStep(w, mixed, a, b, before.transpose(1, 2), cache.state[i].index_select(0, state_slots));
      cache.state[i].index_copy_(0, state_slots, r.state);
      return r.out;
    }
    if (batch.prefill && !over_prefix) {
      GdnResult r = GdnMix(w, mixed, a, b, batch.seq_begin);
      if (states) cache.state[i].index_copy_(0, state_slots, r.state);
      return r.out;
    }
    // Each row's context rows in position order, packed: the cached prefix
    // and the new tokens (prefill), or the context through the new token (decode).
    std::vector<int64_t> ctx_begin{0}, last_n;
    std::vector<at::Tensor> parts;
    const int64_t S = static_cast<int64_t>(batch.seq_begin.size()) - 1;
    int64_t cached_at = 0;
    for (int64_t r = 0; r < S; ++r) {
      const int64_t begin = batch.seq_begin[r], n = batch.seq_begin[r + 1] - begin;
      at::Tensor ctx;
      if (batch.prefill) {
        const int64_t c = batch.seq_cached.empty() ? 0 : batch.seq_cached[r];
        ctx = at::cat({pool.index_select(0, batch.cached_rows.narrow(0, cached_at, c)).squeeze(1).to(rows.scalar_type()),
                       rows.narrow(0, begin, n)});
        cached_at += c;
      } else {
        ctx = pool.index_select(0, batch.context_rows[r].masked_select(batch.context_mask[r])).squeeze(1)
                  .to(rows.scalar_type());
      }
      parts.push_back(ctx);
      ctx_begin.push_back(ctx_begin.back() + ctx.size(0));
      last_n.push_back(n);
    }
    const at::Tensor all = at::cat(parts);
    GdnResult mixedall = GdnMix(w, all.narrow(1, 0, C), all.narrow(1, C, Hv), all.narrow(1, C + Hv, Hv), ctx_begin);
    if (states) cache.state[i].index_copy_(0, state_slots, mixedall.state);
    std::vector<at::Tensor> mine;
    for (int64_t r = 0; r < S; ++r) mine.push_back(mixedall.out.narrow(0, ctx_begin[r + 1] - last_n[r], last_n[r]));
    return at::cat(mine);
  };
  return DecoderStack(m, at::embedding(m.embed, batch.tokens), batch.positions, dtype_, eps, attn_lora, mlp_lora,
                      lora, attend, moe, mix);
}

}  // namespace loom::engine
