// What the dense Qwen families (qwen2, qwen3) share, defined in
// families/qwen3.cpp: the presets (tiny, tiny-mha, small, qwen2.5-0.5b, qwen3-4b), a
// layer's weights after the attention ones (q/k norms where qk_norm, the
// post-attention norm, a dense SwiGLU MLP), and its loader.
#pragma once
#include <string>

#include "common/status.h"
#include "engine/model/config.h"
#include "engine/model/family.h"

namespace loom::engine {

inline constexpr const char* kQwenDensePresets = "tiny, tiny-mha, small, qwen2.5-0.5b, qwen3-4b";
// The preset's shapes with the family's model_type and attention switches.
Result<ModelConfig> QwenDensePreset(const std::string& name, std::string* default_dtype, const char* model_type,
                                    bool attention_bias, bool qk_norm);
void QwenDenseLayerWeights(const ModelConfig& c, int64_t layer, WeightShapes& w);
Status LoadQwenDenseLayer(LayerLoad& l, bool o_bias);

}  // namespace loom::engine
