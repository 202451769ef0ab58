// ModelConfig: parsing and writing Hugging Face config.json for qwen2/qwen3/qwen3_moe/gpt_oss.
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

// The expert count (num_experts, or its alias num_local_experts, named in
// messages as `count_field`) and the top-k, both positive, k <= E.
Status ParseExpertCounts(const json& j, const char* count_field, ModelConfig* c) {
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

// qwen3_moe's expert fields. HF aliases num_experts as num_local_experts;
// norm_topk_prob defaults to false as in HF's class (Qwen3-30B-A3B states true).
Status ParseMoe(const json& j, ModelConfig* c) {
  if (Status s = ParseExpertCounts(j, "num_experts", c); !s.ok()) return s;
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

// gpt_oss's expert and attention fields (HF GptOssConfig): every layer is
// MoE with experts of width intermediate_size; layer_types defaults to
// sliding on even layers, full on odd ones.
Status ParseGptOss(const json& j, ModelConfig* c) {
  if (Status s = ParseExpertCounts(j, "num_local_experts", c); !s.ok()) return s;
  c->moe_intermediate_size = c->intermediate_size;
  c->norm_topk_prob = true;  // the softmax runs over the k chosen logits
  c->attention_bias = true;
  if (Status s = GetBool(j, "attention_bias", &c->attention_bias); !s.ok()) return s;
  c->qk_norm = false;
  c->sliding_window = 128;
  if (auto it = j.find("sliding_window"); it != j.end() && it->is_null()) c->sliding_window = 0;
  if (Status s = GetInt(j, "sliding_window", false, &c->sliding_window); !s.ok()) return s;
  if (c->sliding_window < 0) return Status::Invalid("config.json: 'sliding_window' must be positive or null");
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<int64_t>(it->size()) != c->num_hidden_layers)
      return Status::Invalid("config.json: 'layer_types' must be a list of " + std::to_string(c->num_hidden_layers) +
                             " entries");
    for (const json& v : *it) {
      if (!v.is_string() || (v != "sliding_attention" && v != "full_attention"))
        return Status::Invalid("config.json: 'layer_types' entries must be \"sliding_attention\" or "
                               "\"full_attention\", got " + v.dump());
      c->layer_types.push_back(v.get<std::string>());
    }
  } else {
    for (int64_t i = 0; i < c->num_hidden_layers; ++i)
      c->layer_types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  }
  // HF's bf16 experts clamp at 7.0 whatever the config says (only its MXFP4
  // kernels read the field), so another value has no single meaning.
  if (Status s = GetDouble(j, "swiglu_limit", &c->swiglu_limit); !s.ok()) return s;
  if (c->swiglu_limit != 7.0)
    return Status::Invalid("config.json: 'swiglu_limit' " + std::to_string(c->swiglu_limit) +
                           " is not supported (7.0, the limit HF's bf16 experts use)");
  if (auto act = j.find("hidden_act"); act != j.end() && !act->is_null() && !act->is_string())
    return Status::Invalid("config.json: 'hidden_act' must be a string");
  return Status::Ok();
}

// RoPE settings: rope_theta, and rope_scaling (transformers 4.x) or
// rope_parameters (5.x). Only gpt_oss's YaRN is implemented besides plain
// RoPE; any other type or YaRN key is rejected by name.
Status ParseRope(const json& j, ModelConfig* c) {
  const bool gpt_oss = c->model_type == "gpt_oss";
  if (gpt_oss) {  // GptOssConfig's defaults when config.json states none
    c->rope_theta = 150000.0;
    c->rope_type = "yarn";
    c->rope_factor = 32.0;
    c->yarn_beta_fast = 32.0;
    c->yarn_beta_slow = 1.0;
    c->yarn_truncate = false;
    c->rope_original_max_position = 4096;
  }
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
    if (type != "yarn" || !gpt_oss)
      return Status::Invalid("config.json: '" + f + ".rope_type' \"" + type + "\" is not supported (" +
                             (gpt_oss ? "default, yarn" : "default") + ")");
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
    if (c.IsGptOss()) {  // HF's bf16 GptOss params: experts fused and transposed ([E, in, out])
      const int64_t e = c.num_experts, inter = c.intermediate_size;
      w.push_back({p + "self_attn.sinks", {c.num_attention_heads}});
      w.push_back({p + "post_attention_layernorm.weight", {h}});
      w.push_back({p + "mlp.router.weight", {e, h}});
      w.push_back({p + "mlp.router.bias", {e}});
      w.push_back({p + "mlp.experts.gate_up_proj", {e, h, 2 * inter}});
      w.push_back({p + "mlp.experts.gate_up_proj_bias", {e, 2 * inter}});
      w.push_back({p + "mlp.experts.down_proj", {e, inter, h}});
      w.push_back({p + "mlp.experts.down_proj_bias", {e, h}});
      continue;
    }
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
  if (c.model_type != "qwen2" && c.model_type != "qwen3" && c.model_type != "qwen3_moe" && c.model_type != "gpt_oss") {
    return Status::Invalid("config.json: model_type '" + c.model_type +
                           "' is not supported (qwen2, qwen3, qwen3_moe, gpt_oss)");
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
  if (Status s = GetDouble(j, "initializer_range", &c.initializer_range); !s.ok()) return s;
  if (Status s = GetBool(j, "tie_word_embeddings", &c.tie_word_embeddings); !s.ok()) return s;
  if (Status s = GetTokenId(j, "bos_token_id", &c.bos_token_id); !s.ok()) return s;
  if (Status s = GetTokenId(j, "eos_token_id", &c.eos_token_id); !s.ok()) return s;

  if (Status s = ParseRope(j, &c); !s.ok()) return s;

  bool sliding = false;
  if (Status s = GetBool(j, "use_sliding_window", &sliding); !s.ok()) return s;
  if (sliding) return Status::Invalid("config.json: 'use_sliding_window' true is not supported");
  if (auto act = j.find("hidden_act"); c.model_type != "gpt_oss" && act != j.end() && !act->is_null()) {
    if (!act->is_string() || act->get<std::string>() != "silu") {
      return Status::Invalid("config.json: 'hidden_act' " + act->dump() + " is not supported (silu)");
    }
  }

  if (c.model_type == "gpt_oss") {
    if (Status s = ParseGptOss(j, &c); !s.ok()) return s;
  } else if (c.model_type == "qwen2") {
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
  const bool gpt_oss = model_type == "gpt_oss";
  j["architectures"] = {gpt_oss                    ? "GptOssForCausalLM"
                        : model_type == "qwen3_moe" ? "Qwen3MoeForCausalLM"
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
  if (rope_type == "yarn") {  // as gpt-oss-20b's config.json writes it
    j["rope_scaling"] = {{"rope_type", "yarn"},
                         {"factor", rope_factor},
                         {"beta_fast", yarn_beta_fast},
                         {"beta_slow", yarn_beta_slow},
                         {"truncate", yarn_truncate},
                         {"original_max_position_embeddings",
                          rope_original_max_position > 0 ? rope_original_max_position : max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (qwen3 || gpt_oss) j["attention_bias"] = attention_bias;
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
  if (gpt_oss) {
    j["num_local_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["sliding_window"] = sliding_window > 0 ? nlohmann::ordered_json(sliding_window) : nlohmann::ordered_json();
    j["layer_types"] = layer_types;
    j["swiglu_limit"] = swiglu_limit;
    j["output_router_logits"] = false;
    j["router_aux_loss_coef"] = 0.9;
  }
  j["initializer_range"] = initializer_range;
  j["use_cache"] = true;
  if (!gpt_oss) {
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
