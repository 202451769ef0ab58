// qwen3_5_moe (Qwen3.5-35B-A3B and Qwen3.6-35B-A3B, whose text model is
// transformers' Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): a
// hybrid of Gated DeltaNet layers (model/gated_deltanet.h, "linear_attention")
// and gated full-attention layers ("full_attention": q_proj emits per head
// the query then as many gate rows, q/k RMSNorm per head, RoPE over the first
// partial_rotary_factor of each head, the output times sigmoid(gate) before
// o_proj), every layer's MLP experts (softmax top-k, always renormalised)
// plus a shared expert behind a sigmoid gate. Its RMSNorms (layers, q/k,
// final) scale by (1 + w), so 1 is added to their weights at load (kept
// fp32); the DeltaNet's output norm is a plain one. Text positions make
// HF's interleaved mRoPE plain RoPE. The hub ships the experts fused
// (mlp.experts.gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]).
// Not read: the qwen3_5_moe wrapper (text_config, model.language_model.
// prefix, vision tower, MTP layer) of the hub's checkpoints.
#include <nlohmann/json.hpp>

#include "engine/model/family.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {
namespace {

using namespace config_json;

void Defaults(ModelConfig& c) {  // Qwen3_5MoeTextConfig's
  c.rope_theta = 10000.0;
  c.partial_rotary_factor = 0.25;
  c.attn_output_gate = true;
  c.qk_norm = true;
  c.norm_topk_prob = true;
  c.linear_conv_kernel_dim = 4, c.linear_key_head_dim = 128, c.linear_value_head_dim = 128;
  c.linear_num_key_heads = 16, c.linear_num_value_heads = 32;
  c.num_experts = 256, c.num_experts_per_tok = 8, c.moe_intermediate_size = 512;
  c.shared_expert_intermediate_size = 512;
}

// HF's default layer_types: every interval-th layer full attention, the others linear.
std::vector<std::string> IntervalLayerTypes(int64_t layers, int64_t interval) {
  std::vector<std::string> t;
  for (int64_t i = 0; i < layers; ++i) t.push_back((i + 1) % interval == 0 ? "full_attention" : "linear_attention");
  return t;
}

Status Check(const ModelConfig& c) {
  if (Status s = CheckExperts(c); !s.ok()) return s;
  const auto bad = [&](const std::string& field, const std::string& why) {
    return Status::Invalid("config." + field + " " + why + " for " + c.model_type);
  };
  for (auto [field, v] : {std::pair{"linear_conv_kernel_dim", c.linear_conv_kernel_dim},
                          std::pair{"linear_key_head_dim", c.linear_key_head_dim},
                          std::pair{"linear_value_head_dim", c.linear_value_head_dim},
                          std::pair{"linear_num_key_heads", c.linear_num_key_heads},
                          std::pair{"linear_num_value_heads", c.linear_num_value_heads},
                          std::pair{"shared_expert_intermediate_size", c.shared_expert_intermediate_size}})
    if (v <= 0) return bad(field, "must be > 0");
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    return bad("linear_num_value_heads", std::to_string(c.linear_num_value_heads) +
                                             " must be a multiple of linear_num_key_heads " +
                                             std::to_string(c.linear_num_key_heads));
  if (static_cast<int64_t>(c.layer_types.size()) != c.num_hidden_layers)
    return bad("layer_types", "must have one entry a layer (" + std::to_string(c.num_hidden_layers) + ")");
  for (const std::string& t : c.layer_types)
    if (t != "linear_attention" && t != "full_attention")
      return bad("layer_types", "entries must be \"linear_attention\" or \"full_attention\", got \"" + t + "\"");
  if (!c.attn_output_gate) return bad("attn_output_gate", "must be true (HF's q_proj always emits the gate)");
  if (!c.mlp_only_layers.empty() || c.decoder_sparse_step != 1)
    return bad("mlp_only_layers", "must be empty (every layer is MoE)");
  return Status::Ok();
}

Status Parse(const nlohmann::json& j, ModelConfig& c) {
  if (Status s = GetBool(j, "attention_bias", &c.attention_bias); !s.ok()) return s;
  if (c.attention_bias) return Status::Invalid("config.json: 'attention_bias' true is not supported for " + c.model_type);
  if (Status s = GetDouble(j, "partial_rotary_factor", &c.partial_rotary_factor); !s.ok()) return s;
  if (auto rp = j.find("rope_parameters"); rp != j.end() && rp->is_object())  // transformers 5 keeps it there
    if (Status s = GetDouble(*rp, "partial_rotary_factor", &c.partial_rotary_factor); !s.ok()) return s;
  for (auto [field, dst] : {std::pair{"linear_conv_kernel_dim", &c.linear_conv_kernel_dim},
                            std::pair{"linear_key_head_dim", &c.linear_key_head_dim},
                            std::pair{"linear_value_head_dim", &c.linear_value_head_dim},
                            std::pair{"linear_num_key_heads", &c.linear_num_key_heads},
                            std::pair{"linear_num_value_heads", &c.linear_num_value_heads},
                            std::pair{"moe_intermediate_size", &c.moe_intermediate_size},
                            std::pair{"shared_expert_intermediate_size", &c.shared_expert_intermediate_size}}) {
    if (Status s = GetInt(j, field, false, dst); !s.ok()) return s;
    if (Status s = Positive(field, *dst); !s.ok()) return s;
  }
  if (Status s = ExpertCounts(j, "num_experts", &c); !s.ok()) return s;
  // HF's router always renormalises (the class has no norm_topk_prob).
  c.norm_topk_prob = true;
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null() && !(it->is_array() && it->empty()))
    return Status::Invalid("config.json: 'mlp_only_layers' must be empty for " + c.model_type + " (every layer is MoE)");
  int64_t interval = 4;
  if (Status s = GetInt(j, "full_attention_interval", false, &interval); !s.ok()) return s;
  if (Status s = Positive("full_attention_interval", interval); !s.ok()) return s;
  c.layer_types = IntervalLayerTypes(c.num_hidden_layers, interval);
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return Status::Invalid("config.json: 'layer_types' must be a list");
    c.layer_types.clear();
    for (const nlohmann::json& v : *it) {
      if (!v.is_string()) return Status::Invalid("config.json: 'layer_types' entries must be strings");
      c.layer_types.push_back(v.get<std::string>());
    }
  }
  return Check(c);
}

void Write(const ModelConfig& c, nlohmann::ordered_json& j) {
  j["attention_bias"] = c.attention_bias;
  j["attn_output_gate"] = c.attn_output_gate;
  j["layer_types"] = c.layer_types;
  j["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
  j["linear_key_head_dim"] = c.linear_key_head_dim;
  j["linear_value_head_dim"] = c.linear_value_head_dim;
  j["linear_num_key_heads"] = c.linear_num_key_heads;
  j["linear_num_value_heads"] = c.linear_num_value_heads;
  j["num_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  j["partial_rotary_factor"] = c.partial_rotary_factor;
  // transformers 5 reads rope_scaling (even null) as rope_parameters: only the
  // latter, with the mRoPE sections HF's rotary class reads (text positions:
  // plain RoPE whatever they are; these sum to half the rotary width).
  const int64_t half = c.RotaryDim() / 2;
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "default"},
                          {"rope_theta", c.rope_theta},
                          {"partial_rotary_factor", c.partial_rotary_factor},
                          {"mrope_section", {half - 2 * (half / 3), half / 3, half / 3}},
                          {"mrope_interleaved", true}};
}

void LayerWeights(const ModelConfig& c, int64_t layer, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t h = c.hidden_size;  // (input_layernorm comes first, from the shared list)
  if (c.IsLinearLayer(layer)) {
    const std::string a = p + "linear_attn.";
    const int64_t Hv = c.linear_num_value_heads, v = Hv * c.linear_value_head_dim, C = c.LinearConvDim();
    w.push_back({a + "in_proj_qkv.weight", {C, h}});
    w.push_back({a + "in_proj_z.weight", {v, h}});
    w.push_back({a + "in_proj_b.weight", {Hv, h}});
    w.push_back({a + "in_proj_a.weight", {Hv, h}});
    w.push_back({a + "conv1d.weight", {C, 1, c.linear_conv_kernel_dim}});
    w.push_back({a + "dt_bias", {Hv}});
    w.push_back({a + "A_log", {Hv}});
    w.push_back({a + "norm.weight", {c.linear_value_head_dim}});
    w.push_back({a + "out_proj.weight", {h, v}});
  } else {
    const std::string a = p + "self_attn.";
    const int64_t hd = c.head_dim, H = c.num_attention_heads, kv = c.num_key_value_heads * hd;
    w.push_back({a + "q_proj.weight", {2 * H * hd, h}});
    w.push_back({a + "k_proj.weight", {kv, h}});
    w.push_back({a + "v_proj.weight", {kv, h}});
    w.push_back({a + "o_proj.weight", {h, H * hd}});
    w.push_back({a + "q_norm.weight", {hd}});
    w.push_back({a + "k_norm.weight", {hd}});
  }
  PostNormWeightShape(c, p, w);
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, S = c.shared_expert_intermediate_size;
  w.push_back({p + "mlp.gate.weight", {E, h}});
  w.push_back({p + "mlp.experts.gate_up_proj", {E, 2 * I, h}});
  w.push_back({p + "mlp.experts.down_proj", {E, h, I}});
  w.push_back({p + "mlp.shared_expert.gate_proj.weight", {S, h}});
  w.push_back({p + "mlp.shared_expert.up_proj.weight", {S, h}});
  w.push_back({p + "mlp.shared_expert.down_proj.weight", {h, S}});
  w.push_back({p + "mlp.shared_expert_gate.weight", {1, h}});
}

Status LoadLayer(LayerLoad& l) {
  const ModelConfig& c = l.config;
  DecoderLayerWeights& d = l.layer;
  if (c.IsLinearLayer(l.index)) {
    const std::string a = l.prefix + "linear_attn.";
    GdnWeights& g = d.gdn;
    g.in_qkv_w = l.get(a + "in_proj_qkv.weight");
    g.in_z_w = l.get(a + "in_proj_z.weight");
    g.in_b_w = l.get(a + "in_proj_b.weight");
    g.in_a_w = l.get(a + "in_proj_a.weight");
    g.conv_w = l.get(a + "conv1d.weight").squeeze(1).contiguous();
    g.dt_bias = l.get(a + "dt_bias");
    g.A_log = l.get(a + "A_log");
    g.norm_w = l.get(a + "norm.weight");
    g.out_w = l.get(a + "out_proj.weight");
    g.key_heads = c.linear_num_key_heads, g.value_heads = c.linear_num_value_heads;
    g.key_dim = c.linear_key_head_dim, g.value_dim = c.linear_value_head_dim;
  } else {
    const std::string a = l.prefix + "self_attn.";
    d.qkv_w = at::cat({l.get(a + "q_proj.weight"), l.get(a + "k_proj.weight"), l.get(a + "v_proj.weight")}, 0);
    d.o_w = l.get(a + "o_proj.weight");
    d.q_norm = l.get(a + "q_norm.weight");
    d.k_norm = l.get(a + "k_norm.weight");
    d.gated_q = true;
  }
  MoeWeights& w = d.moe;
  w.router = l.get(l.prefix + "mlp.gate.weight");
  w.gate_up = l.get(l.prefix + "mlp.experts.gate_up_proj");
  w.down = l.get(l.prefix + "mlp.experts.down_proj");
  w.top_k = c.num_experts_per_tok;
  w.norm_topk = true;
  const std::string s = l.prefix + "mlp.shared_expert.";
  d.gate_up_w = at::cat({l.get(s + "gate_proj.weight"), l.get(s + "up_proj.weight")}, 0);
  d.down_w = l.get(s + "down_proj.weight");
  d.shared_gate = l.get(l.prefix + "mlp.shared_expert_gate.weight");
  d.shared_target = kTargetSharedExpertGate;
  return Status::Ok();
}

// tiny: four layers (three Gated DeltaNet, then full attention, HF's
// interval), 4/2 heads of 16 with RoPE over 4 dims, DeltaNet 2 key heads and
// 4 value heads of 8 with a 4-tap conv, 8 experts top-2 of width 32 and a
// shared expert of 32; qwen3.5-35b-a3b: the real shapes (Qwen3.6-35B-A3B's too).
Result<ModelConfig> Preset(const std::string& name, std::string* default_dtype) {
  ModelConfig c;
  c.model_type = "qwen3_5_moe_text";
  Defaults(c);
  c.rms_norm_eps = 1e-6;
  c.initializer_range = 0.02;
  c.tie_word_embeddings = false;
  c.attention_bias = false;
  *default_dtype = "bf16";
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 4;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 16;
    c.max_position_embeddings = 2048;
    c.linear_key_head_dim = 8, c.linear_value_head_dim = 8, c.linear_num_key_heads = 2, c.linear_num_value_heads = 4;
    c.num_experts = 8, c.num_experts_per_tok = 2, c.moe_intermediate_size = 32;
    c.shared_expert_intermediate_size = 32;
    *default_dtype = "fp32";
  } else if (name == "qwen3.5-35b-a3b") {
    c.vocab_size = 248320, c.hidden_size = 2048, c.intermediate_size = 512, c.num_hidden_layers = 40;
    c.num_attention_heads = 16, c.num_key_value_heads = 2, c.head_dim = 256;
    c.max_position_embeddings = 262144;
    c.rope_theta = 10000000.0;
  } else {
    return Status::Invalid("preset '" + name + "' is not one of tiny, qwen3.5-35b-a3b");
  }
  c.layer_types = IntervalLayerTypes(c.num_hidden_layers, 4);
  return c;
}

}  // namespace

extern const Family kQwen35MoeFamily;
const Family kQwen35MoeFamily{.model_type = "qwen3_5_moe_text",
                              .architecture = "Qwen3_5MoeForCausalLM",
                              .presets = "tiny, qwen3.5-35b-a3b",
                              .norms_fp32 = true,
                              .own_attention = true,
                              .norm_offset = true,
                              .defaults = Defaults,
                              .parse = Parse,
                              .write = Write,
                              .check = Check,
                              .layer_weights = LayerWeights,
                              .load_layer = LoadLayer,
                              .preset = Preset};

}  // namespace loom::engine
