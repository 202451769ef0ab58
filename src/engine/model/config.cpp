// ModelConfig: parsing and writing Hugging Face config.json for qwen2/qwen3.
#include "engine/model/config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace loom::engine {
namespace {

using json = nlohmann::json;

// Reads an integer field; Invalid names the field if it has another type.
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

// eos_token_id may be a list in HF configs; loom takes the first entry.
Status GetTokenId(const json& j, const char* field, int64_t* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return Status::Ok();
  const json& v = (it->is_array() && !it->empty()) ? (*it)[0] : *it;
  if (!v.is_number_integer()) return Status::Invalid(std::string("config.json: '") + field + "' must be an integer");
  *out = v.get<int64_t>();
  return Status::Ok();
}

Status Positive(const char* field, int64_t v) {
  if (v <= 0) return Status::Invalid(std::string("config.json: '") + field + "' must be positive, got " + std::to_string(v));
  return Status::Ok();
}

}  // namespace

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
  c.model_type = mt->get<std::string>();
  if (c.model_type != "qwen2" && c.model_type != "qwen3") {
    return Status::Invalid("config.json: model_type '" + c.model_type + "' is not supported (qwen2, qwen3)");
  }

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
  if (Status s = GetDouble(j, "rope_theta", &c.rope_theta); !s.ok()) return s;
  if (Status s = GetDouble(j, "initializer_range", &c.initializer_range); !s.ok()) return s;
  if (Status s = GetBool(j, "tie_word_embeddings", &c.tie_word_embeddings); !s.ok()) return s;
  if (Status s = GetTokenId(j, "bos_token_id", &c.bos_token_id); !s.ok()) return s;
  if (Status s = GetTokenId(j, "eos_token_id", &c.eos_token_id); !s.ok()) return s;

  // Only plain RoPE is implemented.
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    return Status::Invalid("config.json: 'rope_scaling' is not supported (only null/absent): " + rs->dump());
  }
  // transformers 5.x writes rope settings as rope_parameters {rope_type, rope_theta}.
  if (auto rp = j.find("rope_parameters"); rp != j.end() && !rp->is_null()) {
    if (!rp->is_object()) return Status::Invalid("config.json: 'rope_parameters' must be an object");
    auto type = rp->find("rope_type");
    if (type != rp->end() && !(type->is_string() && type->get<std::string>() == "default")) {
      return Status::Invalid("config.json: 'rope_parameters.rope_type' " + type->dump() + " is not supported (default)");
    }
    if (Status s = GetDouble(*rp, "rope_theta", &c.rope_theta); !s.ok()) {
      return Status::Invalid("config.json: 'rope_parameters.rope_theta' must be a number");
    }
  }
  if (!(c.rope_theta > 0)) return Status::Invalid("config.json: 'rope_theta' must be positive");

  bool sliding = false;
  if (Status s = GetBool(j, "use_sliding_window", &sliding); !s.ok()) return s;
  if (sliding) return Status::Invalid("config.json: 'use_sliding_window' true is not supported");
  if (auto act = j.find("hidden_act"); act != j.end() && !act->is_null()) {
    if (!act->is_string() || act->get<std::string>() != "silu") {
      return Status::Invalid("config.json: 'hidden_act' " + act->dump() + " is not supported (silu)");
    }
  }

  if (c.model_type == "qwen2") {
    c.attention_bias = true;  // Qwen2's q/k/v projections always carry a bias
    c.qk_norm = false;
  } else {
    c.attention_bias = false;
    if (Status s = GetBool(j, "attention_bias", &c.attention_bias); !s.ok()) return s;
    c.qk_norm = true;
  }

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
  const bool qwen3 = model_type == "qwen3";
  j["architectures"] = {qwen3 ? "Qwen3ForCausalLM" : "Qwen2ForCausalLM"};
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
  j["rope_scaling"] = nullptr;
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (qwen3) j["attention_bias"] = attention_bias;
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = initializer_range;
  j["use_cache"] = true;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = num_hidden_layers;
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) j["eos_token_id"] = eos_token_id;
  j["torch_dtype"] = torch_dtype.empty() ? "float32" : torch_dtype;
  return j.dump(2) + "\n";
}

}  // namespace loom::engine
