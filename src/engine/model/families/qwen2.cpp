// qwen2 (Qwen2.5, transformers' modeling_qwen2): the dense Qwen layer
// (qwen_dense.h) with q/k/v biases, no o bias and no q/k norms.
#include <nlohmann/json.hpp>

#include "engine/model/families/qwen_dense.h"

namespace loom::engine {
namespace {

Status Parse(const nlohmann::json&, ModelConfig& c) {
  c.attention_bias = true;  // Qwen2's q/k/v projections always carry a bias
  c.qk_norm = false;
  return Status::Ok();
}

Status LoadLayer(LayerLoad& l) { return LoadQwenDenseLayer(l, /*o_bias=*/false); }

Result<ModelConfig> Preset(const std::string& name, std::string* default_dtype) {
  return QwenDensePreset(name, default_dtype, "qwen2", /*attention_bias=*/true, /*qk_norm=*/false);
}

}  // namespace

extern const Family kQwen2Family;
const Family kQwen2Family{.model_type = "qwen2",
                          .architecture = "Qwen2ForCausalLM",
                          .presets = kQwenDensePresets,
                          .yarn = true,
                          .o_bias = false,
                          .parse = Parse,
                          .layer_weights = QwenDenseLayerWeights,
                          .load_layer = LoadLayer,
                          .preset = Preset};

}  // namespace loom::engine
