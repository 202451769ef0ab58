// A gpt_oss forward written from the specification (transformers 5.17's
// modeling_gpt_oss, read as notes/issue20_reference.md section 2 states it),
// independently of loom's packed code: one sequence, token by token, in
// double, from the Hugging Face tensors as the checkpoint stores them
// (experts [E, in, out] with gate/up columns interleaved), with an explicit
// loop over the visible keys and the sink in the denominator, YaRN from the
// formula, and each chosen expert run on its own.
//
// With a bank and a slot, the slot's LoRA is added as HF+PEFT would see it:
// q/k/v/o and lm_head as scale * B A x; the experts' factors (loom's layout,
// slot_bank.h: gate_up shares A and keeps B per expert, rows gate then up)
// as a per-expert delta W_e + scale * B_e A_e mapped onto HF's interleaved
// columns (loom row j < I is HF column 2j, row I + j is column 2j + 1).
// The factors enter as themselves, so a backward through this reference
// lands its gradients in the bank (tests compare them with loom's).
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "engine/lora/slot_bank.h"
#include "engine/model/config.h"

namespace loom::engine {

// YaRN's inverse frequencies and attention factor, straight from the formula.
inline std::pair<std::vector<double>, double> ReferenceYarn(const ModelConfig& c) {
  const double d = static_cast<double>(c.head_dim), base = c.rope_theta, f = c.rope_factor;
  const double L0 = static_cast<double>(c.rope_original_max_position > 0 ? c.rope_original_max_position
                                                                          : c.max_position_embeddings);
  auto corr = [&](double n) { return d * std::log(L0 / (2 * M_PI * n)) / (2 * std::log(base)); };
  double low = corr(c.yarn_beta_fast), high = corr(c.yarn_beta_slow);
  if (c.yarn_truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0), high = std::min(high, d - 1);
  if (low == high) high += 0.001;
  std::vector<double> inv(c.head_dim / 2);
  for (int64_t i = 0; i < c.head_dim / 2; ++i) {
    const double pos_freq = std::pow(base, 2.0 * i / d);
    const double ramp = std::min(1.0, std::max(0.0, (i - low) / (high - low)));
    inv[i] = ramp / (f * pos_freq) + (1 - ramp) / pos_freq;
  }
  return {inv, f > 1 ? 0.1 * std::log(f) + 1 : 1.0};
}

inline at::Tensor GptOssReferenceLogprobs(const ModelConfig& c, std::map<std::string, at::Tensor> w,
                                          const std::vector<int32_t>& seq, const SlotBank* bank = nullptr,
                                          int slot = -1) {
  const auto D = at::TensorOptions().dtype(at::kDouble);
  for (auto& [name, t] : w) t = t.to(at::kDouble);
  const int64_t L = seq.size(), hd = c.head_dim, H = c.num_attention_heads, KV = c.num_key_value_heads;
  const int64_t E = c.num_experts, I = c.intermediate_size, K = c.num_experts_per_tok;
  const double scale = bank && slot >= 0 ? bank->scales()[slot].item<double>() : 0.0;
  // The slot's delta for a plain target (none: zeros).
  auto lora = [&](const std::string& module, const at::Tensor& x) -> at::Tensor {
    const LoraTarget* t = bank && slot >= 0 ? bank->find(module) : nullptr;
    if (!t || !bank->trains(slot, t->group)) return at::Tensor();
    return scale * at::matmul(at::matmul(x, t->A[slot].to(at::kDouble).t()), t->B[slot].to(at::kDouble).t());
  };
  auto rms = [&](const at::Tensor& x, const at::Tensor& g) {
    return g * (x / at::sqrt((x * x).mean(-1, true) + c.rms_norm_eps));
  };
  const auto [inv_freq, attn_factor] = ReferenceYarn(c);
  auto rope = [&, inv = inv_freq, af = attn_factor](const at::Tensor& t, int64_t pos) {  // [heads, hd]
    at::Tensor cos = at::empty({hd / 2}, D), sin = at::empty({hd / 2}, D);
    for (int64_t i = 0; i < hd / 2; ++i) {
      cos[i] = std::cos(pos * inv[i]) * af;
      sin[i] = std::sin(pos * inv[i]) * af;
    }
    const at::Tensor x1 = t.narrow(-1, 0, hd / 2), x2 = t.narrow(-1, hd / 2, hd / 2);
    return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
  };

  std::vector<int64_t> ids(seq.begin(), seq.end());
  at::Tensor x = w["model.embed_tokens.weight"].index_select(0, at::tensor(ids, at::kLong));  // [L, hidden]
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    const at::Tensor h = rms(x, w[p + "input_layernorm.weight"]);
    auto proj = [&](const std::string& n, const at::Tensor& in) {
      at::Tensor y = at::matmul(in, w[p + "self_attn." + n + ".weight"].t()) + w[p + "self_attn." + n + ".bias"];
      if (at::Tensor d = lora(p + "self_attn." + n, in); d.defined()) y = y + d;
      return y;
    };
    const at::Tensor q = proj("q_proj", h).view({L, H, hd}), k = proj("k_proj", h).view({L, KV, hd});
    const at::Tensor v = proj("v_proj", h).view({L, KV, hd});
    std::vector<at::Tensor> qr, kr;
    for (int64_t t = 0; t < L; ++t) {
      qr.push_back(rope(q[t], t));
      kr.push_back(rope(k[t], t));
    }
    const bool sliding = layer < static_cast<int64_t>(c.layer_types.size()) &&
                         c.layer_types[layer] == "sliding_attention" && c.sliding_window > 0;
    const at::Tensor sinks = w[p + "self_attn.sinks"];
    std::vector<at::Tensor> rows;
    for (int64_t t = 0; t < L; ++t) {
      std::vector<at::Tensor> heads;
      for (int64_t head = 0; head < H; ++head) {
        const int64_t g = head / (H / KV);
        // Keys j with t - W < j <= t (sliding) or j <= t; the sink in the denominator only.
        const int64_t first = sliding ? std::max<int64_t>(0, t - c.sliding_window + 1) : 0;
        std::vector<at::Tensor> logits;
        for (int64_t j = first; j <= t; ++j) logits.push_back((qr[t][head] * kr[j][g]).sum() / std::sqrt(double(hd)));
        const at::Tensor s = at::stack(logits);
        const at::Tensor m = at::maximum(s.max(), sinks[head]);
        const at::Tensor e = at::exp(s - m);
        const at::Tensor denom = e.sum() + at::exp(sinks[head] - m);
        at::Tensor out = at::zeros({hd}, D);
        for (int64_t j = first; j <= t; ++j) out = out + e[j - first] / denom * v[j][g];
        heads.push_back(out);
      }
      rows.push_back(at::cat(heads));
    }
    const at::Tensor attn = at::stack(rows);
    x = x + at::matmul(attn, w[p + "self_attn.o_proj.weight"].t()) + w[p + "self_attn.o_proj.bias"];
    if (at::Tensor d = lora(p + "self_attn.o_proj", attn); d.defined()) x = x + d;

    const at::Tensor h2 = rms(x, w[p + "post_attention_layernorm.weight"]);
    // The experts' weights as HF+PEFT sees them: base plus the slot's delta.
    at::Tensor gate_up = w[p + "mlp.experts.gate_up_proj"], down = w[p + "mlp.experts.down_proj"];  // [E,H,2I], [E,I,H]
    const LoraTarget* gu_t = bank && slot >= 0 ? bank->find(p + "mlp.experts.gate_up_proj") : nullptr;
    const LoraTarget* dn_t = bank && slot >= 0 ? bank->find(p + "mlp.experts.down_proj") : nullptr;
    if (gu_t && bank->trains(slot, TargetGroup::kMlp)) {
      std::vector<at::Tensor> gu, dn;
      for (int64_t e = 0; e < E; ++e) {
        const at::Tensor d_gu = scale * at::matmul(gu_t->B[slot][e].to(at::kDouble), gu_t->A[slot].to(at::kDouble));
        // loom's rows [gate 0..I-1; up 0..I-1] onto HF's columns 2j, 2j+1.
        const at::Tensor interleaved = at::stack({d_gu.narrow(0, 0, I), d_gu.narrow(0, I, I)}, 1).reshape({2 * I, -1});
        gu.push_back(gate_up[e] + interleaved.t());
        const at::Tensor d_dn = scale * at::matmul(dn_t->B[slot].to(at::kDouble), dn_t->A[slot][e].to(at::kDouble));
        dn.push_back(down[e] + d_dn.t());
      }
      gate_up = at::stack(gu), down = at::stack(dn);
    }
    std::vector<at::Tensor> mlp_rows;
    for (int64_t t = 0; t < L; ++t) {
      const at::Tensor logits = at::matmul(w[p + "mlp.router.weight"], h2[t]) + w[p + "mlp.router.bias"];  // [E]
      const auto [top_v, top_e] = logits.topk(K);
      const at::Tensor weights = at::softmax(top_v, 0);
      at::Tensor out = at::zeros({c.hidden_size}, D);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = top_e[k].item<int64_t>();
        const at::Tensor z = at::matmul(h2[t], gate_up[e]) + w[p + "mlp.experts.gate_up_proj_bias"][e];  // [2I]
        std::vector<at::Tensor> act;
        for (int64_t j = 0; j < I; ++j) {
          const at::Tensor g = at::clamp_max(z[2 * j], 7.0), u = at::clamp(z[2 * j + 1], -7.0, 7.0);
          act.push_back(g * at::sigmoid(1.702 * g) * (u + 1));
        }
        const at::Tensor y = at::matmul(at::stack(act), down[e]) + w[p + "mlp.experts.down_proj_bias"][e];
        out = out + weights[k] * y;
      }
      mlp_rows.push_back(out);
    }
    x = x + at::stack(mlp_rows);
  }
  x = rms(x, w["model.norm.weight"]);
  at::Tensor logits = at::matmul(x, w["lm_head.weight"].t());
  if (at::Tensor d = lora("lm_head", x); d.defined()) logits = logits + d;
  return at::log_softmax(logits, -1);
}

}  // namespace loom::engine
