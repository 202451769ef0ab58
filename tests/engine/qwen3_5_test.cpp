// qwen3_5_moe_text (Qwen3.5/3.6-35B-A3B's text model): Gated DeltaNet
// (linear attention) layers three in four, gated full attention with
// partial RoPE in the fourth, every layer MoE with a sigmoid-gated shared
// expert. The packed forward with several slots' LoRA against a plain
// reference written here from the model's math (values and LoRA gradients),
// the sampler's cached forward (prefill, decode, prefix reuse) and its KV
// rows, the LoRA targets, the config.json fields and the real preset's
// checkpoint shapes.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "../common/temp_dir.h"
#include "cached_check.h"
#include "engine/io/safetensors.h"
#include "engine/model/cached_batch.h"
#include "engine/sample_api.h"
#include "testmodel/make_model.h"
#include "tiny_model.h"

namespace loom::engine {
namespace {

constexpr const char* kArch = "qwen3_5_moe_text";
const std::string kLinear = "linear_attention", kFull = "full_attention";

// Tolerances. This random tiny model is ill-conditioned in fp32: noise of
// 1e-7 (relative) on its embeddings moves its final hidden states by about
// 4e-4 (deepseek_v3's and qwen3_moe's tiny models: 3e-6 to 4e-6; measured
// 2026-12-04), through the DeltaNet's normalisations (l2 of q and k, the
// gated RMSNorm of outputs that are sums of cancelling q.k terms). So two
// correct fp32 computations of it in different op orders (the chunked rule
// against the recurrence, a batch of 12 rows against one of 8 in the MoE's
// GEMMs) differ by up to about 3e-4, and the checks allow a few times that;
// a wrong block (a norm's flavour, the gate, a head's grouping) moves them
// by 1e-1 and more.
constexpr double kLogprobTol = 2e-3, kGradRelTol = 2e-3, kHiddenTol = 3e-4;

ModelConfig TinyQwen35() {
  auto c = testmodel::PresetConfig(kArch, "tiny");
  EXPECT_TRUE(c.ok()) << c.status().message();
  return c.ok() ? *c : ModelConfig{};
}

// RandomWeights, with in_proj_a and in_proj_b scaled down so that the
// DeltaNet's decay exp(g) is mostly around 0.3..0.7 and beta away from 0
// and 1: the recurrent state then carries well across tokens (and across a
// cached prefix) instead of being forgotten at every step.
std::map<std::string, at::Tensor> Qwen35Weights(const ModelConfig& c, uint64_t seed) {
  auto w = RandomWeights(c, seed);
  const auto ends = [](const std::string& name, const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  for (auto& entry : w) {
    if (ends(entry.first, "linear_attn.in_proj_a.weight")) entry.second = entry.second * 0.1;
    if (ends(entry.first, "linear_attn.in_proj_b.weight")) entry.second = entry.second * 0.3;
  }
  return w;
}

// The text model written out from its math, token by token where HF loops
// (the conv, the delta rule, the routing), with each sequence's slot's LoRA
// (scale * (x A^T) B^T per target; the experts' gate_up with one A and a B
// per expert, down with an A per expert and one B). No engine code: only
// the config's fields, the weights by HF name and the bank's factors.
class Reference {
 public:
  Reference(const ModelConfig& c, std::map<std::string, at::Tensor> w, const SlotBank& bank)
      : c_(c), w_(std::move(w)), bank_(bank) {}

  // Log-probabilities [L, vocab] of one sequence under slot (-1: base).
  at::Tensor Logprobs(const std::vector<int32_t>& seq, int slot) const {
    slot_ = slot;
    at::Tensor x = w_.at("model.embed_tokens.weight")
                       .index_select(0, at::tensor(std::vector<int64_t>(seq.begin(), seq.end()), at::kLong));
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      const at::Tensor h = Rms1p(x, w_.at(p + "input_layernorm.weight"));
      x = x + (c_.layer_types.at(i) == kLinear ? DeltaNet(i, h) : GatedAttention(i, h));
      x = x + Moe(p + "mlp.", Rms1p(x, w_.at(p + "post_attention_layernorm.weight")));
    }
    x = Rms1p(x, w_.at("model.norm.weight"));
    return at::log_softmax(Lin("lm_head", x), -1);
  }

 private:
  // The layers' RMSNorm: the stored w is the scale less one.
  at::Tensor Rms1p(const at::Tensor& x, const at::Tensor& w) const {
    return x * at::rsqrt(x.pow(2).mean(-1, true) + c_.rms_norm_eps) * (1.0 + w);
  }

  // Gated attention: q_proj gives per head hd query rows then hd gate rows;
  // q and k normed per head; RoPE (rotate_half over the first rd dims, the
  // rest passed through); grouped-query softmax attention; each head's
  // output times sigmoid(its gate); o_proj.
  at::Tensor GatedAttention(int64_t layer, const at::Tensor& h) const {
    const std::string p = "model.layers." + std::to_string(layer) + ".self_attn.";
    const int64_t L = h.size(0), nh = c_.num_attention_heads, nkv = c_.num_key_value_heads, hd = c_.head_dim;
    const int64_t rd = static_cast<int64_t>(static_cast<double>(hd) * c_.partial_rotary_factor);
    const at::Tensor qg = Lin(p + "q_proj", h).view({L, nh, 2 * hd});
    const at::Tensor gate = qg.narrow(2, hd, hd);
    at::Tensor q = Rms1p(qg.narrow(2, 0, hd), w_.at(p + "q_norm.weight"));
    at::Tensor k = Rms1p(Lin(p + "k_proj", h).view({L, nkv, hd}), w_.at(p + "k_norm.weight"));
    const at::Tensor v = Lin(p + "v_proj", h).view({L, nkv, hd});
    // cos/sin [L, 1, rd]: frequency j < rd/2 at dims j and j + rd/2.
    const at::Tensor inv = 1.0 / at::pow(c_.rope_theta, at::arange(0, rd, 2, at::kFloat) / double(rd));
    const at::Tensor freqs = at::arange(L, at::kFloat).unsqueeze(1) * inv.unsqueeze(0);
    const at::Tensor emb = at::cat({freqs, freqs}, 1).unsqueeze(1);
    const at::Tensor cos = emb.cos(), sin = emb.sin();
    const auto rope = [&](const at::Tensor& t) {
      const at::Tensor r = t.narrow(2, 0, rd);
      const at::Tensor rotated = at::cat({-r.narrow(2, rd / 2, rd / 2), r.narrow(2, 0, rd / 2)}, 2);
      return at::cat({r * cos + rotated * sin, t.narrow(2, rd, hd - rd)}, 2);
    };
    q = rope(q);
    k = rope(k);
    const at::Tensor causal = at::ones({L, L}).tril();
    std::vector<at::Tensor> heads;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t g = hh / (nh / nkv);
      at::Tensor s = at::matmul(q.select(1, hh), k.select(1, g).t()) / std::sqrt(double(hd));
      s = s.masked_fill(causal == 0, -1e30);
      heads.push_back(at::matmul(at::softmax(s, -1), v.select(1, g)) * at::sigmoid(gate.select(1, hh)));
    }
    return Lin(p + "o_proj", at::cat(heads, 1));
  }

  // Gated DeltaNet: in_proj_qkv, the causal depthwise conv (K taps, zeros
  // before the sequence) with SiLU, split into q | k | v (head-major
  // blocks); beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); q and
  // k L2-normalised (x rsqrt(sum x^2 + 1e-6)), q times dk^-0.5; per value
  // head h (reading key head h / (Hv / Hk)) the recurrence over S [dk, dv]:
  // S <- exp(g) S, S <- S + k (beta (v - S^T k))^T, o = S^T q; then per value
  // head x rsqrt(mean x^2 + eps) w silu(z) and out_proj.
  at::Tensor DeltaNet(int64_t layer, const at::Tensor& h) const {
    const std::string p = "model.layers." + std::to_string(layer) + ".linear_attn.";
    const int64_t L = h.size(0), Hk = c_.linear_num_key_heads, Hv = c_.linear_num_value_heads;
    const int64_t dk = c_.linear_key_head_dim, dv = c_.linear_value_head_dim, K = c_.linear_conv_kernel_dim;
    const int64_t kd = Hk * dk, vd = Hv * dv, C = 2 * kd + vd;
    const at::Tensor mixed = Lin(p + "in_proj_qkv", h);  // [L, C]
    const at::Tensor z = Lin(p + "in_proj_z", h).view({L, Hv, dv});
    const at::Tensor b = Lin(p + "in_proj_b", h), a = Lin(p + "in_proj_a", h);  // [L, Hv]
    const at::Tensor taps = w_.at(p + "conv1d.weight").view({C, K});  // tap K-1 on the current token
    std::vector<at::Tensor> conv;
    for (int64_t t = 0; t < L; ++t) {
      at::Tensor acc = at::zeros({C});
      for (int64_t j = 0; j < K; ++j)
        if (const int64_t s = t - (K - 1) + j; s >= 0) acc = acc + taps.select(1, j) * mixed[s];
      conv.push_back(acc * at::sigmoid(acc));
    }
    const at::Tensor y = at::stack(conv);  // [L, C]
    const auto l2 = [](const at::Tensor& t) { return t * at::rsqrt((t * t).sum(-1, true) + 1e-6); };
    const at::Tensor q = l2(y.narrow(1, 0, kd).reshape({L, Hk, dk})) / std::sqrt(double(dk));
    const at::Tensor k = l2(y.narrow(1, kd, kd).reshape({L, Hk, dk}));
    const at::Tensor v = y.narrow(1, 2 * kd, vd).reshape({L, Hv, dv});
    const at::Tensor beta = at::sigmoid(b);
    const at::Tensor g = -at::exp(w_.at(p + "A_log")) * at::softplus(a + w_.at(p + "dt_bias"));  // [L, Hv]
    std::vector<at::Tensor> heads;
    for (int64_t hv = 0; hv < Hv; ++hv) {
      const int64_t hk = hv / (Hv / Hk);
      at::Tensor S = at::zeros({dk, dv});
      std::vector<at::Tensor> out;
      for (int64_t t = 0; t < L; ++t) {
        const at::Tensor kt = k[t][hk];
        S = S * at::exp(g[t][hv]);
        const at::Tensor delta = beta[t][hv] * (v[t][hv] - at::matmul(S.t(), kt));
        S = S + kt.unsqueeze(1) * delta.unsqueeze(0);
        out.push_back(at::matmul(S.t(), q[t][hk]));
      }
      heads.push_back(at::stack(out));  // [L, dv]
    }
    const at::Tensor o = at::stack(heads, 1);  // [L, Hv, dv]
    const at::Tensor n = o * at::rsqrt(o.pow(2).mean(-1, true) + c_.rms_norm_eps) * w_.at(p + "norm.weight") *
                         (z * at::sigmoid(z));
    return Lin(p + "out_proj", n.reshape({L, vd}));
  }

  bool Trains(const LoraTarget* t) const { return t && slot_ >= 0 && bank_.trains(slot_, t->group); }
  double Scale() const { return bank_.slot(slot_).config.alpha / bank_.slot(slot_).config.rank; }
  int Rank() const { return bank_.slot(slot_).config.rank; }
  at::Tensor Lin(const std::string& module, const at::Tensor& x) const {
    const at::Tensor y = at::matmul(x, w_.at(module + ".weight").t());
    const LoraTarget* t = bank_.find(module);
    if (!Trains(t)) return y;
    const int r = Rank();
    return y + Scale() * at::matmul(at::matmul(x, t->A[slot_].narrow(0, 0, r).t()), t->B[slot_].narrow(1, 0, r).t());
  }

  // Router: softmax over every expert, the top k, renormalised to sum 1;
  // experts from the fused [E, 2I, H] (gate rows, then up rows) and
  // [E, H, I]; plus sigmoid(shared_expert_gate(h)) times the shared expert.
  at::Tensor Moe(const std::string& p, const at::Tensor& h) const {
    const int64_t K = c_.num_experts_per_tok, I = c_.moe_intermediate_size;
    const at::Tensor logits = at::matmul(h, w_.at(p + "gate.weight").t());
    const at::Tensor& gate_up = w_.at(p + "experts.gate_up_proj");
    const at::Tensor& down = w_.at(p + "experts.down_proj");
    const LoraTarget* gu = bank_.find(p + "experts.gate_up_proj");
    const LoraTarget* dn = bank_.find(p + "experts.down_proj");
    std::vector<at::Tensor> rows;
    for (int64_t t = 0; t < h.size(0); ++t) {
      const auto [top, experts] = at::softmax(logits[t], 0).topk(K);
      const at::Tensor weights = top / top.sum();
      at::Tensor out = at::zeros({c_.hidden_size});
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = experts[k].item<int64_t>();
        at::Tensor gux = at::matmul(gate_up[e], h[t]);  // [2I]
        if (Trains(gu)) {
          const int r = Rank();
          gux = gux + Scale() * at::matmul(gu->B[slot_][e].narrow(1, 0, r), at::matmul(gu->A[slot_].narrow(0, 0, r), h[t]));
        }
        const at::Tensor g = gux.narrow(0, 0, I), u = gux.narrow(0, I, I);
        const at::Tensor act = g * at::sigmoid(g) * u;
        at::Tensor y = at::matmul(down[e], act);
        if (Trains(dn)) {
          const int r = Rank();
          y = y + Scale() * at::matmul(dn->B[slot_].narrow(1, 0, r), at::matmul(dn->A[slot_][e].narrow(0, 0, r), act));
        }
        out = out + weights[k] * y;
      }
      rows.push_back(out);
    }
    const std::string s = p + "shared_expert.";
    const at::Tensor sg = Lin(s + "gate_proj", h), su = Lin(s + "up_proj", h);
    const at::Tensor shared = Lin(s + "down_proj", sg * at::sigmoid(sg) * su);
    const at::Tensor share = at::sigmoid(at::matmul(h, w_.at(p + "shared_expert_gate.weight").t()));  // [L, 1]
    return at::stack(rows) + share * shared;
  }

  const ModelConfig& c_;
  std::map<std::string, at::Tensor> w_;
  const SlotBank& bank_;
  mutable int slot_ = -1;
};

// The tiny preset is what the reference and the tests below assume.
TEST(Qwen35, TinyPresetIsTheOneTheTestsAssume) {
  const ModelConfig c = TinyQwen35();
  EXPECT_EQ(c.model_type, kArch);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{kLinear, kLinear, kLinear, kFull}));
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.RotaryDim(), 4);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_EQ(c.linear_num_key_heads, 2);
  EXPECT_EQ(c.linear_key_head_dim, 8);
  EXPECT_EQ(c.linear_num_value_heads, 4);
  EXPECT_EQ(c.linear_value_head_dim, 8);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 32);
  EXPECT_EQ(c.shared_expert_intermediate_size, 32);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) EXPECT_TRUE(c.IsMoeLayer(i)) << i;
}

// The adaptable linears are HF's module names, in their groups, with the
// expert layout of the shared outer factors; the router, the shared
// expert's gate, the conv, A_log, dt_bias and the norms are not among them.
TEST(Qwen35, LoraTargetsAreTheHfModules) {
  const ModelConfig c = TinyQwen35();
  auto model = Transformer::FromTensors(c, Qwen35Weights(c, 4), at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  const int64_t H = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const int64_t C = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim;
  const int64_t vd = c.linear_num_value_heads * c.linear_value_head_dim, Hv = c.linear_num_value_heads;
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  // module -> {group, d_in, d_out, experts, per_expert}
  std::map<std::string, std::tuple<TargetGroup, int64_t, int64_t, int64_t, ExpertFactor>> want;
  const auto attn = TargetGroup::kAttn, mlp = TargetGroup::kMlp;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    if (c.layer_types[i] == kLinear) {
      want[p + "linear_attn.in_proj_qkv"] = {attn, H, C, 0, ExpertFactor::kNone};
      want[p + "linear_attn.in_proj_z"] = {attn, H, vd, 0, ExpertFactor::kNone};
      want[p + "linear_attn.in_proj_b"] = {attn, H, Hv, 0, ExpertFactor::kNone};
      want[p + "linear_attn.in_proj_a"] = {attn, H, Hv, 0, ExpertFactor::kNone};
      want[p + "linear_attn.out_proj"] = {attn, vd, H, 0, ExpertFactor::kNone};
    } else {
      want[p + "self_attn.q_proj"] = {attn, H, 2 * nh * hd, 0, ExpertFactor::kNone};
      want[p + "self_attn.k_proj"] = {attn, H, nkv * hd, 0, ExpertFactor::kNone};
      want[p + "self_attn.v_proj"] = {attn, H, nkv * hd, 0, ExpertFactor::kNone};
      want[p + "self_attn.o_proj"] = {attn, nh * hd, H, 0, ExpertFactor::kNone};
    }
    want[p + "mlp.experts.gate_up_proj"] = {mlp, H, 2 * I, E, ExpertFactor::kB};
    want[p + "mlp.experts.down_proj"] = {mlp, I, H, E, ExpertFactor::kA};
    want[p + "mlp.shared_expert.gate_proj"] = {mlp, H, Is, 0, ExpertFactor::kNone};
    want[p + "mlp.shared_expert.up_proj"] = {mlp, H, Is, 0, ExpertFactor::kNone};
    want[p + "mlp.shared_expert.down_proj"] = {mlp, Is, H, 0, ExpertFactor::kNone};
  }
  want["lm_head"] = {TargetGroup::kUnembed, H, c.vocab_size, 0, ExpertFactor::kNone};
  const std::vector<LoraTargetSpec> got = (*model)->LoraTargets();
  std::set<std::string> names;
  for (const LoraTargetSpec& t : got) {
    names.insert(t.module);
    auto it = want.find(t.module);
    if (it == want.end()) {
      ADD_FAILURE() << "unexpected LoRA target " << t.module;
      continue;
    }
    const auto& [group, d_in, d_out, experts, per_expert] = it->second;
    EXPECT_EQ(t.group, group) << t.module;
    EXPECT_EQ(t.d_in, d_in) << t.module;
    EXPECT_EQ(t.d_out, d_out) << t.module;
    EXPECT_EQ(t.experts, experts) << t.module;
    EXPECT_EQ(t.per_expert, per_expert) << t.module;
    EXPECT_FALSE(t.hf_interleaved) << t.module;  // gate rows then up rows, as the checkpoint
  }
  for (const auto& [module, spec] : want) EXPECT_EQ(names.count(module), 1u) << "missing LoRA target " << module;
  EXPECT_EQ(got.size(), want.size());
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.back().module, "lm_head");
}

// Several sequences under different slots in one packed pass: the
// reference's logprobs, and the same LoRA gradients of the summed loss.
TEST(Qwen35, PackedPassMatchesThePlainReference) {
  const ModelConfig c = TinyQwen35();
  ASSERT_EQ(std::count(c.layer_types.begin(), c.layer_types.end(), kLinear), 3);  // both kinds of layer are covered
  ASSERT_EQ(std::count(c.layer_types.begin(), c.layer_types.end(), kFull), 1);
  const auto weights = Qwen35Weights(c, 5);
  auto model = Transformer::FromTensors(c, weights, at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto bank = Bank(**model, 3, 4);
  BindRandom(*bank, 0, 4, 8.0, 11);
  BindRandom(*bank, 2, 2, 4.0, 12);
  ExpectPackedPassMatches(**model, *bank, Reference(c, weights, *bank), {Seq(9, 1), Seq(6, 2), Seq(11, 3)}, {0, -1, 2},
                          kLogprobTol, kGradRelTol);
}

// The sampler's cached forward: a prefill, a decode step (two pad columns
// in its context) and a prefill over a cached prefix give the trainer's
// hidden states; the KV rows: a linear layer's holds the token's pre-conv
// in_proj_qkv output and its a and b, a full layer's its keys and values.
TEST(Qwen35, CachedForwardMatchesTheTrainer) {
  const ModelConfig c = TinyQwen35();
  auto model = Transformer::FromTensors(c, Qwen35Weights(c, 6), at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  const Transformer& m = **model;
  auto bank = Bank(m, 2, 4);
  BindRandom(*bank, 1, 4, 8.0, 21);
  const std::vector<int32_t> seq = Seq(12, 4);
  c10::NoGradGuard no_grad;
  const at::Tensor want = m.Hidden(PackedBatch::Make({seq}, {1}, at::kCPU), *bank);

  const int64_t conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim;
  EXPECT_EQ(c.LinearConvDim(), conv);
  const std::vector<KvRowShape> shapes = Transformer::KvShapes(c);
  ASSERT_EQ(static_cast<int64_t>(shapes.size()), c.num_hidden_layers);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const KvRowShape s = Transformer::KvShape(c, i);
    const int64_t kh = c.num_key_value_heads, hd = c.head_dim;
    const std::vector<int64_t> want_shape = c.layer_types[i] == kLinear
                                                ? std::vector<int64_t>{1, conv + 2 * c.linear_num_value_heads, 0, 0}
                                                : std::vector<int64_t>{kh, hd, kh, hd};
    EXPECT_EQ((std::vector<int64_t>{s.k_heads, s.k_dim, s.v_heads, s.v_dim}), want_shape) << "layer " << i;
    EXPECT_EQ((std::vector<int64_t>{shapes[i].k_heads, shapes[i].k_dim, shapes[i].v_heads, shapes[i].v_dim}), want_shape)
        << "layer " << i;
  }
  EXPECT_EQ(Transformer::KvShape(c, 0).elements(), 64 + 2 * 4);  // tiny: q, k 2 x 8 each, v 4 x 8; a and b 4 each
  EXPECT_EQ(Transformer::KvShape(c, 3).elements(), 2 * 2 * 16);

  ExpectCachedForwardMatches(m, *bank, seq, 1, want, kHiddenTol);
}

// Two sequences prefilled together and then decoded together (one a slot,
// one the base), the shorter one's context padded with the other's rows:
// neither's recurrent layers read the other's tokens, whether the decode
// mixes the whole context again or steps the states the prefill left.
TEST(Qwen35, CachedDecodeKeepsTheSequencesApart) {
  const ModelConfig c = TinyQwen35();
  auto model = Transformer::FromTensors(c, Qwen35Weights(c, 7), at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  const Transformer& m = **model;
  auto bank = Bank(m, 2, 4);
  BindRandom(*bank, 1, 4, 8.0, 22);
  const std::vector<int32_t> s0 = Seq(6, 5), s1 = Seq(8, 6);
  c10::NoGradGuard no_grad;
  const at::Tensor want0 = m.Hidden(PackedBatch::Make({s0}, {1}, at::kCPU), *bank);
  const at::Tensor want1 = m.Hidden(PackedBatch::Make({s1}, {-1}, at::kCPU), *bank);
  // Without state slots (each step mixes the whole context) and with them
  // (the prefill leaves each row's state in its slot, the decode steps it).
  for (const bool states : {false, true}) {
  SCOPED_TRACE(states ? "state slots" : "no state slots");
  KvCache cache = KvCache::Allocate(Transformer::KvShapes(c), 32, at::kCPU, at::kFloat);
  if (states) {
    cache.state.assign(cache.k.size(), at::Tensor());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      if (c.IsLinearLayer(i))
        cache.state[i] = at::full({3, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim}, 7.0);
  }
  const auto longs = [](std::vector<int64_t> v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)); };
  const auto range = [](int64_t a, int64_t b) { return at::arange(a, b, at::TensorOptions().dtype(at::kLong)); };
  CachedBatch prefill;  // s0[0..5) to rows 0..4, s1[0..7) to rows 10..16
  std::vector<int64_t> toks(s0.begin(), s0.begin() + 5);
  toks.insert(toks.end(), s1.begin(), s1.begin() + 7);
  prefill.tokens = longs(toks);
  prefill.positions = at::cat({range(0, 5), range(0, 7)});
  prefill.seq_begin = {0, 5, 12};
  prefill.seq_slot = {1, -1};
  prefill.write_rows = at::cat({range(0, 5), range(10, 17)});
  prefill.prefill = true;
  if (states) prefill.seq_state = {2, 0};  // slots full of garbage: the prefill overwrites them
  const at::Tensor pre = m.ForwardCached(prefill, cache, *bank);
  EXPECT_LT(MaxDiff(pre.narrow(0, 0, 5), want0.narrow(0, 0, 5)), kHiddenTol);
  EXPECT_LT(MaxDiff(pre.narrow(0, 5, 7), want1.narrow(0, 0, 7)), kHiddenTol);
  CachedBatch decode;
  decode.tokens = longs({s0[5], s1[7]});
  decode.positions = longs({5, 7});
  decode.seq_begin = {0, 1, 2};
  decode.seq_slot = {1, -1};
  decode.write_rows = longs({5, 17});
  decode.context_rows = at::stack({at::cat({range(0, 6), longs({12, 13})}), range(10, 18)});  // row 0 padded with s1's rows
  decode.context_mask = at::stack({at::cat({at::ones({6}), at::zeros({2})}), at::ones({8})}).to(at::kBool);
  if (states) decode.seq_state = {2, 0};
  const at::Tensor dec = m.ForwardCached(decode, cache, *bank);
  EXPECT_LT(MaxDiff(dec.narrow(0, 0, 1), want0.narrow(0, 5, 1)), kHiddenTol);
  EXPECT_LT(MaxDiff(dec.narrow(0, 1, 1), want1.narrow(0, 7, 1)), kHiddenTol);
  }
}

// Every preset's config.json parses back to the same fields.
TEST(Qwen35, PresetsRoundTripThroughConfigJson) {
  for (const std::string preset : {"tiny", "qwen3.5-35b-a3b"}) {
    auto c = testmodel::PresetConfig(kArch, preset);
    ASSERT_TRUE(c.ok()) << preset << ": " << c.status().message();
    const std::string text = c->ToJson();
    const nlohmann::json j = nlohmann::json::parse(text);
    EXPECT_EQ(j.value("model_type", ""), kArch) << preset;
    ASSERT_TRUE(j.contains("layer_types") && j["layer_types"].is_array()) << preset;
    auto back = ModelConfig::Parse(text);
    ASSERT_TRUE(back.ok()) << preset << ": " << back.status().message();
    EXPECT_EQ(back->model_type, c->model_type) << preset;
    EXPECT_EQ(back->layer_types, c->layer_types) << preset;
    EXPECT_EQ(back->linear_conv_kernel_dim, c->linear_conv_kernel_dim) << preset;
    EXPECT_EQ(back->linear_key_head_dim, c->linear_key_head_dim) << preset;
    EXPECT_EQ(back->linear_value_head_dim, c->linear_value_head_dim) << preset;
    EXPECT_EQ(back->linear_num_key_heads, c->linear_num_key_heads) << preset;
    EXPECT_EQ(back->linear_num_value_heads, c->linear_num_value_heads) << preset;
    EXPECT_EQ(back->shared_expert_intermediate_size, c->shared_expert_intermediate_size) << preset;
    EXPECT_EQ(back->attn_output_gate, c->attn_output_gate) << preset;
    EXPECT_EQ(back->partial_rotary_factor, c->partial_rotary_factor) << preset;
    EXPECT_EQ(back->head_dim, c->head_dim) << preset;
    EXPECT_EQ(back->num_attention_heads, c->num_attention_heads) << preset;
    EXPECT_EQ(back->num_key_value_heads, c->num_key_value_heads) << preset;
    EXPECT_EQ(back->num_experts, c->num_experts) << preset;
    EXPECT_EQ(back->num_experts_per_tok, c->num_experts_per_tok) << preset;
    EXPECT_EQ(back->moe_intermediate_size, c->moe_intermediate_size) << preset;
    EXPECT_EQ(back->rope_theta, c->rope_theta) << preset;
    EXPECT_EQ(back->rope_type, c->rope_type) << preset;
    EXPECT_EQ(back->rms_norm_eps, c->rms_norm_eps) << preset;
    EXPECT_EQ(back->tie_word_embeddings, c->tie_word_embeddings) << preset;
    EXPECT_EQ(back->vocab_size, c->vocab_size) << preset;
    EXPECT_EQ(back->hidden_size, c->hidden_size) << preset;
    EXPECT_EQ(back->num_hidden_layers, c->num_hidden_layers) << preset;
    EXPECT_EQ(back->max_position_embeddings, c->max_position_embeddings) << preset;
    EXPECT_EQ(back->LinearConvDim(), c->LinearConvDim()) << preset;
    EXPECT_EQ(back->RotaryDim(), c->RotaryDim()) << preset;
    for (int64_t i = 0; i < back->num_hidden_layers; ++i) {
      EXPECT_EQ(back->IsLinearLayer(i), (i + 1) % 4 != 0) << preset << " layer " << i;  // full_attention_interval 4
      EXPECT_TRUE(back->IsMoeLayer(i)) << preset << " layer " << i;
    }
  }
  // The real model's text fields (Qwen3.5/3.6-35B-A3B's text_config).
  auto real = testmodel::PresetConfig(kArch, "qwen3.5-35b-a3b");
  ASSERT_TRUE(real.ok()) << real.status().message();
  EXPECT_EQ(real->vocab_size, 248320);
  EXPECT_EQ(real->hidden_size, 2048);
  EXPECT_EQ(real->num_hidden_layers, 40);
  EXPECT_EQ(std::count(real->layer_types.begin(), real->layer_types.end(), kFull), 10);
  EXPECT_EQ(real->num_attention_heads, 16);
  EXPECT_EQ(real->num_key_value_heads, 2);
  EXPECT_EQ(real->head_dim, 256);
  EXPECT_EQ(real->partial_rotary_factor, 0.25);
  EXPECT_EQ(real->RotaryDim(), 64);
  EXPECT_EQ(real->rope_theta, 1e7);
  EXPECT_TRUE(real->attn_output_gate);
  EXPECT_EQ(real->linear_conv_kernel_dim, 4);
  EXPECT_EQ(real->linear_key_head_dim, 128);
  EXPECT_EQ(real->linear_value_head_dim, 128);
  EXPECT_EQ(real->linear_num_key_heads, 16);
  EXPECT_EQ(real->linear_num_value_heads, 32);
  EXPECT_EQ(real->num_experts, 256);
  EXPECT_EQ(real->num_experts_per_tok, 8);
  EXPECT_EQ(real->moe_intermediate_size, 512);
  EXPECT_EQ(real->shared_expert_intermediate_size, 512);
  EXPECT_EQ(real->rms_norm_eps, 1e-6);
  EXPECT_FALSE(real->tie_word_embeddings);
  EXPECT_EQ(real->max_position_embeddings, 262144);
}

// Fields loom cannot honour are refused by name.
TEST(Qwen35, RefusalsNameTheField) {
  const auto with = [](const char* field, const nlohmann::json& v) {
    nlohmann::json j = nlohmann::json::parse(TinyQwen35().ToJson());
    j[field] = v;
    return ModelConfig::Parse(j.dump());
  };
  const nlohmann::json lin = kLinear, full = kFull;
  for (const auto& [field, value] : std::vector<std::pair<const char*, nlohmann::json>>{
           {"layer_types", nlohmann::json::array({lin, lin, lin, "sliding_attention"})},
           {"layer_types", nlohmann::json::array({lin, lin, "linear", full})},
           {"layer_types", nlohmann::json::array({lin, lin, full})},  // 3 entries for 4 layers
           {"linear_num_value_heads", 3},                              // not a multiple of the 2 key heads
           {"linear_num_value_heads", 0},
           {"linear_num_key_heads", 0},
           {"linear_key_head_dim", 0},
           {"linear_value_head_dim", 0},
           {"linear_conv_kernel_dim", 0},
           {"hidden_act", "gelu"}}) {  // also the DeltaNet conv's activation
    auto r = with(field, value);
    ASSERT_FALSE(r.ok()) << field << " = " << value.dump();
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
  }
}

// The sampler holds one recurrent state per batch row in every Gated
// DeltaNet layer: rows whose states the memory cannot hold are refused at
// Open with the flag and the bytes, not found by running out of memory.
TEST(Qwen35, SamplerStatesBeyondTheMemoryAreRefusedAtOpen) {
  const ModelConfig c = TinyQwen35();
  auto model = Transformer::FromTensors(c, Qwen35Weights(c, 8), at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  std::shared_ptr<const Transformer> m(std::move(*model));
  int64_t per_row = 0;  // the states of one row: every linear layer's [value heads, key dim, value dim] in fp32
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (c.layer_types[i] == kLinear) per_row += c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
  ASSERT_GT(per_row, 0);
  SamplerOptions o;
  o.max_rank = 4;
  o.kv_budget_tokens = 1024;
  o.max_batch_rows = std::numeric_limits<int>::max();  // ~2e9 rows: terabytes of states
  auto refused = Sampler::Open(m, o);
  ASSERT_FALSE(refused.ok());
  const std::string& msg = refused.status().message();
  EXPECT_NE(msg.find("recurrent states of " + std::to_string(o.max_batch_rows) + " batch rows (--max-batch-rows): " +
                     std::to_string(per_row * o.max_batch_rows / (1024 * 1024)) + " MiB"),
            std::string::npos)
      << msg;
  o.max_batch_rows = 8;
  EXPECT_TRUE(Sampler::Open(m, o).ok());
}

// A config.json as the hub ships Qwen3.5-35B-A3B (qwen3_5_moe, the text
// fields in text_config beside a vision_config) reads as the text model;
// layer_types, when absent, follow full_attention_interval (default 4) as
// HF derives them. (HF behaviour from the spec, section 1; beyond the
// engine's stated contract: drop this test if loom reads only the
// text-only layout.)
TEST(Qwen35, ConfigReadsTheHubLayout) {
  const nlohmann::json text = nlohmann::json::parse(TinyQwen35().ToJson());
  nlohmann::json hub = {{"architectures", nlohmann::json::array({"Qwen3_5MoeForConditionalGeneration"})},
                        {"model_type", "qwen3_5_moe"},
                        {"tie_word_embeddings", false},
                        {"image_token_id", 248056},
                        {"video_token_id", 248057},
                        {"text_config", text},
                        {"vision_config", {{"model_type", "qwen3_5_moe"}, {"depth", 27}, {"hidden_size", 1152}}}};
  hub["text_config"]["model_type"] = "qwen3_5_moe_text";
  auto c = ModelConfig::Parse(hub.dump());
  ASSERT_TRUE(c.ok()) << c.status().message();
  const ModelConfig tiny = TinyQwen35();
  EXPECT_EQ(c->hidden_size, tiny.hidden_size);
  EXPECT_EQ(c->num_hidden_layers, tiny.num_hidden_layers);
  EXPECT_EQ(c->layer_types, tiny.layer_types);
  EXPECT_EQ(c->linear_num_value_heads, tiny.linear_num_value_heads);
  EXPECT_EQ(c->num_experts, tiny.num_experts);
  EXPECT_EQ(c->shared_expert_intermediate_size, tiny.shared_expert_intermediate_size);
  EXPECT_EQ(c->partial_rotary_factor, tiny.partial_rotary_factor);
  EXPECT_EQ(c->head_dim, tiny.head_dim);

  nlohmann::json derived = text;
  derived.erase("layer_types");
  derived.erase("full_attention_interval");
  auto every4 = ModelConfig::Parse(derived.dump());
  ASSERT_TRUE(every4.ok()) << every4.status().message();
  EXPECT_EQ(every4->layer_types, (std::vector<std::string>{kLinear, kLinear, kLinear, kFull}));
  derived["full_attention_interval"] = 2;
  auto every2 = ModelConfig::Parse(derived.dump());
  ASSERT_TRUE(every2.ok()) << every2.status().message();
  EXPECT_EQ(every2->layer_types, (std::vector<std::string>{kLinear, kFull, kLinear, kFull}));
}

// The hub's checkpoint layout: config.json the multimodal wrapper with the
// text model in text_config, the text weights under model.language_model.
// beside a vision tower and an MTP layer. It loads as the text model and
// gives the same logprobs as make-model's flat layout.
TEST(Qwen35, LoadsTheHubsMultimodalCheckpoint) {
  test::TempDir flat("loom-qwen35-flat"), hub("loom-qwen35-hub");
  testmodel::MakeModelOptions o;
  o.arch = kArch;
  o.seed = 9;
  ASSERT_TRUE(testmodel::MakeModel(o, flat.path()).ok());
  auto files = ModelWeights::Open(flat.path());
  ASSERT_TRUE(files.ok()) << files.status().message();
  SafetensorsWriter w;
  for (const auto& [name, view] : files->tensors()) {
    const std::string hub_name = name.rfind("model.", 0) == 0 ? "model.language_model." + name.substr(6) : name;
    ASSERT_TRUE(w.Add(hub_name, view.dtype, view.shape, view.data, view.nbytes).ok()) << name;
  }
  const std::vector<float> extra(8, 1.0f);  // read by nobody: the vision tower's, the MTP layer's
  ASSERT_TRUE(w.Add("model.visual.blocks.0.attn.qkv.weight", "F32", {2, 4}, extra.data(), 32).ok());
  ASSERT_TRUE(w.Add("mtp.layers.0.input_layernorm.weight", "F32", {8}, extra.data(), 32).ok());
  ASSERT_TRUE(w.Write(hub / "model.safetensors").ok());
  std::ifstream in(flat / "config.json");
  nlohmann::json text = nlohmann::json::parse(in);
  text["model_type"] = "qwen3_5_moe_text";
  const nlohmann::json config = {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
                                 {"model_type", "qwen3_5_moe"},
                                 {"tie_word_embeddings", false},
                                 {"text_config", text},
                                 {"vision_config", {{"model_type", "qwen3_5_moe"}, {"depth", 1}}}};
  std::ofstream(hub / "config.json") << config.dump();

  auto a = Transformer::Load(flat.path(), at::kCPU, at::kFloat);
  auto b = Transformer::Load(hub.path(), at::kCPU, at::kFloat);
  ASSERT_TRUE(a.ok()) << a.status().message();
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ((*b)->config().model_type, kArch);
  auto bank = Bank(**a, 1, 4);
  c10::NoGradGuard no_grad;
  const std::vector<std::vector<int32_t>> seqs = {Seq(10, 2)};
  const PackedBatch batch = PackedBatch::Make(seqs, {-1}, at::kCPU);
  const at::Tensor want = (*a)->TargetLogprobs((*a)->Hidden(batch, *bank), NextTokens(seqs), batch, *bank);
  const at::Tensor got = (*b)->TargetLogprobs((*b)->Hidden(batch, *bank), NextTokens(seqs), batch, *bank);
  EXPECT_EQ(MaxDiff(got, want), 0.0);
}

// The real preset's checkpoint names and shapes (the text model of the hub
// checkpoint, model.language_model. read as model.): 693 tensors.
TEST(Qwen35, RealPresetShapes) {
  auto real = testmodel::PresetConfig(kArch, "qwen3.5-35b-a3b");
  ASSERT_TRUE(real.ok()) << real.status().message();
  const auto list = Transformer::ExpectedWeights(*real);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, shape] : list) EXPECT_TRUE(shapes.emplace(name, shape).second) << "twice: " << name;
  EXPECT_EQ(list.size(), 693u);  // embed + norm + lm_head + 30 x 18 + 10 x 15
  const auto expect = [&](const std::string& name, std::vector<int64_t> shape) {
    auto it = shapes.find(name);
    if (it == shapes.end()) {
      ADD_FAILURE() << "missing " << name;
    } else {
      EXPECT_EQ(it->second, shape) << name;
    }
  };
  expect("model.embed_tokens.weight", {248320, 2048});
  expect("model.norm.weight", {2048});
  expect("lm_head.weight", {248320, 2048});
  // A linear-attention layer.
  expect("model.layers.0.input_layernorm.weight", {2048});
  expect("model.layers.0.post_attention_layernorm.weight", {2048});
  expect("model.layers.0.linear_attn.in_proj_qkv.weight", {8192, 2048});
  expect("model.layers.0.linear_attn.in_proj_z.weight", {4096, 2048});
  expect("model.layers.0.linear_attn.in_proj_b.weight", {32, 2048});
  expect("model.layers.0.linear_attn.in_proj_a.weight", {32, 2048});
  expect("model.layers.0.linear_attn.conv1d.weight", {8192, 1, 4});
  expect("model.layers.0.linear_attn.dt_bias", {32});
  expect("model.layers.0.linear_attn.A_log", {32});
  expect("model.layers.0.linear_attn.norm.weight", {128});
  expect("model.layers.0.linear_attn.out_proj.weight", {2048, 4096});
  expect("model.layers.0.mlp.gate.weight", {256, 2048});
  expect("model.layers.0.mlp.experts.gate_up_proj", {256, 1024, 2048});
  expect("model.layers.0.mlp.experts.down_proj", {256, 2048, 512});
  expect("model.layers.0.mlp.shared_expert.gate_proj.weight", {512, 2048});
  expect("model.layers.0.mlp.shared_expert.up_proj.weight", {512, 2048});
  expect("model.layers.0.mlp.shared_expert.down_proj.weight", {2048, 512});
  expect("model.layers.0.mlp.shared_expert_gate.weight", {1, 2048});
  // A full-attention layer.
  expect("model.layers.3.self_attn.q_proj.weight", {8192, 2048});
  expect("model.layers.3.self_attn.k_proj.weight", {512, 2048});
  expect("model.layers.3.self_attn.v_proj.weight", {512, 2048});
  expect("model.layers.3.self_attn.o_proj.weight", {2048, 4096});
  expect("model.layers.3.self_attn.q_norm.weight", {256});
  expect("model.layers.3.self_attn.k_norm.weight", {256});
  expect("model.layers.39.self_attn.q_proj.weight", {8192, 2048});
  expect("model.layers.38.linear_attn.in_proj_qkv.weight", {8192, 2048});
  expect("model.layers.39.mlp.experts.gate_up_proj", {256, 1024, 2048});
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(shapes.count("model.layers.3.linear_attn.in_proj_qkv.weight"), 0u);
  size_t linear = 0, full = 0;
  for (const auto& [name, shape] : shapes) {
    linear += name.find(".linear_attn.") != std::string::npos;
    full += name.find(".self_attn.") != std::string::npos;
    EXPECT_EQ(name.find("mtp."), std::string::npos) << name;
    EXPECT_EQ(name.find("visual"), std::string::npos) << name;
  }
  EXPECT_EQ(linear, 30u * 9);
  EXPECT_EQ(full, 10u * 6);
}

}  // namespace
}  // namespace loom::engine
