// Tiny random models of the supported architectures for engine tests: a
// config, random weights, a bank with random (non-zero B) adapters, and
// next-token targets.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/lora/slot_bank.h"
#include "engine/model/transformer.h"

namespace loom::engine {

// arch: "qwen2", "qwen3", "qwen3-bias" (qwen3 with attention_bias: q/k/v/o
// biases), "qwen3_moe" (both layers MoE: 4 experts, top-2, renormalised) or
// "qwen3_moe-mixed" (decoder_sparse_step 2: layer 0 dense, layer 1 MoE; top-2
// not renormalised) or "gpt_oss" (layer 0 sliding with a window of 3, layer 1
// full; 4 experts of width 12, top-2; YaRN with a ramp across the
// frequencies: factor 4, original context 64).
inline ModelConfig TinyConfig(const std::string& arch) {
  ModelConfig c;
  if (arch == "gpt_oss") {
    c.model_type = "gpt_oss";
    c.vocab_size = 61, c.hidden_size = 32, c.intermediate_size = 12, c.moe_intermediate_size = 12;
    c.num_hidden_layers = 2, c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 8;
    c.rms_norm_eps = 1e-5, c.rope_theta = 1000.0, c.max_position_embeddings = 128;
    c.rope_type = "yarn", c.rope_factor = 4.0, c.rope_original_max_position = 64, c.yarn_truncate = false;
    c.attention_bias = true, c.qk_norm = false, c.tie_word_embeddings = false;
    c.num_experts = 4, c.num_experts_per_tok = 2, c.norm_topk_prob = true;
    c.sliding_window = 3, c.layer_types = {"sliding_attention", "full_attention"};
    return c;
  }
  const bool moe = arch.rfind("qwen3_moe", 0) == 0;
  c.model_type = moe ? "qwen3_moe" : arch.substr(0, 5);
  c.vocab_size = 61;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000.0;
  c.max_position_embeddings = 128;
  c.tie_word_embeddings = arch == "qwen3";
  c.attention_bias = arch != "qwen3" && !moe;
  c.qk_norm = c.model_type != "qwen2";
  if (moe) {
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 12;
    c.norm_topk_prob = arch == "qwen3_moe";
    c.decoder_sparse_step = arch == "qwen3_moe" ? 1 : 2;
  }
  return c;
}

inline std::map<std::string, at::Tensor> RandomWeights(const ModelConfig& c, uint64_t seed) {
  at::manual_seed(seed);
  std::map<std::string, at::Tensor> w;
  for (const auto& [name, shape] : Transformer::ExpectedWeights(c)) {
    const bool norm = name.find("norm") != std::string::npos;
    // gpt_oss: sinks of O(1); gate/up pre-activations of std about 3.4 on
    // normed rows of width 32, so the +-7 clamps bite (a few percent); a small down.
    const auto ends = [&](const char* s) { return name.size() >= strlen(s) && name.rfind(s) == name.size() - strlen(s); };
    const double std_dev = ends("sinks") ? 1.0 : ends("experts.gate_up_proj") ? 0.6 : ends("experts.down_proj") ? 0.1 : 0.3;
    w[name] = norm ? 1.0 + 0.2 * at::randn(shape) : std_dev * at::randn(shape);
  }
  return w;
}

inline std::unique_ptr<Transformer> Tiny(const std::string& arch, uint64_t seed = 1) {
  auto t = Transformer::FromTensors(TinyConfig(arch), RandomWeights(TinyConfig(arch), seed), at::kCPU, at::kFloat);
  EXPECT_TRUE(t.ok()) << t.status().message();
  return std::move(t.value());
}

inline std::unique_ptr<SlotBank> Bank(const Transformer& t, int slots = 4, int rank = 4) {
  return std::make_unique<SlotBank>(slots, rank, at::kCPU, t.LoraTargets());
}

// Binds slot s and gives its B random entries of scale b_scale (a fresh
// adapter's B is zero, which would hide every LoRA path).
inline void BindRandom(SlotBank& bank, int s, int rank, double alpha, uint64_t seed, double b_scale = 0.2) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = alpha;
  c.seed = seed;
  ASSERT_TRUE(bank.Bind(s, c).ok());
  at::manual_seed(seed);
  c10::NoGradGuard no_grad;
  for (auto& t : bank.targets())
    t.B.select(0, s).narrow(-1, 0, rank).copy_(b_scale * at::randn(t.FactorShape(false, rank)));
}

// Next-token targets within each sequence (the last token predicts token 0).
inline at::Tensor NextTokens(const std::vector<std::vector<int32_t>>& seqs) {
  std::vector<int64_t> v;
  for (const auto& s : seqs)
    for (size_t i = 0; i < s.size(); ++i) v.push_back(i + 1 < s.size() ? s[i + 1] : 0);
  return at::tensor(v, at::TensorOptions().dtype(at::kLong));
}

inline std::vector<int32_t> Seq(int len, int salt) {
  std::vector<int32_t> s;
  for (int i = 0; i < len; ++i) s.push_back((i * 7 + salt * 13 + 3) % 61);
  return s;
}

inline double MaxDiff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }
// Max difference relative to the reference's scale (at least 1): for
// gradients summed over many terms in a different order.
inline double RelDiff(const at::Tensor& a, const at::Tensor& ref) {
  return MaxDiff(a, ref) / std::max(1.0, ref.abs().max().item<double>());
}

// One packed pass of several sequences under their slots (-1: base) against
// a plain reference (ref.Logprobs(seq, slot): [L, vocab] log-probabilities):
// each sequence's next-token logprobs within lp_tol, and every LoRA target's
// gradients of the summed loss within grad_tol relative, each non-zero.
template <typename Ref>
void ExpectPackedPassMatches(const Transformer& model, SlotBank& bank, const Ref& ref,
                             const std::vector<std::vector<int32_t>>& seqs, const std::vector<int>& slots,
                             double lp_tol, double grad_tol) {
  const PackedBatch batch = PackedBatch::Make(seqs, slots, at::kCPU);
  const at::Tensor targets = NextTokens(seqs);
  const at::Tensor lp = model.TargetLogprobs(model.Hidden(batch, bank), targets, batch, bank);
  (-lp.sum()).backward();
  std::vector<at::Tensor> got;
  for (auto& t : bank.targets()) {
    got.push_back(t.A.grad().clone());
    got.push_back(t.B.grad().clone());
    t.A.mutable_grad().zero_();
    t.B.mutable_grad().zero_();
  }
  at::Tensor loss = at::zeros({});
  for (size_t i = 0; i < seqs.size(); ++i) {
    const at::Tensor want = ref.Logprobs(seqs[i], slots[i]);
    const int64_t begin = batch.seq_begin[i], n = static_cast<int64_t>(seqs[i].size());
    const at::Tensor picked = want.gather(1, targets.narrow(0, begin, n).unsqueeze(1)).squeeze(1);
    EXPECT_LT(MaxDiff(lp.detach().narrow(0, begin, n), picked.detach()), lp_tol) << "seq " << i;
    loss = loss - picked.sum();
  }
  loss.backward();
  size_t k = 0;
  for (const auto& t : bank.targets()) {
    for (const at::Tensor& g : {t.A.grad(), t.B.grad()}) {
      EXPECT_LT(RelDiff(got[k], g), grad_tol) << t.module;
      EXPECT_GT(got[k].abs().max().item<double>(), 0) << t.module << " got no gradient";
      ++k;
    }
  }
}

}  // namespace loom::engine
