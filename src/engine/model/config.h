// ModelConfig: the fields of a Hugging Face config.json that loom's
// architectures use. Parse() rejects unsupported model_type or rope scaling
// with a message naming the field. Torch-free.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace loom::engine {

struct ModelConfig {
  std::string model_type;          // a family's model_type (model/family.h: FamilyNames())
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;            // qwen3 states it; qwen2: hidden / heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;     // qwen2: q/k/v have bias; qwen3: per config (default false)
  bool qk_norm = false;            // qwen3: per-head RMSNorm on q and k
  std::string torch_dtype;         // as stated in config.json ("float32", "bfloat16", ...)
  int64_t bos_token_id = -1;       // -1 = not stated
  int64_t eos_token_id = -1;       // -1 = not stated
  double initializer_range = 0.02; // std of the normal init (make-model)

  // Mixture of experts (qwen3_moe; num_experts 0 = dense). Layer i is MoE iff
  // i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the
  // others are dense SwiGLU MLPs of width intermediate_size.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;    // top-k
  int64_t moe_intermediate_size = 0;  // each expert's SwiGLU width
  bool norm_topk_prob = false;        // renormalise the top-k probabilities to sum to 1
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  int64_t first_k_dense_replace = 0;  // deepseek, glm4_moe: layers below it are dense whatever the above say
  // Multi-token-prediction layers a checkpoint may carry after the last
  // layer (deepseek_v3, glm4_moe: model.layers.{num_hidden_layers}...): not
  // used for training or sampling, skipped at load as HF does.
  int64_t num_nextn_predict_layers = 0;
  bool IsMoeLayer(int64_t layer) const;

  // DeepSeek (deepseek_v2, deepseek_v3): multi-head latent attention (MLA)
  // when kv_lora_rank > 0. q is q_proj(h), or q_b_proj(norm(q_a_proj(h)))
  // when q_lora_rank > 0, split per head into qk_nope_head_dim and
  // qk_rope_head_dim; kv_a_proj_with_mqa(h) is the latent c (kv_lora_rank,
  // normed) and one RoPE key shared by all heads (qk_rope_head_dim);
  // kv_b_proj(c) gives each head its nope key and its value (v_head_dim).
  // RoPE (over qk_rope_head_dim: head_dim is set to it) rotates adjacent
  // pairs when rope_interleave. The sampler caches c and the RoPE key only.
  int64_t q_lora_rank = 0, kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = false;
  bool IsMla() const { return kv_lora_rank > 0; }
  // DeepSeek-style experts: n_shared_experts always-on experts (one dense
  // SwiGLU of width moe_intermediate_size * n_shared_experts) beside the
  // routed ones; the routing weights times routed_scaling_factor. Routing
  // (moe.h): "softmax" scores, top-k over the topk_group best of n_group
  // groups by their best score (deepseek_v2's greedy and
  // group_limited_greedy); or "sigmoid" scores plus a correction bias for
  // the choice only, groups ranked by their two best (deepseek_v3's noaux_tc).
  // DeepSeek sparse attention (glm_moe_dsa, GLM-5.2; model/dsa.h) when
  // index_topk > 0: each MLA layer's lightning indexer (index_n_heads heads
  // of index_head_dim) scores every earlier key of the sequence and the
  // query attends to the index_topk best only. indexer_types[i] is "full"
  // (layer i runs its indexer) or "shared" (it reuses the choice of the
  // nearest full layer below it); empty: all full.
  int64_t index_topk = 0, index_head_dim = 0, index_n_heads = 0;
  std::vector<std::string> indexer_types;
  bool IsDsa() const { return index_topk > 0; }
  // The layer whose indexer chooses layer `layer`'s keys (itself when full;
  // a shared first layer runs its own, as HF's has no choice to reuse).
  int64_t DsaSource(int64_t layer) const;

  int64_t n_shared_experts = 0;
  double routed_scaling_factor = 1.0;
  int64_t n_group = 1, topk_group = 1;
  std::string scoring_func = "softmax";
  std::string topk_method;  // as config.json states it (written back)

  // gpt_oss: every layer is MoE (moe_intermediate_size = intermediate_size,
  // the HF field), with a biased top-k-then-softmax router, interleaved
  // clamped-SwiGLU experts with biases, and attention with per-head sinks.
  // layer_types[i] is "sliding_attention" (the last sliding_window keys,
  // the query's own included) or "full_attention"; empty = all full.
  int64_t sliding_window = 0;
  std::vector<std::string> layer_types;
  double swiglu_limit = 7.0;          // as config.json states it; HF's bf16 experts hard-code 7.0
  bool IsSlidingLayer(int64_t layer) const;
  bool IsGptOss() const { return model_type == "gpt_oss"; }

  // mimo_v2_flash's attention: sliding layers with sliding_key_value_heads
  // key/value heads (0: num_key_value_heads) and RoPE theta
  // rope_theta_sliding (0: rope_theta); values of v_head_dim (0: head_dim;
  // MLA's field too) scaled by attention_value_scale (0: none).
  int64_t sliding_key_value_heads = 0;
  double rope_theta_sliding = 0;
  double attention_value_scale = 0;
  // Layer `layer`'s key/value heads, and the value width of the plain attention.
  int64_t KvHeads(int64_t layer) const {
    return IsSlidingLayer(layer) && sliding_key_value_heads > 0 ? sliding_key_value_heads : num_key_value_heads;
  }
  int64_t ValueDim() const { return v_head_dim > 0 && !IsMla() ? v_head_dim : head_dim; }

  // qwen3_5_moe (Qwen3.5/3.6-35B-A3B; model/gated_deltanet.h): layer_types[i]
  // "linear_attention" is a Gated DeltaNet layer (linear_num_key_heads key
  // heads of linear_key_head_dim, linear_num_value_heads value heads of
  // linear_value_head_dim, a causal conv of linear_conv_kernel_dim taps),
  // "full_attention" a gated attention layer: q_proj emits, per head, the
  // query and then as many gate rows, and the attention's output is
  // multiplied by sigmoid(gate) before o_proj (attn_output_gate). Its MoE
  // layers add a shared expert of shared_expert_intermediate_size behind a
  // sigmoid gate (mlp.shared_expert_gate).
  int64_t linear_conv_kernel_dim = 0, linear_key_head_dim = 0, linear_value_head_dim = 0;
  int64_t linear_num_key_heads = 0, linear_num_value_heads = 0;
  int64_t shared_expert_intermediate_size = 0;
  bool attn_output_gate = false;
  bool IsLinearLayer(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(layer_types.size()) && layer_types[layer] == "linear_attention";
  }
  // Whether a training pass may carry shared prefixes (PackedBatch::seq_prefix):
  // every layer's sequence mixing is softmax attention over keys that a
  // continuation can see past its prefix's. Not a Gated DeltaNet layer (its
  // state runs through the sequence) nor DSA (its per-sequence key choice).
  bool SharesPrefixes() const {
    if (IsDsa()) return false;
    for (int64_t l = 0; l < num_hidden_layers; ++l)
      if (IsLinearLayer(l)) return false;
    return true;
  }
  // The Gated DeltaNet's conv channels: q and k (heads x key width each), v.
  int64_t LinearConvDim() const {
    return 2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * linear_value_head_dim;
  }

  // RoPE over the first head_dim * partial_rotary_factor dims of each head
  // (glm4_moe: 0.5), the rest passed through; halves layout within them.
  double partial_rotary_factor = 1.0;
  int64_t RotaryDim() const { return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor); }
  // RoPE scaling: "default" (none) or "yarn" (gpt_oss) with its parameters.
  std::string rope_type = "default";
  double rope_factor = 1.0;
  double yarn_beta_fast = 32.0, yarn_beta_slow = 1.0;
  int64_t rope_original_max_position = 0;  // 0 = max_position_embeddings
  bool yarn_truncate = true;               // HF's default when the key is absent
  // DeepSeek's YaRN keys (0: absent): the attention factor on cos and sin is
  // mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim) when
  // both are stated (HF's _compute_yarn_parameters), and deepseek_v3's
  // softmax scale is multiplied by mscale(factor, yarn_mscale_all_dim)^2.
  double yarn_mscale = 0, yarn_mscale_all_dim = 0;

  // Parse rejects (naming the field): unsupported model_type, a rope_scaling
  // (or non-default rope_parameters) other than gpt_oss's yarn, use_sliding_window true, hidden_act
  // other than silu, a missing or non-positive size, heads not divisible by
  // key/value heads. Defaults follow HF: num_key_value_heads = heads,
  // head_dim = hidden / heads when absent.
  static Result<ModelConfig> Parse(const std::string& json_text);
  // Reads model_dir/config.json (NotFound when absent).
  static Result<ModelConfig> Load(const std::string& model_dir);
  std::string ToJson() const;      // HF-compatible config.json text (transformers 4.x and 5.x load it)
};

// Hugging Face names and shapes of the base weights a config needs, in the
// checkpoint's own layout (lm_head.weight only when embeddings are untied;
// qwen3_moe experts one tensor per expert and projection, as the hub ships
// them; gpt_oss experts as HF's bf16 fused params [E, in, out], gate/up
// columns interleaved). The loader and make-model both follow this list.
std::vector<std::pair<std::string, std::vector<int64_t>>> BaseWeightShapes(const ModelConfig& config);

}  // namespace loom::engine
