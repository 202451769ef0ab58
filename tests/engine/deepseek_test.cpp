// The families with DeepSeek-style experts (deepseek_v2, deepseek_v3 with
// multi-head latent attention: engine/model/families/deepseek.cpp over
// model/mla.h; glm4_moe with partial RoPE: families/glm4_moe.cpp; their
// experts: families/deepseek_moe.h over model/moe.h): the packed forward with
// several slots' LoRA against a plain reference written here from HF's
// modeling code (values and LoRA gradients), the sampler's latent-space
// decode and its prefix reuse against the trainer, the KV row, and the
// config.json fields.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "cached_check.h"
#include "engine/model/cached_batch.h"
#include "engine/model/dsa.h"
#include "testmodel/make_model.h"
#include "tiny_model.h"

namespace loom::engine {
namespace {

ModelConfig TinyDeepseek(const std::string& arch) {
  auto c = testmodel::PresetConfig(arch, "tiny");
  EXPECT_TRUE(c.ok()) << c.status().message();
  return *c;
}

// HF's DeepSeek decoder, written out token by token where HF loops, with
// each sequence's slot's LoRA (scale * (x A^T) B^T per target; the experts'
// gate_up with one A and B per expert, down with A per expert and one B).
class Reference {
 public:
  Reference(const ModelConfig& c, std::map<std::string, at::Tensor> w, const SlotBank& bank)
      : c_(c), w_(std::move(w)), bank_(bank) {}

  // Log-probabilities [L, vocab] of one sequence under slot (-1: base).
  at::Tensor Logprobs(const std::vector<int32_t>& seq, int slot) const {
    slot_ = slot;
    const int64_t L = static_cast<int64_t>(seq.size()), H = c_.num_attention_heads;
    const int64_t dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim, dv = c_.v_head_dim, R = c_.kv_lora_rank;
    at::Tensor x = w_.at("model.embed_tokens.weight")
                       .index_select(0, at::tensor(std::vector<int64_t>(seq.begin(), seq.end()), at::kLong));
    // RoPE on adjacent pairs (DeepSeek's complex form; GLM-5's too, the
    // indexer's included): pair j turns by pos / theta^(2j / dr).
    const at::Tensor inv = 1.0 / at::pow(c_.rope_theta, at::arange(0, dr, 2, at::kFloat) / double(dr));
    const at::Tensor ang = at::arange(L, at::kFloat).unsqueeze(1) * inv.unsqueeze(0);  // [L, dr/2]
    const at::Tensor cs = ang.cos().unsqueeze(1), sn = ang.sin().unsqueeze(1);
    const auto rope = [&](const at::Tensor& t) {  // [L, n, dr]
      const at::Tensor p = t.reshape({L, t.size(1), dr / 2, 2});
      const at::Tensor a = p.select(-1, 0), b = p.select(-1, 1);
      return at::stack({a * cs - b * sn, a * sn + b * cs}, -1).reshape({L, t.size(1), dr});
    };
    const at::Tensor mask = at::ones({L, L}).tril();
    at::Tensor chosen;  // glm_moe_dsa: the keys the last full layer's indexer kept, [L, L]
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      const at::Tensor h = Rms(x, w_.at(p + "input_layernorm.weight"));
      if (!c_.IsMla()) {
        x = x + Gqa(i, h, mask);
      } else {
      const at::Tensor q_resid =
          c_.q_lora_rank > 0 ? Rms(Lin(p + "self_attn.q_a_proj", h), w_.at(p + "self_attn.q_a_layernorm.weight"), kMlaEps)
                             : at::Tensor();
      const at::Tensor q = (c_.q_lora_rank > 0 ? Lin(p + "self_attn.q_b_proj", q_resid) : Lin(p + "self_attn.q_proj", h))
                               .view({L, H, dn + dr});
      if (c_.IsDsa() && (i == 0 || c_.indexer_types[i] == "full")) chosen = IndexerChoice(p, h, q_resid, rope, mask);
      const at::Tensor keep = c_.IsDsa() ? chosen : mask;
      const at::Tensor kv_a = Lin(p + "self_attn.kv_a_proj_with_mqa", h);
      const at::Tensor kv = Lin(p + "self_attn.kv_b_proj", Rms(kv_a.narrow(1, 0, R), w_.at(p + "self_attn.kv_a_layernorm.weight"), kMlaEps))
                                .view({L, H, dn + dv});
      const at::Tensor q_rope = rope(q.narrow(2, dn, dr)), k_rope = rope(kv_a.narrow(1, R, dr).unsqueeze(1));
      std::vector<at::Tensor> heads;
      for (int64_t hh = 0; hh < H; ++hh) {
        const at::Tensor qh = at::cat({q.select(1, hh).narrow(1, 0, dn), q_rope.select(1, hh)}, 1);
        const at::Tensor kh = at::cat({kv.select(1, hh).narrow(1, 0, dn), k_rope.select(1, 0)}, 1);
        at::Tensor s = at::matmul(qh, kh.t()) / std::sqrt(double(dn + dr));
        s = s.masked_fill(keep == 0, -1e30);
        heads.push_back(at::matmul(at::softmax(s, -1), kv.select(1, hh).narrow(1, dn, dv)));
      }
      x = x + Lin(p + "self_attn.o_proj", at::cat(heads, 1));
      }
      const at::Tensor h2 = Rms(x, w_.at(p + "post_attention_layernorm.weight"));
      if (!c_.IsMoeLayer(i)) {
        x = x + Mlp(p + "mlp.", h2);
        continue;
      }
      x = x + Experts(p, h2);
      if (c_.n_shared_experts > 0) x = x + Mlp(p + "mlp.shared_experts.", h2);
    }
    x = Rms(x, w_.at("model.norm.weight"));
    return at::log_softmax(Lin("lm_head", x), -1);
  }

 private:
  // HF's q_a_layernorm and kv_a_layernorm keep its RMSNorm's default eps.
  static constexpr double kMlaEps = 1e-6;
  at::Tensor Rms(const at::Tensor& x, const at::Tensor& w, double eps = 0) const {
    return x * at::rsqrt(x.pow(2).mean(-1, true) + (eps > 0 ? eps : c_.rms_norm_eps)) * w;
  }
  // glm4_moe's and mimo_v2_flash's attention: q/k/v with their biases, q/k
  // RMSNorm per head (use_qk_norm), RoPE on the first head_dim *
  // partial_rotary_factor dims (pairs j, j + rd/2; mimo's sliding layers
  // with their own theta), grouped-query heads (mimo: twice as many on
  // sliding layers), values of v_head_dim times attention_value_scale, a
  // sliding window and per-head sink logits on mimo's sliding layers, o_proj.
  at::Tensor Gqa(int64_t layer, const at::Tensor& h, const at::Tensor& causal) const {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    const bool sliding = c_.IsSlidingLayer(layer);
    const int64_t L = h.size(0), H = c_.num_attention_heads, KV = c_.KvHeads(layer), hd = c_.head_dim;
    const int64_t rd = c_.RotaryDim(), dv = c_.ValueDim();
    at::Tensor q = Lin(p + "self_attn.q_proj", h).view({L, H, hd});
    at::Tensor k = Lin(p + "self_attn.k_proj", h).view({L, KV, hd});
    at::Tensor v = Lin(p + "self_attn.v_proj", h).view({L, KV, dv});
    if (c_.attention_value_scale != 0) v = v * c_.attention_value_scale;
    at::Tensor mask = causal;
    if (sliding) {  // key j seen from query i when i - window < j
      const at::Tensor i = at::arange(L).unsqueeze(1), j = at::arange(L).unsqueeze(0);
      mask = mask * (j > i - c_.sliding_window).to(at::kFloat);
    }
    const double theta = sliding && c_.rope_theta_sliding > 0 ? c_.rope_theta_sliding : c_.rope_theta;
    if (c_.qk_norm) {
      q = Rms(q, w_.at(p + "self_attn.q_norm.weight"));
      k = Rms(k, w_.at(p + "self_attn.k_norm.weight"));
    }
    const at::Tensor inv = 1.0 / at::pow(theta, at::arange(0, rd, 2, at::kFloat) / double(rd));
    const at::Tensor ang = (at::arange(L, at::kFloat).unsqueeze(1) * inv.unsqueeze(0)).unsqueeze(1);  // [L, 1, rd/2]
    const auto rope = [&](const at::Tensor& t) {
      const at::Tensor a = t.narrow(2, 0, rd / 2), b = t.narrow(2, rd / 2, rd / 2);
      return at::cat({a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin(), t.narrow(2, rd, hd - rd)}, 2);
    };
    q = rope(q);
    k = rope(k);
    std::vector<at::Tensor> heads;
    for (int64_t hh = 0; hh < H; ++hh) {
      const int64_t g = hh / (H / KV);
      at::Tensor s = at::matmul(q.select(1, hh), k.select(1, g).t()) / std::sqrt(double(hd));
      s = s.masked_fill(mask == 0, -1e30);
      at::Tensor probs;
      if (sliding && c_.model_type == "mimo_v2_flash") {  // one more softmax column, the head's sink, dropped after
        const at::Tensor sink = w_.at(p + "self_attn.attention_sink_bias")[hh].expand({L, 1});
        probs = at::softmax(at::cat({s, sink}, 1), -1).narrow(1, 0, L);
      } else {
        probs = at::softmax(s, -1);
      }
      heads.push_back(at::matmul(probs, v.select(1, g)));
    }
    return Lin(p + "self_attn.o_proj", at::cat(heads, 1));
  }
  // GLM's lightning indexer (HF's GlmMoeDsaIndexer): per head q = wq_b(q
  // resid), one k = LayerNorm(wk(h)), both with RoPE on their first dr dims;
  // score(s, t) = sum_h relu(q_h(s) . k(t) / sqrt(Di)) w_h(s), w = weights_proj(h)
  // / sqrt(Hi); each query keeps the index_topk best of the causal keys
  // (top-k over all keys with the future at -inf, then the causal mask).
  template <typename Rope>
  at::Tensor IndexerChoice(const std::string& p, const at::Tensor& h, const at::Tensor& q_resid, const Rope& rope,
                           const at::Tensor& causal) const {
    const int64_t L = h.size(0), Hi = c_.index_n_heads, Di = c_.index_head_dim, dr = c_.qk_rope_head_dim;
    const std::string x = p + "self_attn.indexer.";
    at::Tensor q = at::matmul(q_resid, w_.at(x + "wq_b.weight").t()).view({L, Hi, Di});
    q = at::cat({rope(q.narrow(2, 0, dr)), q.narrow(2, dr, Di - dr)}, 2);
    at::Tensor k = at::layer_norm(at::matmul(h, w_.at(x + "wk.weight").t()), {Di}, w_.at(x + "k_norm.weight"),
                                  w_.at(x + "k_norm.bias"), 1e-6);
    k = at::cat({rope(k.narrow(1, 0, dr).unsqueeze(1)).squeeze(1), k.narrow(1, dr, Di - dr)}, 1);
    const at::Tensor weights = at::matmul(h, w_.at(x + "weights_proj.weight").t()) / std::sqrt(double(Hi));
    at::Tensor scores = at::zeros({L, L});
    for (int64_t hh = 0; hh < Hi; ++hh)
      scores += at::relu(at::matmul(q.select(1, hh), k.t()) / std::sqrt(double(Di))) * weights.select(1, hh).unsqueeze(1);
    scores = scores.masked_fill(causal == 0, -std::numeric_limits<float>::infinity());
    // Ties (exact zeros, where every head's relu is 0) to the earlier key, as loom breaks them.
    const at::Tensor best =
        std::get<1>(at::sort(scores, /*stable=*/true, -1, /*descending=*/true)).narrow(1, 0, std::min<int64_t>(c_.index_topk, L));
    return at::zeros({L, L}).scatter_(1, best, 1.0) * causal;
  }
  bool Trains(const LoraTarget* t) const { return t && slot_ >= 0 && bank_.trains(slot_, t->group); }
  double Scale() const { return bank_.slot(slot_).config.alpha / bank_.slot(slot_).config.rank; }
  int Rank() const { return bank_.slot(slot_).config.rank; }
  at::Tensor Lin(const std::string& module, const at::Tensor& x) const {
    at::Tensor y = at::matmul(x, w_.at(module + ".weight").t());
    if (auto b = w_.find(module + ".bias"); b != w_.end()) y = y + b->second;
    const LoraTarget* t = bank_.find(module);
    if (!Trains(t)) return y;
    const int r = Rank();
    return y + Scale() * at::matmul(at::matmul(x, t->A[slot_].narrow(0, 0, r).t()), t->B[slot_].narrow(1, 0, r).t());
  }
  at::Tensor Mlp(const std::string& p, const at::Tensor& x) const {
    const at::Tensor g = Lin(p + "gate_proj", x), u = Lin(p + "up_proj", x);
    return Lin(p + "down_proj", g * at::sigmoid(g) * u);
  }
  // HF's routers: v2 softmax scores, groups ranked by their best; v3 sigmoid
  // scores, the choice by scores + correction bias, groups by their two best,
  // renormalised; then times routed_scaling_factor.
  at::Tensor Experts(const std::string& p, const at::Tensor& h) const {
    const int64_t E = c_.num_experts, G = c_.n_group, K = c_.num_experts_per_tok, I = c_.moe_intermediate_size;
    const bool v3 = c_.model_type != "deepseek_v2";  // deepseek_v3 and glm4_moe route alike
    const at::Tensor logits = at::matmul(h, w_.at(p + "mlp.gate.weight").t());
    const LoraTarget* gu = bank_.find(p + "mlp.experts.gate_up_proj");
    const LoraTarget* dn = bank_.find(p + "mlp.experts.down_proj");
    std::vector<at::Tensor> rows;
    for (int64_t t = 0; t < h.size(0); ++t) {
      const at::Tensor scores = v3 ? at::sigmoid(logits[t]) : at::softmax(logits[t], 0);
      at::Tensor choice = v3 ? scores + w_.at(p + "mlp.gate.e_score_correction_bias") : scores;
      const at::Tensor groups = choice.view({G, E / G});
      const at::Tensor rank = v3 ? std::get<0>(groups.topk(2, -1)).sum(-1) : std::get<0>(groups.max(-1));
      const at::Tensor keep = at::zeros({G}).index_fill(0, std::get<1>(rank.topk(c_.topk_group)), 1.0);
      choice = choice * keep.repeat_interleave(E / G);
      const at::Tensor experts = std::get<1>(choice.topk(K));
      at::Tensor weights = scores.index_select(0, experts);
      if (v3 && c_.norm_topk_prob) weights = weights / (weights.sum() + 1e-20);
      weights = weights * c_.routed_scaling_factor;
      at::Tensor out = at::zeros({c_.hidden_size});
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = experts[k].item<int64_t>();
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        at::Tensor g = at::matmul(w_.at(x + "gate_proj.weight"), h[t]);
        at::Tensor u = at::matmul(w_.at(x + "up_proj.weight"), h[t]);
        if (Trains(gu)) {
          const int r = Rank();
          const at::Tensor d = Scale() * at::matmul(gu->B[slot_][e].narrow(1, 0, r), at::matmul(gu->A[slot_].narrow(0, 0, r), h[t]));
          g = g + d.narrow(0, 0, I);
          u = u + d.narrow(0, I, I);
        }
        const at::Tensor act = g * at::sigmoid(g) * u;
        at::Tensor y = at::matmul(w_.at(x + "down_proj.weight"), act);
        if (Trains(dn)) {
          const int r = Rank();
          y = y + Scale() * at::matmul(dn->B[slot_].narrow(1, 0, r), at::matmul(dn->A[slot_][e].narrow(0, 0, r), act));
        }
        out = out + weights[k] * y;
      }
      rows.push_back(out);
    }
    return at::stack(rows);
  }

  const ModelConfig& c_;
  std::map<std::string, at::Tensor> w_;
  const SlotBank& bank_;
  mutable int slot_ = -1;
};

class DeepseekArch : public ::testing::TestWithParam<std::string> {};

// Several sequences under different slots in one packed pass: the
// reference's logprobs, and the same LoRA gradients of the summed loss.
TEST_P(DeepseekArch, PackedPassMatchesThePlainReference) {
  const ModelConfig c = TinyDeepseek(GetParam());
  const auto weights = RandomWeights(c, 5);
  auto model = Transformer::FromTensors(c, weights, at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto bank = Bank(**model, 3, 4);
  BindRandom(*bank, 0, 4, 8.0, 11);
  BindRandom(*bank, 2, 2, 4.0, 12);
  ExpectPackedPassMatches(**model, *bank, Reference(c, weights, *bank), {Seq(9, 1), Seq(6, 2), Seq(11, 3)}, {0, -1, 2},
                          1e-4, 1e-4);
}

// The sampler's cached forward: a prefill, a decode step in the latent
// space, and a prefill over a cached prefix give the trainer's hidden states.
TEST_P(DeepseekArch, CachedForwardMatchesTheTrainer) {
  const ModelConfig c = TinyDeepseek(GetParam());
  auto model = Transformer::FromTensors(c, RandomWeights(c, 6), at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok());
  const Transformer& m = **model;
  auto bank = Bank(m, 2, 4);
  BindRandom(*bank, 1, 4, 8.0, 21);
  const std::vector<int32_t> seq = Seq(12, 4);
  c10::NoGradGuard no_grad;
  const at::Tensor want = m.Hidden(PackedBatch::Make({seq}, {1}, at::kCPU), *bank);

  const KvRowShape shape = Transformer::KvShape(c, 0);
  if (c.model_type == "mimo_v2_flash") {  // a sliding layer: twice the heads; values narrower than keys
    const KvRowShape sliding = Transformer::KvShape(c, 1);
    EXPECT_EQ(sliding.k_heads, 2 * c.num_key_value_heads);
    EXPECT_EQ(sliding.v_dim, c.v_head_dim);
    EXPECT_EQ(shape.k_heads, c.num_key_value_heads);
  }
  if (c.IsMla()) {
    EXPECT_EQ(shape.k_heads, 1);
    EXPECT_EQ(shape.k_dim, c.kv_lora_rank + c.qk_rope_head_dim);
    // The latent only; a DSA layer that indexes also its indexer key, a shared one not.
    EXPECT_EQ(shape.elements(), c.kv_lora_rank + c.qk_rope_head_dim + (c.IsDsa() ? c.index_head_dim : 0));
    if (c.IsDsa()) EXPECT_EQ(Transformer::KvShape(c, 1).elements(), c.kv_lora_rank + c.qk_rope_head_dim);
  }
  ExpectCachedForwardMatches(m, *bank, seq, 1, want, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Families, DeepseekArch,
                         ::testing::Values("deepseek_v2", "deepseek_v3", "glm4_moe", "mimo_v2_flash", "glm_moe_dsa"));

// glm_moe_dsa's indexer is what the tests above check: with a key budget
// past every sequence the same weights give other logprobs wherever a query
// sees more keys than the tiny preset's 5, and the same up to there.
TEST(DsaAttention, TheIndexerChoosesTheKeysPastItsBudget) {
  ModelConfig c = TinyDeepseek("glm_moe_dsa");
  ASSERT_EQ(c.index_topk, 5);
  const auto weights = RandomWeights(c, 7);
  auto sparse = Transformer::FromTensors(c, weights, at::kCPU, at::kFloat);
  c.index_topk = 64;
  auto dense = Transformer::FromTensors(c, weights, at::kCPU, at::kFloat);
  ASSERT_TRUE(sparse.ok() && dense.ok());
  auto bank = Bank(**sparse, 1, 4);
  c10::NoGradGuard no_grad;
  const PackedBatch batch = PackedBatch::Make({Seq(12, 5)}, {-1}, at::kCPU);
  const at::Tensor a = (*sparse)->Hidden(batch, *bank), b = (*dense)->Hidden(batch, *bank);
  // Float rounding only: the two paths sum other terms (2.1e-6 with the CPU kernels of the GPU
  // machine's libtorch 2.11, session 35), against at least 1e-4 past the budget.
  EXPECT_LT(MaxDiff(a.narrow(0, 0, 5), b.narrow(0, 0, 5)), 1e-5);
  for (int64_t t = 5; t < 12; ++t) EXPECT_GT(MaxDiff(a.narrow(0, t, 1), b.narrow(0, t, 1)), 1e-4) << "position " << t;
}

// A "shared" layer has no indexer of its own (transformers 5.17 builds none
// there, and its loader calls one there unexpected): make-model writes none,
// and a checkpoint of an earlier port that carries one there still loads,
// those tensors ignored, to the same model.
TEST(DsaAttention, ASharedLayerHasNoIndexerAndACheckpointsOneThereIsIgnored) {
  const ModelConfig c = TinyDeepseek("glm_moe_dsa");
  ASSERT_EQ(c.indexer_types, (std::vector<std::string>{"full", "shared", "full"}));
  std::set<std::string> indexers;
  for (const auto& [name, shape] : Transformer::ExpectedWeights(c))
    if (name.find(".self_attn.indexer.") != std::string::npos) indexers.insert(name.substr(0, name.find(".self_attn")));
  EXPECT_EQ(indexers, (std::set<std::string>{"model.layers.0", "model.layers.2"}));
  auto weights = RandomWeights(c, 9);
  auto plain = Transformer::FromTensors(c, weights, at::kCPU, at::kFloat);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  for (const char* part : {"wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"}) {
    const std::string from = std::string("model.layers.0.self_attn.indexer.") + part;
    weights["model.layers.1.self_attn.indexer." + std::string(part)] = weights.at(from) * 3 + 1;
  }
  auto carried = Transformer::FromTensors(c, weights, at::kCPU, at::kFloat);
  ASSERT_TRUE(carried.ok()) << carried.status().message();
  auto bank = Bank(**plain, 1, 4);
  c10::NoGradGuard no_grad;
  const PackedBatch batch = PackedBatch::Make({Seq(12, 5)}, {-1}, at::kCPU);
  EXPECT_EQ(MaxDiff((*plain)->Hidden(batch, *bank), (*carried)->Hidden(batch, *bank)), 0.0);
  // Elsewhere an indexer tensor is still unexpected.
  weights["model.layers.2.self_attn.indexer.extra.weight"] = at::zeros({2});
  EXPECT_FALSE(Transformer::FromTensors(c, weights, at::kCPU, at::kFloat).ok());
}

// A long sequence's choice and attention in blocks of query rows (as
// without gradients past 256 MiB of scores) equal the whole at once.
TEST(DsaAttention, BlocksOfQueriesGiveTheWholeChoiceAndAttention) {
  at::manual_seed(3);
  const int64_t n = 7, L = 11, Hi = 3, Di = 8, H = 2, hd = 6, dv = 4;
  const DsaIndex queries{at::randn({n, Hi, Di}), at::randn({n, Hi}), at::Tensor()};
  const at::Tensor ik = at::randn({L, Di});
  const at::Tensor whole = DsaCausalChoice(queries, ik, 4);
  ASSERT_TRUE(whole.defined());
  EXPECT_TRUE(at::equal(DsaCausalChoice(queries, ik, 4, 2), whole));
  EXPECT_TRUE(at::equal(DsaCausalChoice(queries, ik, 4, 3), whole));
  c10::NoGradGuard no_grad;
  const at::Tensor q = at::randn({n, H, hd}), k = at::randn({L, H, hd}), v = at::randn({L, H, dv});
  const at::Tensor all = DsaAttention(q, k, v, whole, AttentionKernel::kMath, n);
  for (int64_t rows : {1, 2, 3})
    EXPECT_LT(MaxDiff(DsaAttention(q, k, v, whole, AttentionKernel::kMath, rows), all), 1e-6) << rows << " rows a block";
  // And it is the sparse attention: another choice gives other values.
  EXPECT_GT(MaxDiff(DsaAttention(q, k, v, DsaCausalChoice(queries, ik, 2), AttentionKernel::kMath, 2), all), 1e-3);
}

// The choice: the best-scoring visible keys, all of them within the budget.
TEST(DsaAttention, ChooseKeepsTheBestVisibleKeys) {
  const at::Tensor scores = at::tensor({0.5f, 3.0f, -1.0f, 2.0f, 9.0f}).view({1, 5});
  const at::Tensor visible = at::tensor({1, 1, 1, 1, 0}).to(at::kBool).view({1, 5});
  EXPECT_TRUE(at::equal(DsaChoose(scores, visible, 2), at::tensor({0, 1, 0, 1, 0}).to(at::kBool).view({1, 5})));
  // Equal scores: the earlier keys, whatever the row's padding.
  const at::Tensor ties = at::tensor({0.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f}).view({1, 7});
  const at::Tensor first5 = at::tensor({1, 1, 1, 1, 1, 0, 0}).to(at::kBool).view({1, 7});
  EXPECT_TRUE(at::equal(DsaChoose(ties, first5, 3), at::tensor({1, 1, 1, 0, 0, 0, 0}).to(at::kBool).view({1, 7})));
  EXPECT_TRUE(at::equal(DsaChoose(ties.narrow(1, 0, 5), first5.narrow(1, 0, 5), 3),
                        at::tensor({1, 1, 1, 0, 0}).to(at::kBool).view({1, 5})));
  EXPECT_TRUE(at::equal(DsaChoose(scores, visible, 4), visible));
  EXPECT_TRUE(at::equal(DsaChoose(scores, visible, 9), visible));
}

// Every preset's config.json parses back to the same fields.
TEST(DeepseekConfig, PresetsRoundTripThroughConfigJson) {
  for (const auto& [arch, presets] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"deepseek_v2", {"tiny", "deepseek-v2-lite", "deepseek-v2"}},
           {"deepseek_v3", {"tiny", "kimi-k2.5", "deepseek-v3"}},
           {"glm4_moe", {"tiny", "glm-4.5-air"}},
           {"mimo_v2_flash", {"tiny", "mimo-v2-flash"}},
           {"glm_moe_dsa", {"tiny", "glm-5.2"}}}) {
    for (const std::string& preset : presets) {
      auto c = testmodel::PresetConfig(arch, preset);
      ASSERT_TRUE(c.ok()) << arch << " " << preset << ": " << c.status().message();
      auto back = ModelConfig::Parse(c->ToJson());
      ASSERT_TRUE(back.ok()) << arch << " " << preset << ": " << back.status().message();
      EXPECT_EQ(back->q_lora_rank, c->q_lora_rank) << preset;
      EXPECT_EQ(back->kv_lora_rank, c->kv_lora_rank) << preset;
      EXPECT_EQ(back->head_dim, c->IsMla() ? c->qk_rope_head_dim : c->head_dim) << preset;
      EXPECT_EQ(back->v_head_dim, c->v_head_dim) << preset;
      EXPECT_EQ(back->num_experts, c->num_experts) << preset;
      EXPECT_EQ(back->n_shared_experts, c->n_shared_experts) << preset;
      EXPECT_EQ(back->first_k_dense_replace, c->first_k_dense_replace) << preset;
      EXPECT_EQ(back->n_group, c->n_group) << preset;
      EXPECT_EQ(back->topk_group, c->topk_group) << preset;
      EXPECT_EQ(back->routed_scaling_factor, c->routed_scaling_factor) << preset;
      EXPECT_EQ(back->norm_topk_prob, c->norm_topk_prob) << preset;
      EXPECT_EQ(back->rope_type, c->rope_type) << preset;
      EXPECT_EQ(back->yarn_mscale_all_dim, c->yarn_mscale_all_dim) << preset;
      EXPECT_EQ(back->partial_rotary_factor, c->partial_rotary_factor) << preset;
      EXPECT_EQ(back->qk_norm, c->qk_norm) << preset;
      EXPECT_EQ(back->num_nextn_predict_layers, c->num_nextn_predict_layers) << preset;
      EXPECT_EQ(back->layer_types, c->layer_types) << preset;
      EXPECT_EQ(back->sliding_window, c->sliding_window) << preset;
      EXPECT_EQ(back->rope_theta, c->rope_theta) << preset;
      EXPECT_EQ(back->rope_theta_sliding, c->rope_theta_sliding) << preset;
      if (arch == "mimo_v2_flash")  // its thetas only in the per-type rope_parameters, as HF's class reads them
        EXPECT_EQ(nlohmann::json::parse(c->ToJson()).count("rope_scaling"), 0u) << preset;
      EXPECT_EQ(back->attention_value_scale, c->attention_value_scale) << preset;
      EXPECT_EQ(back->KvHeads(1), c->KvHeads(1)) << preset;
      EXPECT_EQ(back->ValueDim(), c->ValueDim()) << preset;
      EXPECT_EQ(back->index_topk, c->index_topk) << preset;
      EXPECT_EQ(back->index_head_dim, c->index_head_dim) << preset;
      EXPECT_EQ(back->index_n_heads, c->index_n_heads) << preset;
      EXPECT_EQ(back->indexer_types, c->indexer_types) << preset;
      EXPECT_EQ(back->rope_interleave, c->rope_interleave) << preset;
      EXPECT_FALSE(back->IsMoeLayer(0)) << preset;  // every preset's first layer is dense
      EXPECT_TRUE(back->IsMoeLayer(back->num_hidden_layers - 1)) << preset;
    }
  }
}

// Fields loom cannot honour are refused by name.
TEST(DeepseekConfig, RefusalsNameTheField) {
  const auto with = [](const std::string& arch, const char* field, const nlohmann::json& v) {
    nlohmann::json j = nlohmann::json::parse(TinyDeepseek(arch).ToJson());
    j[field] = v;
    return ModelConfig::Parse(j.dump());
  };
  for (const auto& [arch, field, value] : std::vector<std::tuple<std::string, const char*, nlohmann::json>>{
           {"deepseek_v2", "topk_method", "noaux_tc"},
           {"deepseek_v2", "scoring_func", "sigmoid"},
           {"deepseek_v3", "scoring_func", "softmax"},
           {"deepseek_v2", "n_group", 3},
           {"deepseek_v2", "topk_group", 5},
           {"deepseek_v2", "moe_layer_freq", 2},
           {"deepseek_v3", "kv_lora_rank", 0},
           {"deepseek_v3", "qk_rope_head_dim", 7},
           {"glm4_moe", "partial_rotary_factor", 1.5},
           {"glm4_moe", "n_group", 3},
           {"mimo_v2_flash", "mlp_layer_types", nlohmann::json::array({"dense"})},
           {"mimo_v2_flash", "layer_types", nlohmann::json::array({"full_attention"})},
           {"glm_moe_dsa", "index_topk", 0},
           {"glm_moe_dsa", "index_head_dim", 4},
           {"glm_moe_dsa", "q_lora_rank", nlohmann::json()},
           {"glm_moe_dsa", "indexer_types", nlohmann::json::array({"full", "sparse", "full"})},
           {"glm_moe_dsa", "indexer_types", nlohmann::json::array({"full"})},
           {"glm_moe_dsa", "mlp_layer_types", nlohmann::json::array({"dense", "sparse"})}}) {
    auto r = with(arch, field, value);
    ASSERT_FALSE(r.ok()) << arch << " " << field;
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
  }
  // GLM-5.2's pattern as HF derives it when indexer_types is absent.
  nlohmann::json glm = nlohmann::json::parse(TinyDeepseek("glm_moe_dsa").ToJson());
  glm.erase("indexer_types");
  glm["index_topk_pattern"] = "FSS";
  auto pattern = ModelConfig::Parse(glm.dump());
  ASSERT_TRUE(pattern.ok()) << pattern.status().message();
  EXPECT_EQ(pattern->indexer_types, (std::vector<std::string>{"full", "shared", "shared"}));
  EXPECT_EQ(pattern->DsaSource(2), 0);
  glm.erase("index_topk_pattern");
  auto all = ModelConfig::Parse(glm.dump());
  ASSERT_TRUE(all.ok()) << all.status().message();
  EXPECT_EQ(all->indexer_types, (std::vector<std::string>{"full", "full", "full"}));
  auto real = testmodel::PresetConfig("glm_moe_dsa", "glm-5.2");
  ASSERT_TRUE(real.ok());
  EXPECT_EQ(std::count(real->indexer_types.begin(), real->indexer_types.end(), "full"), 21);
  // greedy ignores the groups, as HF's does.
  auto greedy = with("deepseek_v2", "topk_method", "greedy");
  ASSERT_TRUE(greedy.ok()) << greedy.status().message();
  EXPECT_EQ(greedy->n_group, 1);
}

}  // namespace
}  // namespace loom::engine
