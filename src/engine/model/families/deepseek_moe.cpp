#include "engine/model/families/deepseek_moe.h"

#include <nlohmann/json.hpp>

#include "engine/model/transformer_impl.h"

namespace loom::engine {

using namespace config_json;

namespace {

// An optional positive integer that may be null (HF: None, taken as null_value).
Status GetOptionalPositive(const nlohmann::json& j, const char* field, int64_t null_value, int64_t* out) {
  if (auto it = j.find(field); it != j.end() && it->is_null()) {
    *out = null_value;
    return Status::Ok();
  }
  if (Status s = GetInt(j, field, false, out); !s.ok()) return s;
  if (*out < 0 || (*out == 0 && null_value != 0)) return Positive(field, *out);
  return Status::Ok();
}

}  // namespace

Status ParseDeepseekMoe(const nlohmann::json& j, ModelConfig& c) {
  for (auto [field, dst] : {std::pair{"moe_intermediate_size", &c.moe_intermediate_size},
                            std::pair{"n_routed_experts", &c.num_experts},
                            std::pair{"num_experts_per_tok", &c.num_experts_per_tok}}) {
    if (Status s = GetInt(j, field, false, dst); !s.ok()) return s;
    if (Status s = Positive(field, *dst); !s.ok()) return s;
  }
  if (Status s = GetOptionalPositive(j, "n_shared_experts", 0, &c.n_shared_experts); !s.ok()) return s;
  if (Status s = GetInt(j, "first_k_dense_replace", false, &c.first_k_dense_replace); !s.ok()) return s;
  if (Status s = GetDouble(j, "routed_scaling_factor", &c.routed_scaling_factor); !s.ok()) return s;
  if (Status s = GetBool(j, "norm_topk_prob", &c.norm_topk_prob); !s.ok()) return s;
  if (Status s = GetOptionalPositive(j, "n_group", 1, &c.n_group); !s.ok()) return s;
  if (Status s = GetOptionalPositive(j, "topk_group", 1, &c.topk_group); !s.ok()) return s;
  int64_t freq = 1;
  if (Status s = GetInt(j, "moe_layer_freq", false, &freq); !s.ok()) return s;
  if (freq != 1) return Status::Invalid("config.json: 'moe_layer_freq' " + std::to_string(freq) + " is not supported (1)");
  if (Status s = GetInt(j, "num_nextn_predict_layers", false, &c.num_nextn_predict_layers); !s.ok()) return s;
  if (c.num_nextn_predict_layers < 0) return Positive("num_nextn_predict_layers", c.num_nextn_predict_layers);
  return Status::Ok();
}

Status ParseMlpLayerTypes(const nlohmann::json& j, ModelConfig& c, bool* stated) {
  const auto it = j.find("mlp_layer_types");
  *stated = it != j.end() && !it->is_null();
  if (!*stated) return Status::Ok();
  if (!it->is_array() || static_cast<int64_t>(it->size()) != c.num_hidden_layers)
    return Status::Invalid("config.json: 'mlp_layer_types' must be a list of " + std::to_string(c.num_hidden_layers) +
                           " entries");
  c.mlp_only_layers.clear();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const nlohmann::json& v = (*it)[i];
    if (v != "dense" && v != "sparse")
      return Status::Invalid("config.json: 'mlp_layer_types' entries must be \"dense\" or \"sparse\", got " + v.dump());
    if (v == "dense") c.mlp_only_layers.push_back(i);
  }
  return Status::Ok();
}

std::vector<std::string> MlpLayerTypes(const ModelConfig& c) {
  std::vector<std::string> types;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) types.push_back(c.IsMoeLayer(i) ? "sparse" : "dense");
  return types;
}

Status CheckDeepseekMoe(const ModelConfig& c) {
  if (Status s = CheckExperts(c); !s.ok()) return s;
  const auto bad = [&](const std::string& field, const std::string& why) {
    return Status::Invalid("config." + field + " " + why + " for " + c.model_type);
  };
  if (c.n_shared_experts < 0) return bad("n_shared_experts", "must be >= 0");
  if (c.first_k_dense_replace < 0) return bad("first_k_dense_replace", "must be >= 0");
  if (!(c.routed_scaling_factor > 0)) return bad("routed_scaling_factor", "must be > 0");
  if (c.n_group <= 0 || c.num_experts % c.n_group != 0)
    return bad("n_group", std::to_string(c.n_group) + " must divide n_routed_experts " + std::to_string(c.num_experts));
  if (c.topk_group <= 0 || c.topk_group > c.n_group) return bad("topk_group", "must be in [1, n_group]");
  if (c.num_experts_per_tok > c.topk_group * (c.num_experts / c.n_group))
    return bad("num_experts_per_tok", "must be at most the experts of topk_group groups");
  if (c.scoring_func == "sigmoid" && c.n_group > 1 && c.num_experts / c.n_group < 2)
    return bad("n_group", "must leave at least two experts a group (groups rank by their two best)");
  return Status::Ok();
}

void WriteDeepseekMoe(const ModelConfig& c, nlohmann::ordered_json& j) {
  j["n_routed_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["n_shared_experts"] = c.n_shared_experts > 0 ? nlohmann::ordered_json(c.n_shared_experts) : nlohmann::ordered_json();
  j["first_k_dense_replace"] = c.first_k_dense_replace;
  j["routed_scaling_factor"] = c.routed_scaling_factor;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["n_group"] = c.n_group;
  j["topk_group"] = c.topk_group;
  j["num_nextn_predict_layers"] = c.num_nextn_predict_layers;
}

void DeepseekMoeWeightShapes(const ModelConfig& c, int64_t layer, bool correction_bias, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  if (!c.IsMoeLayer(layer)) return DenseMlpWeightShapes(c, p, c.intermediate_size, w);
  const int64_t h = c.hidden_size, inter = c.moe_intermediate_size;
  w.push_back({p + "mlp.gate.weight", {c.num_experts, h}});
  if (correction_bias) w.push_back({p + "mlp.gate.e_score_correction_bias", {c.num_experts}});
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
    w.push_back({x + "gate_proj.weight", {inter, h}});
    w.push_back({x + "up_proj.weight", {inter, h}});
    w.push_back({x + "down_proj.weight", {h, inter}});
  }
  if (c.n_shared_experts > 0) {  // DenseMlpWeightShapes' three, under mlp.shared_experts
    const std::string s = p + "mlp.shared_experts.";
    const int64_t width = inter * c.n_shared_experts;
    w.push_back({s + "gate_proj.weight", {width, h}});
    w.push_back({s + "up_proj.weight", {width, h}});
    w.push_back({s + "down_proj.weight", {h, width}});
  }
}

void LoadDeepseekMoe(LayerLoad& l, MoeRouter router, bool correction_bias) {
  const ModelConfig& c = l.config;
  if (!c.IsMoeLayer(l.index)) return LoadDenseMlp(l);
  MoeWeights& w = l.layer.moe;
  w.router = l.get(l.prefix + "mlp.gate.weight");
  if (correction_bias) w.score_bias = l.get(l.prefix + "mlp.gate.e_score_correction_bias");
  LoadHubExperts(l);
  w.top_k = c.num_experts_per_tok;
  w.norm_topk = c.norm_topk_prob;
  w.router_kind = router;
  w.groups = c.n_group, w.topk_groups = c.topk_group;
  w.routed_scale = c.routed_scaling_factor;
  if (c.n_shared_experts > 0) {
    const std::string s = l.prefix + "mlp.shared_experts.";
    l.layer.gate_up_w = at::cat({l.get(s + "gate_proj.weight"), l.get(s + "up_proj.weight")}, 0);
    l.layer.down_w = l.get(s + "down_proj.weight");
  }
}

}  // namespace loom::engine
