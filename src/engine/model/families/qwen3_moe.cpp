// qwen3_moe (Qwen3-30B-A3B, transformers' modeling_qwen3_moe): qwen3's
// attention, and on the layers IsMoeLayer picks (decoder_sparse_step,
// mlp_only_layers) experts (model/moe: a softmax top-k router, renormalised
// when norm_topk_prob, SwiGLU experts), a dense SwiGLU MLP on the others.
// The hub ships one tensor per expert and projection; they load stacked.
#include <nlohmann/json.hpp>

#include "engine/model/families/qwen_dense.h"
#include "engine/model/family.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {

// qwen3's attention fields (families/qwen3.cpp).
Status ParseQwen3Attention(const nlohmann::json& j, ModelConfig& c);
void WriteQwen3Attention(const ModelConfig& c, nlohmann::ordered_json& j);

namespace {

using namespace config_json;

// The expert fields. HF aliases num_experts as num_local_experts;
// norm_topk_prob defaults to false as in HF's class (Qwen3-30B-A3B states true).
Status Parse(const nlohmann::json& j, ModelConfig& c) {
  if (Status s = ParseQwen3Attention(j, c); !s.ok()) return s;
  if (Status s = ExpertCounts(j, "num_experts", &c); !s.ok()) return s;
  if (Status s = GetInt(j, "moe_intermediate_size", true, &c.moe_intermediate_size); !s.ok()) return s;
  if (Status s = Positive("moe_intermediate_size", c.moe_intermediate_size); !s.ok()) return s;
  if (Status s = GetBool(j, "norm_topk_prob", &c.norm_topk_prob); !s.ok()) return s;
  if (Status s = GetInt(j, "decoder_sparse_step", false, &c.decoder_sparse_step); !s.ok()) return s;
  if (Status s = Positive("decoder_sparse_step", c.decoder_sparse_step); !s.ok()) return s;
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return Status::Invalid("config.json: 'mlp_only_layers' must be a list of layer indices");
    for (const nlohmann::json& v : *it) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_hidden_layers)
        return Status::Invalid("config.json: 'mlp_only_layers' entries must be layer indices in [0, " +
                               std::to_string(c.num_hidden_layers) + ")");
      c.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  return Status::Ok();
}

void Write(const ModelConfig& c, nlohmann::ordered_json& j) {
  WriteQwen3Attention(c, j);
  j["num_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["decoder_sparse_step"] = c.decoder_sparse_step;
  j["mlp_only_layers"] = c.mlp_only_layers;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.001;
}

void LayerWeights(const ModelConfig& c, int64_t layer, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  if (!c.IsMoeLayer(layer)) return QwenDenseLayerWeights(c, layer, w);
  QkNormWeightShapes(c, p, w);
  PostNormWeightShape(c, p, w);
  const int64_t h = c.hidden_size, inter = c.moe_intermediate_size;
  w.push_back({p + "mlp.gate.weight", {c.num_experts, h}});
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
    w.push_back({x + "gate_proj.weight", {inter, h}});
    w.push_back({x + "up_proj.weight", {inter, h}});
    w.push_back({x + "down_proj.weight", {h, inter}});
  }
}

Status LoadLayer(LayerLoad& l) {
  if (!l.config.IsMoeLayer(l.index)) return LoadQwenDenseLayer(l, /*o_bias=*/true);
  LoadAttention(l, /*o_bias=*/true);
  // Experts stacked as HF's fused parameters: gate_up [E, 2I, H] (gate rows
  // first), down [E, H, I].
  MoeWeights& w = l.layer.moe;
  w.router = l.get(l.prefix + "mlp.gate.weight");
  LoadHubExperts(l);
  w.top_k = l.config.num_experts_per_tok;
  w.norm_topk = l.config.norm_topk_prob;
  return Status::Ok();
}

// tiny: two MoE layers of 8 experts of width 32, top-2, renormalised (as
// Qwen3-30B-A3B, which has no dense layers either); small: the widths the
// CUDA decode kernels take (head_dim 32, as qwen3's small), 32 experts top-4
// on three of four layers (layer 1 dense: mlp_only_layers); qwen3-30b-a3b:
// the real shapes.
Result<ModelConfig> Preset(const std::string& name, std::string* default_dtype) {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.initializer_range = 0.02;
  c.attention_bias = false;
  c.qk_norm = true;
  c.norm_topk_prob = true;
  c.tie_word_embeddings = false;
  *default_dtype = "bf16";
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 2;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 16;
    c.max_position_embeddings = 2048;
    c.num_experts = 8, c.num_experts_per_tok = 2, c.moe_intermediate_size = 32;
    *default_dtype = "fp32";
  } else if (name == "small") {
    c.vocab_size = 8192, c.hidden_size = 256, c.intermediate_size = 512, c.num_hidden_layers = 4;
    c.num_attention_heads = 8, c.num_key_value_heads = 2, c.head_dim = 32;
    c.max_position_embeddings = 4096;
    c.num_experts = 32, c.num_experts_per_tok = 4, c.moe_intermediate_size = 64;
    c.mlp_only_layers = {1};
    *default_dtype = "fp32";
  } else if (name == "qwen3-30b-a3b") {
    c.vocab_size = 151936, c.hidden_size = 2048, c.intermediate_size = 6144, c.num_hidden_layers = 48;
    c.num_attention_heads = 32, c.num_key_value_heads = 4, c.head_dim = 128;
    c.max_position_embeddings = 40960;
    c.num_experts = 128, c.num_experts_per_tok = 8, c.moe_intermediate_size = 768;
  } else {
    return Status::Invalid("preset '" + name + "' is not one of tiny, small, qwen3-30b-a3b");
  }
  return c;
}

}  // namespace

extern const Family kQwen3MoeFamily;
const Family kQwen3MoeFamily{.model_type = "qwen3_moe",
                             .architecture = "Qwen3MoeForCausalLM",
                             .presets = "tiny, small, qwen3-30b-a3b",
                             .yarn = true,
                             .parse = Parse,
                             .write = Write,
                             .check = CheckExperts,
                             .layer_weights = LayerWeights,
                             .load_layer = LoadLayer,
                             .preset = Preset};

}  // namespace loom::engine
