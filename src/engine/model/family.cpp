#include "engine/model/family.h"

#include <nlohmann/json.hpp>

namespace loom::engine {

// The families (model/families/*.cpp).
extern const Family kQwen2Family;
extern const Family kQwen3Family;
extern const Family kQwen3MoeFamily;
extern const Family kGptOssFamily;
extern const Family kDeepseekV2Family;
extern const Family kDeepseekV3Family;
extern const Family kGlm4MoeFamily;
extern const Family kMimoV2FlashFamily;
extern const Family kGlmMoeDsaFamily;
extern const Family kQwen35MoeFamily;

namespace {
const Family* const kFamilies[] = {&kQwen2Family,       &kQwen3Family,      &kQwen3MoeFamily,
                                   &kGptOssFamily,      &kDeepseekV2Family, &kDeepseekV3Family,
                                   &kGlm4MoeFamily,     &kMimoV2FlashFamily, &kGlmMoeDsaFamily,
                                   &kQwen35MoeFamily};
}  // namespace

const Family* FindFamily(const std::string& model_type) {
  for (const Family* f : kFamilies)
    if (model_type == f->model_type) return f;
  return nullptr;
}

std::string FamilyNames() {
  std::string s;
  for (const Family* f : kFamilies) s += (s.empty() ? "" : ", ") + std::string(f->model_type);
  return s;
}

std::string FamilyPresets() {
  std::string s;
  for (const Family* f : kFamilies) s += (s.empty() ? "" : "; ") + std::string(f->model_type) + ": " + f->presets;
  return s;
}

void AttentionWeightShapes(const ModelConfig& c, int64_t layer, bool o_bias, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t h = c.hidden_size, hd = c.head_dim > 0 ? c.head_dim : c.hidden_size / c.num_attention_heads;
  const int64_t q = c.num_attention_heads * hd, k = c.KvHeads(layer) * hd, v = c.KvHeads(layer) * c.ValueDim();
  w.push_back({p + "input_layernorm.weight", {h}});
  for (auto [name, rows] : {std::pair{"q_proj", q}, std::pair{"k_proj", k}, std::pair{"v_proj", v}}) {
    w.push_back({p + "self_attn." + name + ".weight", {rows, h}});
    if (c.attention_bias) w.push_back({p + "self_attn." + name + ".bias", {rows}});
  }
  w.push_back({p + "self_attn.o_proj.weight", {h, c.num_attention_heads * c.ValueDim()}});
  if (c.attention_bias && o_bias) w.push_back({p + "self_attn.o_proj.bias", {h}});
}

void QkNormWeightShapes(const ModelConfig& c, const std::string& p, WeightShapes& w) {
  if (!c.qk_norm) return;
  const int64_t hd = c.head_dim > 0 ? c.head_dim : c.hidden_size / c.num_attention_heads;
  w.push_back({p + "self_attn.q_norm.weight", {hd}});
  w.push_back({p + "self_attn.k_norm.weight", {hd}});
}

void PostNormWeightShape(const ModelConfig& c, const std::string& p, WeightShapes& w) {
  w.push_back({p + "post_attention_layernorm.weight", {c.hidden_size}});
}

void DenseMlpWeightShapes(const ModelConfig& c, const std::string& p, int64_t inter, WeightShapes& w) {
  w.push_back({p + "mlp.gate_proj.weight", {inter, c.hidden_size}});
  w.push_back({p + "mlp.up_proj.weight", {inter, c.hidden_size}});
  w.push_back({p + "mlp.down_proj.weight", {c.hidden_size, inter}});
}

Status CheckExperts(const ModelConfig& c) {
  if (c.num_experts <= 0 || c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.num_experts ||
      c.moe_intermediate_size <= 0 || c.decoder_sparse_step <= 0)
    return Status::Invalid("config.num_experts and num_experts_per_tok (<= num_experts), moe_intermediate_size and "
                           "decoder_sparse_step must be > 0 for " + c.model_type);
  return Status::Ok();
}

namespace config_json {

using json = nlohmann::json;

Status GetInt(const json& j, const char* field, bool required, int64_t* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required) return Status::Invalid(std::string("config.json: missing required field '") + field + "'");
    return Status::Ok();
  }
  if (!it->is_number_integer()) return Status::Invalid(std::string("config.json: '") + field + "' must be an integer");
  *out = it->get<int64_t>();
  return Status::Ok();
}

Status GetDouble(const json& j, const char* field, double* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number()) return Status::Invalid(std::string("config.json: '") + field + "' must be a number");
  *out = it->get<double>();
  return Status::Ok();
}

Status GetBool(const json& j, const char* field, bool* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return Status::Invalid(std::string("config.json: '") + field + "' must be true or false");
  *out = it->get<bool>();
  return Status::Ok();
}

Status Positive(const char* field, int64_t v) {
  if (v <= 0) return Status::Invalid(std::string("config.json: '") + field + "' must be positive, got " + std::to_string(v));
  return Status::Ok();
}

Status LayerTypes(const json& j, std::vector<std::string> defaults, ModelConfig* c) {
  auto it = j.find("layer_types");
  if (it == j.end() || it->is_null()) {
    c->layer_types = std::move(defaults);
    return Status::Ok();
  }
  if (!it->is_array() || static_cast<int64_t>(it->size()) != c->num_hidden_layers)
    return Status::Invalid("config.json: 'layer_types' must be a list of " + std::to_string(c->num_hidden_layers) +
                           " entries");
  c->layer_types.clear();
  for (const json& v : *it) {
    if (!v.is_string() || (v != "sliding_attention" && v != "full_attention"))
      return Status::Invalid("config.json: 'layer_types' entries must be \"sliding_attention\" or "
                             "\"full_attention\", got " + v.dump());
    c->layer_types.push_back(v.get<std::string>());
  }
  return Status::Ok();
}

Status ExpertCounts(const json& j, const char* count_field, ModelConfig* c) {
  for (const char* field : {"num_experts", "num_local_experts"})
    if (Status s = GetInt(j, field, false, &c->num_experts); !s.ok()) return s;
  if (Status s = Positive(count_field, c->num_experts); !s.ok()) return s;
  if (Status s = GetInt(j, "num_experts_per_tok", true, &c->num_experts_per_tok); !s.ok()) return s;
  if (Status s = Positive("num_experts_per_tok", c->num_experts_per_tok); !s.ok()) return s;
  if (c->num_experts_per_tok > c->num_experts)
    return Status::Invalid("config.json: 'num_experts_per_tok' (" + std::to_string(c->num_experts_per_tok) +
                           ") must be at most '" + count_field + "' (" + std::to_string(c->num_experts) + ")");
  return Status::Ok();
}

}  // namespace config_json
}  // namespace loom::engine
