// DeepSeek-style experts, shared by the families that route that way
// (deepseek_v2, deepseek_v3, glm4_moe): dense SwiGLU MLPs in the first
// first_k_dense_replace layers, then n_routed_experts experts behind a
// grouped router (model/moe.h: kGroupedSoftmax or kGroupedSigmoid, the
// latter with the fp32 correction bias mlp.gate.e_score_correction_bias)
// and n_shared_experts shared experts of width moe_intermediate_size *
// n_shared_experts beside them (mlp.shared_experts, in the layer's dense MLP
// slots). The hub ships one tensor per expert and projection; they load stacked.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include "common/status.h"
#include "engine/model/config.h"
#include "engine/model/family.h"
#include "engine/model/moe.h"

namespace loom::engine {

// config.json's expert fields (n_routed_experts, num_experts_per_tok,
// moe_intermediate_size, n_shared_experts, first_k_dense_replace,
// routed_scaling_factor, norm_topk_prob, n_group, topk_group; null groups
// are 1), over the family's defaults; and their checks, naming the field.
Status ParseDeepseekMoe(const nlohmann::json& j, ModelConfig& c);
Status CheckDeepseekMoe(const ModelConfig& c);
// mlp_layer_types (mimo_v2_flash, glm_moe_dsa): one "dense" or "sparse" per
// layer, the dense ones into mlp_only_layers; *stated false when absent or
// null (mlp_only_layers then untouched).
Status ParseMlpLayerTypes(const nlohmann::json& j, ModelConfig& c, bool* stated);
std::vector<std::string> MlpLayerTypes(const ModelConfig& c);
void WriteDeepseekMoe(const ModelConfig& c, nlohmann::ordered_json& j);
// Layer `layer`'s MLP weights in file order: a dense SwiGLU below
// first_k_dense_replace, else the router (its correction bias when
// `correction_bias`), the experts one by one, the shared experts.
void DeepseekMoeWeightShapes(const ModelConfig& c, int64_t layer, bool correction_bias, WeightShapes& w);
// Maps them onto the layer (moe.h's MoeWeights, the shared experts into the dense MLP slots).
void LoadDeepseekMoe(LayerLoad& l, MoeRouter router, bool correction_bias);

}  // namespace loom::engine
