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

// qwen3_moe's expert fields. HF aliases num_experts as num_local_experts;
// norm_topk_prob defaults to false as in HF's class (Qwen3-30B-A3B states true).
Status ParseMoe(const json& j, ModelConfig* c) {
  for (const char* field : {"num_experts", "num_local_experts"})
    if (Status s = GetInt(j, field, false, &c->num_experts); !s.ok()) return s;
  if (Status s = Positive("num_experts", c->num_experts); !s.ok()) return s;
  if (Status s = GetInt(j, "num_experts_per_tok", true, &c->num_experts_per_tok); !s.ok()) return s;
  if (Status s = Positive("num_experts_per_tok", c->num_experts_per_tok); !s.ok()) return s;
  if (c->num_experts_per_tok > c->num_experts)
    return Status::Invalid("config.json: 'num_experts_per_tok' (" + std::to_string(c->num_experts_per_tok) +
                           ") must be at most 'num_experts' (" + std::to_string(c->num_experts) + ")");
  if (Status s = GetInt(j, "moe_intermediate_size", true, &c->moe_intermediate_size); !s.ok()) return s;
  if (Status s = Positive("moe_intermediate_size", c->moe_intermediate_size); !s.ok()) return s;
  if (Status s = GetBool(j, "norm_topk_prob", &c->norm_topk_prob); !s.ok()) return s;
  if (Status s = GetInt(j, "decoder_sparse_step", false, &c->decoder_sparse_step); !s.ok()) return s;
  if (Status s = Positive("decoder_sparse_step", c->decoder_sparse_step); !s.ok()) return s;
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return Status::Invalid("config.json: 'mlp_only_layers' must be a list of layer indices");
    for (const json& v : *it) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c->num_hidden_layers)
        return Status::Invalid("config.json: 'mlp_only_layers' entries must be layer indices in [0, " +
                               std::to_string(c->num_hidden_layers) + ")");
      c->mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  return Status::Ok();
}

}  // namespace

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (num_experts <= 0) return false;
  for (int64_t l : mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> BaseWeightShapes(const ModelConfig& c) {
  const int64_t hd = c.head_dim > 0 ? c.head_dim : (c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  const int64_t h = c.hidden_size, q = c.num_attention_heads * hd, kv = c.num_key_value_heads * hd;
  std::vector<std::pair<std::string, std::vector<int64_t>>> w;
  w.push_back({"model.embed_tokens.weight", {c.vocab_size, h}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    w.push_back({p + "input_layernorm.weight", {h}});
    for (auto [name, rows] : {std::pair{"q_proj", q}, std::pair{"k_proj", kv}, std::pair{"v_proj", kv}}) {
      w.push_back({p + "self_attn." + name + ".weight", {rows, h}});
      if (c.attention_bias) w.push_back({p + "self_attn." + name + ".bias", {rows}});
    }
    w.push_back({p + "self_attn.o_proj.weight", {h, q}});
    if (c.attention_bias && c.model_type != "qwen2")  // qwen2's o_proj never has a bias
      w.push_back({p + "self_attn.o_proj.bias", {h}});
    if (c.qk_norm) {
      w.push_back({p + "self_attn.q_norm.weight", {hd}});
      w.push_back({p + "self_attn.k_norm.weight", {hd}});
    }
    w.push_back({p + "post_attention_layernorm.weight", {h}});
    if (c.IsMoeLayer(i)) {
      const int64_t inter = c.moe_intermediate_size;
      w.push_back({p + "mlp.gate.weight", {c.num_experts, h}});
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        w.push_back({x + "gate_proj.weight", {inter, h}});
        w.push_back({x + "up_proj.weight", {inter, h}});
        w.push_back({x + "down_proj.weight", {h, inter}});
      }
    } else {
      w.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, h}});
      w.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, h}});
      w.push_back({p + "mlp.down_proj.weight", {h, c.intermediate_size}});
    }
  }
  w.push_back({"model.norm.weight", {h}});
  if (!c.tie_word_embeddings) w.push_back({"lm_head.weight", {c.vocab_size, h}});
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
  c.model_type = mt->get<std::string>();
  if (c.model_type != "qwen2" && c.model_type != "qwen3" && c.model_type != "qwen3_moe") {
    return Status::Invalid("config.json: model_type '" + c.model_type + "' is not supported (qwen2, qwen3, qwen3_moe)");
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
  } else {  // qwen3, qwen3_moe
    c.attention_bias = false;
    if (Status s = GetBool(j, "attention_bias", &c.attention_bias); !s.ok()) return s;
    c.qk_norm = true;
  }

  if (c.model_type == "qwen3_moe") {
    if (Status s = ParseMoe(j, &c); !s.ok()) return s;
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
  const bool qwen3 = model_type == "qwen3" || model_type == "qwen3_moe";
  j["architectures"] = {model_type == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                        : qwen3                    ? "Qwen3ForCausalLM"
                                                   : "Qwen2ForCausalLM"};
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
  if (model_type == "qwen3_moe") {
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
    j["output_router_logits"] = false;
    j["router_aux_loss_coef"] = 0.001;
  }
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
