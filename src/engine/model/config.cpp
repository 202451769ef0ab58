// ModelConfig: parsing and writing Hugging Face config.json, the shared fields
// here and each family's own in its file (model/family.h, model/families/).
#include "engine/model/config.h"

#include "engine/model/family.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace loom::engine {
namespace {

using json = nlohmann::json;

using namespace config_json;

// eos_token_id may be a list in HF configs; loom takes the first entry.
Status GetTokenId(const json& j, const char* field, int64_t* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return Status::Ok();
  const json& v = (it->is_array() && !it->empty()) ? (*it)[0] : *it;
  if (!v.is_number_integer()) return Status::Invalid(std::string("config.json: '") + field + "' must be an integer");
  *out = v.get<int64_t>();
  return Status::Ok();
}

// RoPE settings: rope_theta, and rope_scaling (transformers 4.x) or
// rope_parameters (5.x). Only YaRN (for families that take it: gpt_oss) is
// implemented besides plain RoPE; any other type or YaRN key is rejected by name.
Status ParseRope(const json& j, const Family& family, ModelConfig* c) {
  const bool yarn_ok = family.yarn;
  if (Status s = GetDouble(j, "rope_theta", &c->rope_theta); !s.ok()) return s;
  for (const char* field : {"rope_scaling", "rope_parameters"}) {
    auto rs = j.find(field);
    if (rs == j.end() || rs->is_null()) continue;
    const std::string f = field;
    if (!rs->is_object()) return Status::Invalid("config.json: '" + f + "' must be an object");
    std::string type = "default";
    for (const char* key : {"rope_type", "type"})
      if (auto t = rs->find(key); t != rs->end()) {
        if (!t->is_string()) return Status::Invalid("config.json: '" + f + "." + key + "' must be a string");
        type = t->get<std::string>();
      }
    if (Status s = GetDouble(*rs, "rope_theta", &c->rope_theta); !s.ok())
      return Status::Invalid("config.json: '" + f + ".rope_theta' must be a number");
    if (type == "default") {
      if (f == "rope_scaling") return Status::Invalid("config.json: 'rope_scaling' is not supported (only null/absent): " + rs->dump());
      c->rope_type = "default";
      continue;
    }
    if (type != "yarn" || !yarn_ok)
      return Status::Invalid("config.json: '" + f + ".rope_type' \"" + type + "\" is not supported (" +
                             (yarn_ok ? "default, yarn" : "default") + ")");
    c->rope_type = "yarn";
    c->yarn_truncate = true;  // HF: truncate defaults to true when the key is absent
    c->rope_original_max_position = 0;
    for (const auto& [key, value] : rs->items()) {
      if (key == "rope_type" || key == "type" || key == "rope_theta") continue;
      Status s = Status::Ok();
      if (key == "factor") s = GetDouble(*rs, "factor", &c->rope_factor);
      else if (key == "beta_fast") s = GetDouble(*rs, "beta_fast", &c->yarn_beta_fast);
      else if (key == "beta_slow") s = GetDouble(*rs, "beta_slow", &c->yarn_beta_slow);
      else if (key == "truncate") s = GetBool(*rs, "truncate", &c->yarn_truncate);
      else if (key == "original_max_position_embeddings")
        s = GetInt(*rs, "original_max_position_embeddings", false, &c->rope_original_max_position);
      else if (key == "mscale") s = GetDouble(*rs, "mscale", &c->yarn_mscale);
      else if (key == "mscale_all_dim") s = GetDouble(*rs, "mscale_all_dim", &c->yarn_mscale_all_dim);
      else return Status::Invalid("config.json: '" + f + "." + key + "' is not supported for yarn");
      if (!s.ok()) return Status::Invalid("config.json: '" + f + "." + key + "' has the wrong type");
    }
    if (!(c->rope_factor >= 1.0)) return Status::Invalid("config.json: '" + f + ".factor' must be at least 1");
  }
  if (!(c->rope_theta > 0)) return Status::Invalid("config.json: 'rope_theta' must be positive");
  return Status::Ok();
}

}  // namespace

bool ModelConfig::IsSlidingLayer(int64_t layer) const {
  return sliding_window > 0 && layer >= 0 && layer < static_cast<int64_t>(layer_types.size()) &&
         layer_types[layer] == "sliding_attention";
}

int64_t ModelConfig::DsaSource(int64_t layer) const {
  while (layer > 0 && layer < static_cast<int64_t>(indexer_types.size()) && indexer_types[layer] == "shared") --layer;
  return layer;
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (num_experts <= 0 || layer < first_k_dense_replace) return false;
  for (int64_t l : mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> BaseWeightShapes(const ModelConfig& c) {
  const Family* family = FindFamily(c.model_type);
  WeightShapes w;
  if (!family) return w;
  w.push_back({"model.embed_tokens.weight", {c.vocab_size, c.hidden_size}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    if (family->mla || family->own_attention)  // the family's layer_weights lists its own attention
      w.push_back({p + "input_layernorm.weight", {c.hidden_size}});
    else
      AttentionWeightShapes(c, i, family->o_bias, w);
    family->layer_weights(c, i, w);
  }
  w.push_back({"model.norm.weight", {c.hidden_size}});
  if (!c.tie_word_embeddings) w.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}});
  return w;
}

Result<ModelConfig> ModelConfig::Parse(const std::string& json_text) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const std::exception& e) {
    return Status::Invalid(std::string("config.json is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) return Status::Invalid("config.json is not a JSON object");

  ModelConfig c;
  auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string()) return Status::Invalid("config.json: missing required field 'model_type'");
  // A multimodal wrapper whose text model loom reads (its weights under
  // model.language_model., Transformer::Load): the text_config, as HF's
  // text-only class takes it.
  if (*mt == "qwen3_5_moe") {
    auto text = j.find("text_config");
    if (text == j.end() || !text->is_object())
      return Status::Invalid("config.json: 'text_config' (an object) is required for model_type qwen3_5_moe");
    json inner = *text;
    inner["model_type"] = "qwen3_5_moe_text";
    if (!inner.contains("tie_word_embeddings") && j.contains("tie_word_embeddings"))
      inner["tie_word_embeddings"] = j["tie_word_embeddings"];
    j = std::move(inner);
    mt = j.find("model_type");
  }
  c.model_type = mt->get<std::string>();
  const Family* family = FindFamily(c.model_type);
  if (!family)
    return Status::Invalid("config.json: model_type '" + c.model_type + "' is not supported (" + FamilyNames() + ")");
  if (family->defaults) family->defaults(c);

  for (auto [field, dst] : {std::pair{"vocab_size", &c.vocab_size}, std::pair{"hidden_size", &c.hidden_size},
                            std::pair{"intermediate_size", &c.intermediate_size},
                            std::pair{"num_hidden_layers", &c.num_hidden_layers},
                            std::pair{"num_attention_heads", &c.num_attention_heads}}) {
    if (Status s = GetInt(j, field, true, dst); !s.ok()) return s;
    if (Status s = Positive(field, *dst); !s.ok()) return s;
  }
  c.num_key_value_heads = c.num_attention_heads;
  if (Status s = GetInt(j, "num_key_value_heads", false, &c.num_key_value_heads); !s.ok()) return s;
  if (Status s = Positive("num_key_value_heads", c.num_key_value_heads); !s.ok()) return s;
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return Status::Invalid("config.json: 'num_attention_heads' (" + std::to_string(c.num_attention_heads) +
                           ") must be a multiple of 'num_key_value_heads' (" +
                           std::to_string(c.num_key_value_heads) + ")");
  }
  c.head_dim = 0;
  if (Status s = GetInt(j, "head_dim", false, &c.head_dim); !s.ok()) return s;
  if (c.head_dim == 0) {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return Status::Invalid("config.json: 'hidden_size' must be a multiple of 'num_attention_heads' when 'head_dim' is absent");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (Status s = Positive("head_dim", c.head_dim); !s.ok()) return s;
  if (c.head_dim % 2 != 0) return Status::Invalid("config.json: 'head_dim' must be even for rotary embeddings");

  c.max_position_embeddings = 32768;
  if (Status s = GetInt(j, "max_position_embeddings", false, &c.max_position_embeddings); !s.ok()) return s;
  if (Status s = Positive("max_position_embeddings", c.max_position_embeddings); !s.ok()) return s;
  if (Status s = GetDouble(j, "rms_norm_eps", &c.rms_norm_eps); !s.ok()) return s;
  if (!(c.rms_norm_eps > 0)) return Status::Invalid("config.json: 'rms_norm_eps' must be positive");
  if (Status s = GetDouble(j, "initializer_range", &c.initializer_range); !s.ok()) return s;
  if (Status s = GetBool(j, "tie_word_embeddings", &c.tie_word_embeddings); !s.ok()) return s;
  if (Status s = GetTokenId(j, "bos_token_id", &c.bos_token_id); !s.ok()) return s;
  if (Status s = GetTokenId(j, "eos_token_id", &c.eos_token_id); !s.ok()) return s;

  if (Status s = ParseRope(j, *family, &c); !s.ok()) return s;

  bool sliding = false;
  if (Status s = GetBool(j, "use_sliding_window", &sliding); !s.ok()) return s;
  if (sliding) return Status::Invalid("config.json: 'use_sliding_window' true is not supported");
  if (auto act = j.find("hidden_act"); family->checks_hidden_act && act != j.end() && !act->is_null()) {
    if (!act->is_string() || act->get<std::string>() != "silu") {
      return Status::Invalid("config.json: 'hidden_act' " + act->dump() + " is not supported (silu)");
    }
  }
  if (Status s = family->parse(j, c); !s.ok()) return s;
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1) || c.RotaryDim() % 2 != 0 || c.RotaryDim() <= 0)
    return Status::Invalid("config.json: 'partial_rotary_factor' must be in (0, 1] and give a positive even rotary width");

  for (const char* field : {"torch_dtype", "dtype"}) {
    auto it = j.find(field);
    if (it != j.end() && !it->is_null()) {
      if (!it->is_string()) return Status::Invalid(std::string("config.json: '") + field + "' must be a string");
      c.torch_dtype = it->get<std::string>();
      break;
    }
  }
  return c;
}

Result<ModelConfig> ModelConfig::Load(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) return Status::NotFound("model config " + path + " does not exist");
  std::stringstream ss;
  ss << in.rdbuf();
  auto r = Parse(ss.str());
  if (!r.ok()) return Status(r.status().code(), path + ": " + r.status().message());
  return r;
}

std::string ModelConfig::ToJson() const {
  nlohmann::ordered_json j;
  const Family* family = FindFamily(model_type);
  j["architectures"] = {family ? family->architecture : ""};
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  if (rope_type == "yarn") {  // as gpt-oss-20b's config.json writes it
    j["rope_scaling"] = {{"rope_type", "yarn"},
                         {"factor", rope_factor},
                         {"beta_fast", yarn_beta_fast},
                         {"beta_slow", yarn_beta_slow},
                         {"truncate", yarn_truncate},
                         {"original_max_position_embeddings",
                          rope_original_max_position > 0 ? rope_original_max_position : max_position_embeddings}};
    if (yarn_mscale > 0) j["rope_scaling"]["mscale"] = yarn_mscale;
    if (yarn_mscale_all_dim > 0) j["rope_scaling"]["mscale_all_dim"] = yarn_mscale_all_dim;
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (family && family->write) family->write(*this, j);
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = initializer_range;
  j["use_cache"] = true;
  if (!family || !family->writes_sliding) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = num_hidden_layers;
  }
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) j["eos_token_id"] = eos_token_id;
  j["torch_dtype"] = torch_dtype.empty() ? "float32" : torch_dtype;
  return j.dump(2) + "\n";
}

}  // namespace loom::engine
