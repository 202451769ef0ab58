// mimo_v2_flash (MiMo-V2-Flash, transformers' modeling_mimo_v2_flash; the
// port MiMo-V2.6-Flash's checkpoints are converted to): hybrid attention:
// full-attention layers with num_key_value_heads heads, sliding-window
// layers (layer_types) with twice as many key/value heads and per-head sinks
// (gpt_oss's AttentionVariant; the hub names them attention_sink_bias);
// q/k heads of head_dim, values of v_head_dim scaled by
// attention_value_scale; RoPE over the first head_dim * partial_rotary_factor
// dims with each layer type's own theta (rope_parameters per type); q/k/v
// biases when attention_bias, none on o. The MLP is dense on the layers
// mlp_layer_types marks "dense", else DeepSeek-style experts (deepseek_moe.h)
// with deepseek_v3's router and no shared experts. Its checkpoints' MTP
// weights (model.mtp.*) are not read.
#include <nlohmann/json.hpp>

#include "engine/model/families/deepseek_moe.h"
#include "engine/model/family.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {
namespace {

using namespace config_json;

// HF's default layer pattern: full attention on the first layer and every sixth.
std::vector<std::string> DefaultLayerTypes(int64_t layers) {
  std::vector<std::string> t;
  for (int64_t i = 0; i < layers; ++i)
    t.push_back(i == 0 || (i + 1) % 6 == 0 ? "full_attention" : "sliding_attention");
  return t;
}

void Defaults(ModelConfig& c) {  // MiMoV2FlashConfig's
  c.head_dim = 192, c.v_head_dim = 128, c.sliding_window = 128, c.attention_value_scale = 0.707;
  c.rope_theta = 5000000.0, c.rope_theta_sliding = 10000.0, c.partial_rotary_factor = 0.334;
  c.num_experts = 256, c.num_experts_per_tok = 8, c.moe_intermediate_size = 2048;
  c.n_group = 1, c.topk_group = 1, c.norm_topk_prob = true, c.routed_scaling_factor = 1.0;
  c.scoring_func = "sigmoid";
}

Status Check(const ModelConfig& c) {
  if (Status s = CheckDeepseekMoe(c); !s.ok()) return s;
  const auto bad = [&](const std::string& field, const std::string& why) {
    return Status::Invalid("config." + field + " " + why + " for mimo_v2_flash");
  };
  if (static_cast<int64_t>(c.layer_types.size()) != c.num_hidden_layers)
    return bad("layer_types", "must name every layer's attention");
  if (c.sliding_window <= 0) return bad("sliding_window", "must be > 0");
  if (c.v_head_dim <= 0) return bad("v_head_dim", "must be > 0");
  if (c.sliding_key_value_heads <= 0 || c.num_attention_heads % c.sliding_key_value_heads != 0)
    return bad("num_key_value_heads", "times 2 (the sliding layers' heads) must divide num_attention_heads");
  if (!(c.rope_theta_sliding > 0)) return bad("rope_parameters.sliding_attention.rope_theta", "must be > 0");
  return Status::Ok();
}

// One layer type's rope_parameters: default RoPE only, its theta, and the
// partial factor (the same for both types).
Status ParseTypeRope(const nlohmann::json& rp, const char* type, double* theta, double* partial) {
  auto it = rp.find(type);
  if (it == rp.end() || it->is_null()) return Status::Ok();
  const std::string f = std::string("rope_parameters.") + type;
  if (!it->is_object()) return Status::Invalid("config.json: '" + f + "' must be an object");
  for (const auto& [key, value] : it->items()) {
    if (key == "rope_type") {
      if (value != "default") return Status::Invalid("config.json: '" + f + ".rope_type' " + value.dump() +
                                                      " is not supported (default)");
    } else if (key == "rope_theta" || key == "partial_rotary_factor") {
      if (!value.is_number()) return Status::Invalid("config.json: '" + f + "." + key + "' must be a number");
      *(key == "rope_theta" ? theta : partial) = value.get<double>();
    } else {
      return Status::Invalid("config.json: '" + f + "." + key + "' is not supported");
    }
  }
  return Status::Ok();
}

Status Parse(const nlohmann::json& j, ModelConfig& c) {
  if (Status s = GetBool(j, "attention_bias", &c.attention_bias); !s.ok()) return s;
  if (Status s = GetInt(j, "v_head_dim", false, &c.v_head_dim); !s.ok()) return s;
  if (Status s = GetInt(j, "sliding_window", false, &c.sliding_window); !s.ok()) return s;
  if (Status s = GetDouble(j, "attention_value_scale", &c.attention_value_scale); !s.ok()) return s;
  if (Status s = LayerTypes(j, DefaultLayerTypes(c.num_hidden_layers), &c); !s.ok()) return s;
  c.sliding_key_value_heads = 2 * c.num_key_value_heads;  // HF's: twice the full layers'
  if (auto rp = j.find("rope_parameters"); rp != j.end() && rp->is_object()) {
    double partial_full = c.partial_rotary_factor, partial_sliding = c.partial_rotary_factor;
    if (Status s = ParseTypeRope(*rp, "full_attention", &c.rope_theta, &partial_full); !s.ok()) return s;
    if (Status s = ParseTypeRope(*rp, "sliding_attention", &c.rope_theta_sliding, &partial_sliding); !s.ok()) return s;
    if (partial_full != partial_sliding)
      return Status::Invalid("config.json: 'rope_parameters' with a partial_rotary_factor per layer type is not "
                             "supported (one for both)");
    c.partial_rotary_factor = partial_full;
  }
  if (Status s = ParseDeepseekMoe(j, c); !s.ok()) return s;
  c.n_shared_experts = 0, c.first_k_dense_replace = 0;  // fields HF's class drops
  bool stated = false;
  if (Status s = ParseMlpLayerTypes(j, c, &stated); !s.ok()) return s;
  if (!stated) c.mlp_only_layers = {0};  // HF's default: the first layer dense
  return Check(c);
}

void Write(const ModelConfig& c, nlohmann::ordered_json& j) {
  j["attention_bias"] = c.attention_bias;
  j["v_head_dim"] = c.v_head_dim;
  j["sliding_window"] = c.sliding_window;
  j["layer_types"] = c.layer_types;
  j["attention_value_scale"] = c.attention_value_scale;
  const auto rope = [&](double theta) {
    return nlohmann::ordered_json{{"rope_type", "default"}, {"rope_theta", theta},
                                  {"partial_rotary_factor", c.partial_rotary_factor}};
  };
  j["rope_parameters"] = {{"full_attention", rope(c.rope_theta)}, {"sliding_attention", rope(c.rope_theta_sliding)}};
  // transformers 5 reads a rope_scaling key (even null) as rope_parameters, over
  // the per-type dict: HF's MiMo config then had none (its rotary init failed).
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["mlp_layer_types"] = MlpLayerTypes(c);
  WriteDeepseekMoe(c, j);
  for (const char* dropped : {"n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"})
    j.erase(dropped);  // fields HF's class drops (mlp_layer_types says which layers are dense)
}

void LayerWeights(const ModelConfig& c, int64_t layer, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  if (c.IsSlidingLayer(layer)) w.push_back({p + "self_attn.attention_sink_bias", {c.num_attention_heads}});
  PostNormWeightShape(c, p, w);
  DeepseekMoeWeightShapes(c, layer, /*correction_bias=*/true, w);
}

Status LoadLayer(LayerLoad& l) {
  LoadAttention(l, /*o_bias=*/false);
  if (l.config.IsSlidingLayer(l.index)) {
    l.layer.attn.sinks = l.get(l.prefix + "self_attn.attention_sink_bias");
    l.layer.attn.window = l.config.sliding_window;
  }
  LoadDeepseekMoe(l, MoeRouter::kGroupedSigmoid, /*correction_bias=*/true);
  return Status::Ok();
}

// tiny: four layers (full, then three sliding with a window of 4), 1 / 2
// key/value heads, q/k heads of 24 and values of 16, partial RoPE over 8
// dims with thetas 5e6 / 1e4, the first layer dense, then 8 experts top-2;
// mimo-v2-flash: the real shapes.
Result<ModelConfig> Preset(const std::string& name, std::string* default_dtype) {
  ModelConfig c;
  c.model_type = "mimo_v2_flash";
  Defaults(c);
  c.rms_norm_eps = 1e-5;
  c.initializer_range = 0.02;
  c.tie_word_embeddings = false;
  c.attention_bias = false;
  *default_dtype = "bf16";
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 4;
    c.num_attention_heads = 4, c.num_key_value_heads = 1, c.head_dim = 24, c.v_head_dim = 16;
    c.sliding_window = 4;
    c.max_position_embeddings = 2048;
    c.num_experts = 8, c.num_experts_per_tok = 2, c.moe_intermediate_size = 32;
    *default_dtype = "fp32";
  } else if (name == "mimo-v2-flash") {
    c.vocab_size = 152576, c.hidden_size = 4096, c.intermediate_size = 16384, c.num_hidden_layers = 48;
    c.num_attention_heads = 64, c.num_key_value_heads = 4;
    c.max_position_embeddings = 262144;
  } else {
    return Status::Invalid("preset '" + name + "' is not one of tiny, mimo-v2-flash");
  }
  c.layer_types = DefaultLayerTypes(c.num_hidden_layers);
  c.sliding_key_value_heads = 2 * c.num_key_value_heads;
  c.mlp_only_layers = {0};
  return c;
}

}  // namespace

extern const Family kMimoV2FlashFamily;
const Family kMimoV2FlashFamily{.model_type = "mimo_v2_flash",
                                .architecture = "MiMoV2FlashForCausalLM",
                                .presets = "tiny, mimo-v2-flash",
                                .o_bias = false,
                                .writes_sliding = true,
                                .defaults = Defaults,
                                .parse = Parse,
                                .write = Write,
                                .check = Check,
                                .layer_weights = LayerWeights,
                                .load_layer = LoadLayer,
                                .preset = Preset};

}  // namespace loom::engine
