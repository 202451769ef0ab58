// glm4_moe (GLM-4.5, GLM-4.5-Air; transformers' modeling_glm4_moe): grouped-
// query attention with biases on q/k/v (not o), per-head q/k RMSNorm when
// use_qk_norm, and RoPE over the first half of each head
// (partial_rotary_factor, halves layout); DeepSeek-style experts
// (families/deepseek_moe.h) with deepseek_v3's router: sigmoid scores plus
// the correction bias, renormalised, times routed_scaling_factor. Its
// checkpoints carry a multi-token-prediction layer after the last, skipped.
#include <nlohmann/json.hpp>

#include "engine/model/families/deepseek_moe.h"
#include "engine/model/family.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {
namespace {

using namespace config_json;

void Defaults(ModelConfig& c) {  // Glm4MoeConfig's
  c.partial_rotary_factor = 0.5;
  c.num_experts = 128, c.num_experts_per_tok = 8, c.moe_intermediate_size = 1408;
  c.n_shared_experts = 1, c.first_k_dense_replace = 1, c.routed_scaling_factor = 1.0;
  c.n_group = 1, c.topk_group = 1, c.norm_topk_prob = true;
  c.scoring_func = "sigmoid";
}

Status Check(const ModelConfig& c) { return CheckDeepseekMoe(c); }

Status Parse(const nlohmann::json& j, ModelConfig& c) {
  if (Status s = GetBool(j, "attention_bias", &c.attention_bias); !s.ok()) return s;
  if (Status s = GetBool(j, "use_qk_norm", &c.qk_norm); !s.ok()) return s;
  if (Status s = GetDouble(j, "partial_rotary_factor", &c.partial_rotary_factor); !s.ok()) return s;
  if (auto rp = j.find("rope_parameters"); rp != j.end() && rp->is_object())  // transformers 5 keeps it there
    if (Status s = GetDouble(*rp, "partial_rotary_factor", &c.partial_rotary_factor); !s.ok()) return s;
  if (Status s = ParseDeepseekMoe(j, c); !s.ok()) return s;
  return Check(c);
}

void Write(const ModelConfig& c, nlohmann::ordered_json& j) {
  j["attention_bias"] = c.attention_bias;
  j["use_qk_norm"] = c.qk_norm;
  j["partial_rotary_factor"] = c.partial_rotary_factor;
  WriteDeepseekMoe(c, j);
}

void LayerWeights(const ModelConfig& c, int64_t layer, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  QkNormWeightShapes(c, p, w);
  PostNormWeightShape(c, p, w);
  DeepseekMoeWeightShapes(c, layer, /*correction_bias=*/true, w);
}

Status LoadLayer(LayerLoad& l) {
  LoadAttention(l, /*o_bias=*/false);
  LoadDeepseekMoe(l, MoeRouter::kGroupedSigmoid, /*correction_bias=*/true);
  return Status::Ok();
}

// tiny: three layers, the first dense; partial RoPE 0.5, q/k/v biases and
// q/k norms (GLM-4.5's; the Air has no norms), 8 experts in 2 groups (1
// chosen), one shared; glm-4.5-air: the real shapes (46 layers; the
// checkpoint's MTP layer 46 is skipped).
Result<ModelConfig> Preset(const std::string& name, std::string* default_dtype) {
  ModelConfig c;
  c.model_type = "glm4_moe";
  c.rms_norm_eps = 1e-5;
  c.initializer_range = 0.02;
  c.tie_word_embeddings = false;
  c.attention_bias = true;
  c.partial_rotary_factor = 0.5;
  c.scoring_func = "sigmoid";
  c.norm_topk_prob = true;
  *default_dtype = "bf16";
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 3;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 16;
    c.max_position_embeddings = 2048;
    c.rope_theta = 10000.0;
    c.qk_norm = true;
    c.num_experts = 8, c.num_experts_per_tok = 2, c.moe_intermediate_size = 32;
    c.n_shared_experts = 1, c.first_k_dense_replace = 1;
    c.n_group = 2, c.topk_group = 1, c.routed_scaling_factor = 2.0;
    *default_dtype = "fp32";
  } else if (name == "glm-4.5-air") {
    c.vocab_size = 151552, c.hidden_size = 4096, c.intermediate_size = 10944, c.num_hidden_layers = 46;
    c.num_attention_heads = 96, c.num_key_value_heads = 8, c.head_dim = 128;
    c.max_position_embeddings = 131072;
    c.rope_theta = 1000000.0;
    c.qk_norm = false;
    c.num_experts = 128, c.num_experts_per_tok = 8, c.moe_intermediate_size = 1408;
    c.n_shared_experts = 1, c.first_k_dense_replace = 1;
    c.n_group = 1, c.topk_group = 1, c.routed_scaling_factor = 1.0;
    c.num_nextn_predict_layers = 1;
  } else {
    return Status::Invalid("preset '" + name + "' is not one of tiny, glm-4.5-air");
  }
  return c;
}

}  // namespace

extern const Family kGlm4MoeFamily;
const Family kGlm4MoeFamily{.model_type = "glm4_moe",
                            .architecture = "Glm4MoeForCausalLM",
                            .presets = "tiny, glm-4.5-air",
                            .o_bias = false,
                            .defaults = Defaults,
                            .parse = Parse,
                            .write = Write,
                            .check = Check,
                            .layer_weights = LayerWeights,
                            .load_layer = LoadLayer,
                            .preset = Preset};

}  // namespace loom::engine
