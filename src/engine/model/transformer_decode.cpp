// Transformer::ForwardCached: the sampler's incremental forward. It is
// Hidden() with the attention split in two: keys/values of the new tokens go
// into the paged KV cache, and each query reads its context back from there.
// Every other op is Hidden()'s, in the same order and dtype, so a token's
// hidden state here equals the trainer's to float rounding (the
// trainer/sampler consistency test in tests/engine/sample_*_test.cpp).
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>
#include <string>

#include "engine/model/cached_batch.h"
#include "engine/model/transformer.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {
namespace {

// Hidden()'s RMSNorm: normalise in fp32, cast back, scale.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// One query token per row over its gathered context, as MathCausal computes
// it: q [S, H, hd]; pools [rows, KVH, hd]; rows/mask [S, L]. Returns [S, H*hd].
at::Tensor DecodeAttention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& rows, const at::Tensor& mask) {
  const int64_t S = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_pool.size(1), L = rows.size(1);
  const int64_t group = H / KVH;
  const at::Tensor flat = rows.reshape({-1});
  const at::Tensor k = k_pool.index_select(0, flat).view({S, L, KVH, hd});
  const at::Tensor v = v_pool.index_select(0, flat).view({S, L, KVH, hd});
  const at::Tensor qg = q.reshape({S, KVH, group, 1, hd});
  // [S, KVH, 1, hd, L]
  const at::Tensor kt = k.permute({0, 2, 3, 1}).unsqueeze(2);
  at::Tensor scores = at::matmul(qg, kt) * (1.0 / std::sqrt(static_cast<double>(hd)));  // [S, KVH, G, 1, L]
  scores = scores.masked_fill(mask.logical_not().view({S, 1, 1, 1, L}), -std::numeric_limits<double>::infinity());
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  const at::Tensor vv = v.permute({0, 2, 1, 3}).unsqueeze(2);  // [S, KVH, 1, L, hd]
  return at::matmul(probs, vv).reshape({S, H * hd});
}

}  // namespace

at::Tensor Transformer::ForwardCached(const CachedBatch& batch, KvCache& cache, const SlotBank& bank) const {
  c10::NoGradGuard no_grad;
  const Impl& m = *impl_;
  const int64_t T = batch.tokens.size(0), hd = m.head_dim;
  const int64_t qn = m.heads * hd, kvn = m.kv_heads * hd;
  const double eps = config_.rms_norm_eps;

  const size_t per_layer = 7;
  auto target = [&](size_t index, const std::string& module) -> const LoraTarget* {
    const auto& ts = bank.targets();
    if (index < ts.size() && ts[index].module == module) return &ts[index];
    return bank.find(module);
  };
  bool attn_lora = false, mlp_lora = false;
  for (int s : batch.seq_slot) {
    attn_lora = attn_lora || bank.trains(s, TargetGroup::kAttn);
    mlp_lora = mlp_lora || bank.trains(s, TargetGroup::kMlp);
  }
  auto delta = [&](const LoraTarget* t, const at::Tensor& x) {
    return bank.Delta(*t, x, batch.seq_begin, batch.seq_slot).to(x.scalar_type());
  };

  const at::Tensor freqs = batch.positions.to(at::kFloat).unsqueeze(1) * m.inv_freq.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos().to(dtype_).unsqueeze(1);
  const at::Tensor sin = emb.sin().to(dtype_).unsqueeze(1);

  at::Tensor x = at::embedding(m.embed, batch.tokens);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const Impl::Layer& l = m.layers[i];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const size_t base = i * per_layer;

    at::Tensor h = RmsNorm(x, l.input_norm, eps);
    const at::Tensor qkv = at::linear(h, l.qkv_w, l.qkv_b);
    at::Tensor q = qkv.narrow(1, 0, qn), k = qkv.narrow(1, qn, kvn), v = qkv.narrow(1, qn + kvn, kvn);
    if (attn_lora) {
      q = q + delta(target(base + 0, p + "self_attn.q_proj"), h);
      k = k + delta(target(base + 1, p + "self_attn.k_proj"), h);
      v = v + delta(target(base + 2, p + "self_attn.v_proj"), h);
    }
    q = q.reshape({T, m.heads, hd});
    k = k.reshape({T, m.kv_heads, hd});
    v = v.reshape({T, m.kv_heads, hd});
    if (l.q_norm.defined()) {
      q = RmsNorm(q, l.q_norm, eps);
      k = RmsNorm(k, l.k_norm, eps);
    }
    q = q * cos + RotateHalf(q) * sin;
    k = k * cos + RotateHalf(k) * sin;
    cache.k[i].index_copy_(0, batch.write_rows, k.to(cache.k[i].scalar_type()));
    cache.v[i].index_copy_(0, batch.write_rows, v.to(cache.v[i].scalar_type()));
    const at::Tensor attn =
        batch.prefill ? PackedCausalAttention(q, k, v, batch.seq_begin, attention_kernel_)
                      : DecodeAttention(q, cache.k[i], cache.v[i], batch.context_rows, batch.context_mask);
    at::Tensor o = at::linear(attn, l.o_w, l.o_b);
    if (attn_lora) o = o + delta(target(base + 3, p + "self_attn.o_proj"), attn);
    x = x + o;

    h = RmsNorm(x, l.post_norm, eps);
    const at::Tensor gate_up = at::linear(h, l.gate_up_w);
    at::Tensor gate = gate_up.narrow(1, 0, m.inter), up = gate_up.narrow(1, m.inter, m.inter);
    if (mlp_lora) {
      gate = gate + delta(target(base + 4, p + "mlp.gate_proj"), h);
      up = up + delta(target(base + 5, p + "mlp.up_proj"), h);
    }
    const at::Tensor act = at::silu(gate) * up;
    at::Tensor down = at::linear(act, l.down_w);
    if (mlp_lora) down = down + delta(target(base + 6, p + "mlp.down_proj"), act);
    x = x + down;
  }
  return RmsNorm(x, m.norm, eps).to(at::kFloat);
}

}  // namespace loom::engine
