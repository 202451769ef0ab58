// qwen3 (transformers' modeling_qwen3): the dense Qwen layer (biases per
// attention_bias, default none; per-head RMSNorm on q and k). Also what the
// dense Qwen families share (qwen_dense.h) and qwen3's attention fields,
// which qwen3_moe reads too.
#include <nlohmann/json.hpp>

#include "engine/model/families/qwen_dense.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {

Result<ModelConfig> QwenDensePreset(const std::string& name, std::string* default_dtype, const char* model_type,
                                    bool attention_bias, bool qk_norm) {
  struct Shape {
    const char* name;
    int64_t vocab, hidden, inter, layers, heads, kv_heads, head_dim, max_positions;
    bool tied, fp32;
  };
  static constexpr Shape kShapes[] = {
      {"tiny", 512, 64, 128, 2, 4, 2, 16, 2048, true, true},
      // tiny with as many key/value heads as query heads: it splits over up to 4 tensor-parallel ranks
      {"tiny-mha", 512, 64, 128, 2, 4, 4, 16, 2048, true, true},
      {"small", 8192, 256, 704, 4, 8, 2, 32, 4096, false, true},
      {"qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, 64, 32768, true, false},
      {"qwen3-4b", 151936, 2560, 9728, 36, 32, 8, 128, 40960, true, false},
  };
  for (const Shape& s : kShapes) {
    if (name != s.name) continue;
    ModelConfig c;
    c.model_type = model_type;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 1000000.0;
    c.initializer_range = 0.02;
    c.vocab_size = s.vocab, c.hidden_size = s.hidden, c.intermediate_size = s.inter, c.num_hidden_layers = s.layers;
    c.num_attention_heads = s.heads, c.num_key_value_heads = s.kv_heads, c.head_dim = s.head_dim;
    c.max_position_embeddings = s.max_positions, c.tie_word_embeddings = s.tied;
    c.attention_bias = attention_bias, c.qk_norm = qk_norm;
    *default_dtype = s.fp32 ? "fp32" : "bf16";
    return c;
  }
  return Status::Invalid("preset '" + name + "' is not one of " + kQwenDensePresets);
}

void QwenDenseLayerWeights(const ModelConfig& c, int64_t layer, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  QkNormWeightShapes(c, p, w);
  PostNormWeightShape(c, p, w);
  DenseMlpWeightShapes(c, p, c.intermediate_size, w);
}

Status LoadQwenDenseLayer(LayerLoad& l, bool o_bias) {
  LoadAttention(l, o_bias);
  LoadDenseMlp(l);
  return Status::Ok();
}

// qwen3's attention fields, shared with qwen3_moe (families/qwen3_moe.cpp).
Status ParseQwen3Attention(const nlohmann::json& j, ModelConfig& c) {
  c.attention_bias = false;
  if (Status s = config_json::GetBool(j, "attention_bias", &c.attention_bias); !s.ok()) return s;
  c.qk_norm = true;
  return Status::Ok();
}

void WriteQwen3Attention(const ModelConfig& c, nlohmann::ordered_json& j) { j["attention_bias"] = c.attention_bias; }

namespace {

Status LoadLayer(LayerLoad& l) { return LoadQwenDenseLayer(l, /*o_bias=*/true); }

Result<ModelConfig> Preset(const std::string& name, std::string* default_dtype) {
  return QwenDensePreset(name, default_dtype, "qwen3", /*attention_bias=*/false, /*qk_norm=*/true);
}

}  // namespace

extern const Family kQwen3Family;
const Family kQwen3Family{.model_type = "qwen3",
                          .architecture = "Qwen3ForCausalLM",
                          .presets = kQwenDensePresets,
                          .yarn = true,
                          .parse = ParseQwen3Attention,
                          .write = WriteQwen3Attention,
                          .layer_weights = QwenDenseLayerWeights,
                          .load_layer = LoadLayer,
                          .preset = Preset};

}  // namespace loom::engine
