// family: a model family (one Hugging Face model_type) as one object, each
// defined in its own file under model/families/ over the shared blocks
// (attention and its variants in model/attention, the dense SwiGLU MLP,
// the experts in model/moe, lean_ops' norms, model/rope). A family says:
// its config.json fields (read, checked, written), its base weights (names
// and shapes in file order, and how one decoder layer's tensors map onto
// the shared blocks), a few switches of the shared code, and the presets
// make-model builds. docs/architecture.md, "Adding a model family", says how
// to add one.
//
// Torch-free (the layer loader takes an opaque LayerLoad, defined with the
// blocks in model/transformer_impl.h). The families are constants; any thread.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "engine/model/config.h"

namespace loom::engine {

using WeightShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

struct LayerLoad;  // one decoder layer's tensors being mapped (model/transformer_impl.h)

struct Family {
  const char* model_type;    // config.json's model_type
  const char* architecture;  // config.json's architectures[0]
  const char* presets;       // make-model presets, listed for messages ("tiny, ..."; tiny fits CPU tests)
  // Switches of the shared code.
  bool yarn = false;                 // may state YaRN rope_scaling (else only default RoPE)
  bool checks_hidden_act = true;     // hidden_act must be silu (gpt_oss's activation is its own)
  bool norms_fp32 = false;           // RMSNorm weights kept fp32 in any dtype (HF's _keep_in_fp32_modules)
  bool mxfp4_experts = false;        // expert params may ship as MXFP4 _blocks and _scales
  bool interleaved_gate_up = false;  // the experts' gate/up columns interleave (so do PEFT's lora_B rows)
  bool experts_in_out = false;       // fused expert params stored [E, in, out] (gpt_oss); else [E, out, in] where fused
  bool o_bias = true;                // o_proj has a bias when attention_bias does (qwen2: never)
  bool writes_sliding = false;       // writes sliding_window itself (else use_sliding_window false, nulls)
  bool mla = false;                  // multi-head latent attention: layer_weights lists the attention too (mla.h)
  bool own_attention = false;        // layer_weights lists the attention too (qwen3_5_moe's two kinds of layer)
  bool norm_offset = false;          // RMSNorms scale by (1 + w): 1 is added to their weights at load
  // Config: defaults set before config.json is read (RoPE and the like);
  // its own fields read after the shared ones (Invalid naming the field);
  // its own fields written (after attention_bias's place); the checks of a
  // config built in code (Transformer::FromTensors). defaults, write and
  // check may be null (none).
  void (*defaults)(ModelConfig& c);
  Status (*parse)(const nlohmann::json& j, ModelConfig& c);
  void (*write)(const ModelConfig& c, nlohmann::ordered_json& j);
  Status (*check)(const ModelConfig& c);
  // Weights: layer `layer`'s tensors after the shared attention ones
  // (AttentionWeightShapes), in file order (make-model draws them in this
  // order); and the mapping of a loaded layer onto the blocks.
  void (*layer_weights)(const ModelConfig& c, int64_t layer, WeightShapes& w);
  Status (*load_layer)(LayerLoad& l);
  // make-model: the preset's config and its default dtype ("fp32" or "bf16").
  Result<ModelConfig> (*preset)(const std::string& name, std::string* default_dtype);
};

// The family of model_type, or null.
const Family* FindFamily(const std::string& model_type);
// "qwen2, qwen3, qwen3_moe, gpt_oss, ...": the supported model_types, for messages.
std::string FamilyNames();
// "qwen2: tiny, small, ...; qwen3: ...": each model_type's make-model presets.
std::string FamilyPresets();

// gpt_oss's default layer_types (HF's): sliding on even layers, full on odd
// ones (families/gpt_oss.cpp).
std::vector<std::string> AlternatingLayerTypes(int64_t layers);

// The shared blocks' weights, in file order: layer `layer`'s input norm,
// q/k/v (with their biases when attention_bias; k and v of the layer's
// key/value heads, v of ValueDim()), o (with its bias when o_bias); the
// post-attention norm; a dense SwiGLU MLP of width `inter`.
void AttentionWeightShapes(const ModelConfig& c, int64_t layer, bool o_bias, WeightShapes& w);
void QkNormWeightShapes(const ModelConfig& c, const std::string& prefix, WeightShapes& w);
void PostNormWeightShape(const ModelConfig& c, const std::string& prefix, WeightShapes& w);
void DenseMlpWeightShapes(const ModelConfig& c, const std::string& prefix, int64_t inter, WeightShapes& w);

// The expert counts' checks of a config built in code (MoE families).
Status CheckExperts(const ModelConfig& c);

// config.json readers for the families' parse: absent or null leaves *out;
// a wrong type is Invalid naming the field.
namespace config_json {
Status GetInt(const nlohmann::json& j, const char* field, bool required, int64_t* out);
Status GetDouble(const nlohmann::json& j, const char* field, double* out);
Status GetBool(const nlohmann::json& j, const char* field, bool* out);
Status Positive(const char* field, int64_t v);
// num_experts (or its alias num_local_experts, named `count_field` in
// messages) and num_experts_per_tok: both positive, k <= E.
Status ExpertCounts(const nlohmann::json& j, const char* count_field, ModelConfig* c);
// layer_types: one "sliding_attention" or "full_attention" per layer, or
// absent/null for `defaults` (AlternatingLayerTypes and the like).
Status LayerTypes(const nlohmann::json& j, std::vector<std::string> defaults, ModelConfig* c);
}  // namespace config_json

}  // namespace loom::engine
