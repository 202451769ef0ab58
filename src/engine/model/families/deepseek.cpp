// deepseek_v2 (DeepSeek-V2, V2-Lite) and deepseek_v3 (DeepSeek-V3 and the
// text model of Kimi K2.5), as transformers' modeling_deepseek_v2/_v3:
// multi-head latent attention (model/mla.h) in every layer; a dense SwiGLU
// MLP in the first first_k_dense_replace layers, experts after (model/moe.h)
// with n_shared_experts shared experts beside them. The two differ in the
// router only: v2 ranks softmax scores (greedy, or group_limited_greedy over
// n_group groups), v3 sigmoid scores plus a correction bias
// (e_score_correction_bias, fp32) with groups ranked by their two best
// scores, renormalised when norm_topk_prob. v2's RoPE always rotates
// adjacent pairs (its complex form); v3 does when rope_interleave. v3 scales
// the softmax by YaRN's mscale(factor, mscale_all_dim)^2, v2 does not.
// The hub ships one tensor per expert and projection; they load stacked.
// glm_moe_dsa (GLM-5, GLM-5.2; modeling_glm_moe_dsa) is deepseek_v3's
// router over MLA with q compression, layers dense by
// mlp_layer_types, plus DeepSeek sparse attention: a lightning indexer per
// layer choosing each query's keys (model/dsa.h), shared layers reusing the
// choice of the full layer below (indexer_types). Its RoPE turns adjacent
// pairs, the indexer's too (transformers 5.17's module-level rotation: the
// golden caught an earlier reading of halves).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

#include "engine/model/families/deepseek_moe.h"
#include "engine/model/family.h"
#include "engine/model/rope.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {
namespace {

using namespace config_json;

bool IsV3(const ModelConfig& c) { return c.model_type == "deepseek_v3"; }
bool IsDsaFamily(const ModelConfig& c) { return c.model_type == "glm_moe_dsa"; }
// Sigmoid scores plus the fp32 correction bias (deepseek_v3's router).
bool Sigmoid(const ModelConfig& c) { return c.model_type != "deepseek_v2"; }

void DefaultsV2(ModelConfig& c) {  // DeepseekV2Config's defaults where config.json states none
  c.q_lora_rank = 1536, c.kv_lora_rank = 512, c.qk_nope_head_dim = 128, c.qk_rope_head_dim = 64, c.v_head_dim = 128;
  c.n_shared_experts = 2, c.first_k_dense_replace = 0, c.routed_scaling_factor = 1.0;
  c.num_experts = 64, c.moe_intermediate_size = 1407;
  c.topk_method = "greedy", c.scoring_func = "softmax";
  c.rope_interleave = true;
}

void DefaultsV3(ModelConfig& c) {  // DeepseekV3Config's
  c.q_lora_rank = 1536, c.kv_lora_rank = 512, c.qk_nope_head_dim = 128, c.qk_rope_head_dim = 64, c.v_head_dim = 128;
  c.n_shared_experts = 1, c.first_k_dense_replace = 3, c.routed_scaling_factor = 2.5;
  c.num_experts = 256, c.num_experts_per_tok = 8, c.moe_intermediate_size = 2048;
  c.n_group = 8, c.topk_group = 4, c.norm_topk_prob = true;
  c.topk_method = "noaux_tc", c.scoring_func = "sigmoid";
  c.rope_interleave = true;
}

void DefaultsDsa(ModelConfig& c) {  // GlmMoeDsaConfig's (GLM-5)
  c.q_lora_rank = 2048, c.kv_lora_rank = 512, c.qk_nope_head_dim = 192, c.qk_rope_head_dim = 64, c.v_head_dim = 256;
  c.n_shared_experts = 1, c.first_k_dense_replace = 3, c.routed_scaling_factor = 2.5;
  c.num_experts = 256, c.num_experts_per_tok = 8, c.moe_intermediate_size = 2048;
  c.n_group = 1, c.topk_group = 1, c.norm_topk_prob = true;
  c.scoring_func = "sigmoid", c.topk_method = "noaux_tc";
  c.rope_interleave = true;
  c.index_topk = 2048, c.index_head_dim = 128, c.index_n_heads = 32;
}

// The indexer's fields (dsa.h); its checks.
Status CheckDsa(const ModelConfig& c) {
  const auto bad = [&](const std::string& field, const std::string& why) {
    return Status::Invalid("config." + field + " " + why + " for " + c.model_type);
  };
  if (c.index_topk <= 0 || c.index_n_heads <= 0) return bad("index_topk and index_n_heads", "must be > 0");
  if (c.index_head_dim < c.qk_rope_head_dim)
    return bad("index_head_dim", "must be at least qk_rope_head_dim " + std::to_string(c.qk_rope_head_dim) +
                                     " (its first dims turn by RoPE)");
  if (c.q_lora_rank <= 0) return bad("q_lora_rank", "must be > 0 (the indexer reads q's compressed rows)");
  if (!c.rope_interleave) return bad("rope_interleave", "must be true (GLM's RoPE turns adjacent pairs)");
  if (!c.indexer_types.empty() && static_cast<int64_t>(c.indexer_types.size()) != c.num_hidden_layers)
    return bad("indexer_types", "must have one entry a layer (" + std::to_string(c.num_hidden_layers) + ")");
  for (const std::string& t : c.indexer_types)
    if (t != "full" && t != "shared") return bad("indexer_types", "entries must be \"full\" or \"shared\", got \"" + t + "\"");
  return Status::Ok();
}

// indexer_types as HF's GlmMoeDsaConfig derives it: stated; or from
// index_topk_pattern ("FSS..." or a list of "full"/"shared"); or from
// index_topk_freq and index_skip_topk_offset (layer i full when
// max(i - offset + 1, 0) % freq == 0); or all full.
Status ParseIndexerTypes(const nlohmann::json& j, ModelConfig& c) {
  c.indexer_types.clear();
  const auto list = [&](const nlohmann::json& v, const char* field) {
    if (!v.is_array()) return Status::Invalid(std::string("config.json: '") + field + "' must be a list or a string");
    for (const nlohmann::json& t : v) {
      if (!t.is_string()) return Status::Invalid(std::string("config.json: '") + field + "' entries must be strings");
      c.indexer_types.push_back(t.get<std::string>());
    }
    return Status::Ok();
  };
  if (auto it = j.find("indexer_types"); it != j.end() && !it->is_null()) return list(*it, "indexer_types");
  if (auto it = j.find("index_topk_pattern"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return list(*it, "index_topk_pattern");
    for (char ch : it->get<std::string>()) {
      if (ch != 'F' && ch != 'S')
        return Status::Invalid("config.json: 'index_topk_pattern' letters must be F or S, got '" + std::string(1, ch) + "'");
      c.indexer_types.push_back(ch == 'F' ? "full" : "shared");
    }
    return Status::Ok();
  }
  int64_t freq = 1, offset = 2;
  if (Status s = GetInt(j, "index_topk_freq", false, &freq); !s.ok()) return s;
  if (Status s = GetInt(j, "index_skip_topk_offset", false, &offset); !s.ok()) return s;
  freq = std::max<int64_t>(freq, 1);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    c.indexer_types.push_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0 ? "full" : "shared");
  return Status::Ok();
}

// The rules of a config however it was made (Parse, or built in code).
Status Check(const ModelConfig& c) {
  if (Status s = CheckDeepseekMoe(c); !s.ok()) return s;
  const auto bad = [&](const std::string& field, const std::string& why) {
    return Status::Invalid("config." + field + " " + why + " for " + c.model_type);
  };
  if (c.kv_lora_rank <= 0 || c.qk_nope_head_dim <= 0 || c.qk_rope_head_dim <= 0 || c.v_head_dim <= 0)
    return bad("kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim", "must be > 0");
  if (c.qk_rope_head_dim % 2 != 0) return bad("qk_rope_head_dim", "must be even");
  if (c.head_dim != c.qk_rope_head_dim) return bad("head_dim", "must equal qk_rope_head_dim (its RoPE width)");
  if (c.num_key_value_heads != c.num_attention_heads)
    return bad("num_key_value_heads", "must equal num_attention_heads (MLA gives every head its key)");
  if (c.q_lora_rank < 0) return bad("q_lora_rank", "must be >= 0 (0: no q compression)");
  if (IsDsaFamily(c)) return CheckDsa(c);
  if (c.IsDsa()) return bad("index_topk", "is glm_moe_dsa's (sparse attention)");
  return Status::Ok();
}

// The fields both read; v3's router fields and rope_interleave on top.
Status Parse(const nlohmann::json& j, ModelConfig& c) {
  if (Status s = GetBool(j, "attention_bias", &c.attention_bias); !s.ok()) return s;
  if (auto it = j.find("q_lora_rank"); it != j.end() && it->is_null()) {
    c.q_lora_rank = 0;  // HF's None: no q compression
  } else {
    if (Status s = GetInt(j, "q_lora_rank", false, &c.q_lora_rank); !s.ok()) return s;
    if (Status s = Positive("q_lora_rank", c.q_lora_rank); !s.ok()) return s;
  }
  for (auto [field, dst] : {std::pair{"kv_lora_rank", &c.kv_lora_rank}, std::pair{"qk_nope_head_dim", &c.qk_nope_head_dim},
                            std::pair{"qk_rope_head_dim", &c.qk_rope_head_dim}, std::pair{"v_head_dim", &c.v_head_dim}}) {
    if (Status s = GetInt(j, field, false, dst); !s.ok()) return s;
    if (Status s = Positive(field, *dst); !s.ok()) return s;
  }
  if (!Sigmoid(c) && j.find("num_experts_per_tok") == j.end())
    return Status::Invalid("config.json: missing required field 'num_experts_per_tok'");
  if (Status s = ParseDeepseekMoe(j, c); !s.ok()) return s;
  if (IsDsaFamily(c)) {  // HF's GLM class has no router method fields nor rope_interleave (its RoPE always pairs)
    bool stated = false;
    if (Status s = ParseMlpLayerTypes(j, c, &stated); !s.ok()) return s;
    for (auto [field, dst] : {std::pair{"index_topk", &c.index_topk}, std::pair{"index_head_dim", &c.index_head_dim},
                              std::pair{"index_n_heads", &c.index_n_heads}}) {
      if (Status s = GetInt(j, field, false, dst); !s.ok()) return s;
      if (Status s = Positive(field, *dst); !s.ok()) return s;
    }
    if (Status s = ParseIndexerTypes(j, c); !s.ok()) return s;
    c.head_dim = c.qk_rope_head_dim;
    c.num_key_value_heads = c.num_attention_heads;
    return Check(c);
  }
  if (auto it = j.find("topk_method"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return Status::Invalid("config.json: 'topk_method' must be a string");
    c.topk_method = it->get<std::string>();
  }
  if (auto it = j.find("scoring_func"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return Status::Invalid("config.json: 'scoring_func' must be a string");
    c.scoring_func = it->get<std::string>();
  }
  if (IsV3(c)) {
    // HF's v3 router is noaux_tc with sigmoid scores whatever these say.
    if (c.scoring_func != "sigmoid")
      return Status::Invalid("config.json: 'scoring_func' \"" + c.scoring_func + "\" is not supported (sigmoid)");
    if (Status s = GetBool(j, "rope_interleave", &c.rope_interleave); !s.ok()) return s;
  } else {
    if (c.scoring_func != "softmax")
      return Status::Invalid("config.json: 'scoring_func' \"" + c.scoring_func + "\" is not supported (softmax)");
    if (c.topk_method != "greedy" && c.topk_method != "group_limited_greedy")
      return Status::Invalid("config.json: 'topk_method' \"" + c.topk_method +
                             "\" is not supported (greedy, group_limited_greedy)");
    if (c.topk_method == "greedy") c.n_group = c.topk_group = 1;  // HF's greedy ignores the groups
  }
  c.head_dim = c.qk_rope_head_dim;  // as HF's config: the RoPE width
  c.num_key_value_heads = c.num_attention_heads;
  return Check(c);
}

void Write(const ModelConfig& c, nlohmann::ordered_json& j) {
  j["attention_bias"] = c.attention_bias;
  j["q_lora_rank"] = c.q_lora_rank > 0 ? nlohmann::ordered_json(c.q_lora_rank) : nlohmann::ordered_json();
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  WriteDeepseekMoe(c, j);
  if (IsDsaFamily(c)) {
    j["mlp_layer_types"] = MlpLayerTypes(c);
    j["index_topk"] = c.index_topk;
    j["index_head_dim"] = c.index_head_dim;
    j["index_n_heads"] = c.index_n_heads;
    std::vector<std::string> types = c.indexer_types;
    if (types.empty()) types.assign(static_cast<size_t>(c.num_hidden_layers), "full");
    j["indexer_types"] = types;
    j["mlp_bias"] = false;
    return;
  }
  j["moe_layer_freq"] = 1;
  j["topk_method"] = c.topk_method;
  j["scoring_func"] = c.scoring_func;
  j["n_group"] = c.n_group;
  j["topk_group"] = c.topk_group;
  if (IsV3(c)) j["rope_interleave"] = c.rope_interleave;
  j["aux_loss_alpha"] = 0.001;
  j["seq_aux"] = true;
  j["mlp_bias"] = false;
}

void MlaWeightShapes(const ModelConfig& c, int64_t layer, const std::string& p, WeightShapes& w) {
  const int64_t h = c.hidden_size, H = c.num_attention_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const std::string a = p + "self_attn.";
  if (c.q_lora_rank > 0) {
    w.push_back({a + "q_a_proj.weight", {c.q_lora_rank, h}});
    if (c.attention_bias) w.push_back({a + "q_a_proj.bias", {c.q_lora_rank}});
    w.push_back({a + "q_a_layernorm.weight", {c.q_lora_rank}});
    w.push_back({a + "q_b_proj.weight", {H * qk, c.q_lora_rank}});
  } else {
    w.push_back({a + "q_proj.weight", {H * qk, h}});
  }
  w.push_back({a + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, h}});
  if (c.attention_bias) w.push_back({a + "kv_a_proj_with_mqa.bias", {c.kv_lora_rank + c.qk_rope_head_dim}});
  w.push_back({a + "kv_a_layernorm.weight", {c.kv_lora_rank}});
  w.push_back({a + "kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}});
  w.push_back({a + "o_proj.weight", {h, H * c.v_head_dim}});
  if (c.attention_bias) w.push_back({a + "o_proj.bias", {h}});
  // A "shared" layer takes the choice of the full layer below and has no
  // indexer (transformers 5.17 builds none there; a checkpoint that still
  // carries one there loads, its tensors ignored: IsIgnorable).
  if (!c.IsDsa() || c.DsaSource(layer) != layer) return;
  const std::string x = a + "indexer.";
  w.push_back({x + "wq_b.weight", {c.index_n_heads * c.index_head_dim, c.q_lora_rank}});
  w.push_back({x + "wk.weight", {c.index_head_dim, h}});
  w.push_back({x + "k_norm.weight", {c.index_head_dim}});
  w.push_back({x + "k_norm.bias", {c.index_head_dim}});
  w.push_back({x + "weights_proj.weight", {c.index_n_heads, h}});
}

void LayerWeights(const ModelConfig& c, int64_t layer, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  MlaWeightShapes(c, layer, p, w);
  PostNormWeightShape(c, p, w);
  DeepseekMoeWeightShapes(c, layer, Sigmoid(c), w);
}

Status LoadLayer(LayerLoad& l) {
  const ModelConfig& c = l.config;
  const std::string a = l.prefix + "self_attn.";
  MlaWeights& m = l.layer.mla;
  if (c.q_lora_rank > 0) {
    m.q_a_w = l.get(a + "q_a_proj.weight");
    if (c.attention_bias) m.q_a_b = l.get(a + "q_a_proj.bias");
    m.q_a_norm = l.get(a + "q_a_layernorm.weight");
    m.q_b_w = l.get(a + "q_b_proj.weight");
  } else {
    m.q_w = l.get(a + "q_proj.weight");
  }
  m.kv_a_w = l.get(a + "kv_a_proj_with_mqa.weight");
  if (c.attention_bias) m.kv_a_b = l.get(a + "kv_a_proj_with_mqa.bias");
  m.kv_a_norm = l.get(a + "kv_a_layernorm.weight");
  m.kv_b_w = l.get(a + "kv_b_proj.weight");
  l.layer.o_w = l.get(a + "o_proj.weight");
  if (c.attention_bias) l.layer.o_b = l.get(a + "o_proj.bias");
  m.heads = c.num_attention_heads, m.nope = c.qk_nope_head_dim, m.rope = c.qk_rope_head_dim;
  m.v = c.v_head_dim, m.rank = c.kv_lora_rank;
  m.interleave = Sigmoid(c) ? c.rope_interleave : true;
  m.scale = 1.0 / std::sqrt(static_cast<double>(m.qk()));
  if (IsV3(c) && c.rope_type == "yarn" && c.yarn_mscale_all_dim > 0) {
    const double ms = YarnMscale(c.rope_factor, c.yarn_mscale_all_dim);
    m.scale *= ms * ms;
  }
  if (c.IsDsa()) {
    DsaIndexerWeights& x = m.indexer;
    x.heads = c.index_n_heads, x.dim = c.index_head_dim, x.rope = c.qk_rope_head_dim, x.topk = c.index_topk;
    x.source = c.DsaSource(l.index);
    if (x.source == l.index) {  // a full layer: its own indexer (a shared one has none)
      const std::string p = a + "indexer.";
      x.wq_b = l.get(p + "wq_b.weight");
      x.wk = l.get(p + "wk.weight");
      x.k_norm_w = l.get(p + "k_norm.weight");
      x.k_norm_b = l.get(p + "k_norm.bias");
      x.weights_proj = l.get(p + "weights_proj.weight");
    }
  }
  LoadDeepseekMoe(l, Sigmoid(c) ? MoeRouter::kGroupedSigmoid : MoeRouter::kGroupedSoftmax, Sigmoid(c));
  return Status::Ok();
}

// The shapes both presets share.
ModelConfig Base(const char* model_type) {
  ModelConfig c;
  c.model_type = model_type;
  c.rms_norm_eps = 1e-6;
  c.initializer_range = 0.02;
  c.attention_bias = false;
  c.tie_word_embeddings = false;
  c.rope_theta = 10000.0;
  return c;
}

void Mla(ModelConfig& c, int64_t heads, int64_t q_rank, int64_t kv_rank, int64_t nope, int64_t rope, int64_t v) {
  c.num_attention_heads = c.num_key_value_heads = heads;
  c.q_lora_rank = q_rank, c.kv_lora_rank = kv_rank, c.qk_nope_head_dim = nope, c.qk_rope_head_dim = rope;
  c.v_head_dim = v;
  c.head_dim = rope;
}

void Experts(ModelConfig& c, int64_t routed, int64_t k, int64_t width, int64_t shared, int64_t dense_first) {
  c.num_experts = routed, c.num_experts_per_tok = k, c.moe_intermediate_size = width;
  c.n_shared_experts = shared, c.first_k_dense_replace = dense_first;
}

void Yarn(ModelConfig& c, double factor, int64_t original, double mscale) {
  c.rope_type = "yarn";
  c.rope_factor = factor;
  c.rope_original_max_position = original;
  c.yarn_beta_fast = 32.0, c.yarn_beta_slow = 1.0;
  c.yarn_mscale = c.yarn_mscale_all_dim = mscale;
}

// tiny: three layers, the first dense; q compression and group-limited
// routing (4 groups, 2 chosen), two shared experts; deepseek-v2-lite and
// deepseek-v2: the real shapes (docs/compatibility.md, "Model families").
Result<ModelConfig> PresetV2(const std::string& name, std::string* default_dtype) {
  ModelConfig c = Base("deepseek_v2");
  c.scoring_func = "softmax";
  c.rope_interleave = true;
  *default_dtype = "bf16";
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 3;
    c.max_position_embeddings = 2048;
    Mla(c, 4, 32, 32, 16, 8, 16);
    Experts(c, 8, 2, 32, 2, 1);
    c.topk_method = "group_limited_greedy", c.n_group = 4, c.topk_group = 2;
    c.routed_scaling_factor = 1.5;
    *default_dtype = "fp32";
  } else if (name == "deepseek-v2-lite") {
    c.vocab_size = 102400, c.hidden_size = 2048, c.intermediate_size = 10944, c.num_hidden_layers = 27;
    c.max_position_embeddings = 163840;
    Mla(c, 16, 0, 512, 128, 64, 128);
    Experts(c, 64, 6, 1408, 2, 1);
    c.topk_method = "greedy";
    Yarn(c, 40.0, 4096, 0.707);
  } else if (name == "deepseek-v2") {
    c.vocab_size = 102400, c.hidden_size = 5120, c.intermediate_size = 12288, c.num_hidden_layers = 60;
    c.max_position_embeddings = 163840;
    Mla(c, 128, 1536, 512, 128, 64, 128);
    Experts(c, 160, 6, 1536, 2, 1);
    c.topk_method = "group_limited_greedy", c.n_group = 8, c.topk_group = 3;
    c.routed_scaling_factor = 16.0;
    Yarn(c, 40.0, 4096, 0.707);
  } else {
    return Status::Invalid("preset '" + name + "' is not one of tiny, deepseek-v2-lite, deepseek-v2");
  }
  return c;
}

// tiny: as v2's, without q compression (plain q_proj), sigmoid routing with
// the correction bias over 2 groups (1 chosen), renormalised, one shared
// expert; kimi-k2.5 (its text model) and deepseek-v3: the real shapes.
Result<ModelConfig> PresetV3(const std::string& name, std::string* default_dtype) {
  ModelConfig c = Base("deepseek_v3");
  c.scoring_func = "sigmoid", c.topk_method = "noaux_tc";
  c.rope_interleave = true;
  c.norm_topk_prob = true;
  *default_dtype = "bf16";
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 3;
    c.max_position_embeddings = 2048;
    Mla(c, 4, 0, 32, 16, 8, 16);
    Experts(c, 8, 2, 32, 1, 1);
    c.n_group = 2, c.topk_group = 1;
    c.routed_scaling_factor = 2.5;
    *default_dtype = "fp32";
  } else if (name == "kimi-k2.5") {
    c.vocab_size = 163840, c.hidden_size = 7168, c.intermediate_size = 18432, c.num_hidden_layers = 61;
    c.max_position_embeddings = 262144;
    c.rope_theta = 50000.0;
    Mla(c, 64, 1536, 512, 128, 64, 128);
    Experts(c, 384, 8, 2048, 1, 1);
    c.n_group = 1, c.topk_group = 1;
    c.routed_scaling_factor = 2.827;
    Yarn(c, 64.0, 4096, 1.0);
  } else if (name == "deepseek-v3") {
    c.vocab_size = 129280, c.hidden_size = 7168, c.intermediate_size = 18432, c.num_hidden_layers = 61;
    c.max_position_embeddings = 163840;
    Mla(c, 128, 1536, 512, 128, 64, 128);
    Experts(c, 256, 8, 2048, 1, 3);
    c.n_group = 8, c.topk_group = 4;
    c.routed_scaling_factor = 2.5;
    Yarn(c, 40.0, 4096, 1.0);
  } else {
    return Status::Invalid("preset '" + name + "' is not one of tiny, kimi-k2.5, deepseek-v3");
  }
  return c;
}

// tiny: three layers, the first dense (mlp_layer_types), q compression,
// an indexer of 8 heads of 12 keeping 5 keys (so the tests' longer
// sequences attend sparsely), the second layer sharing the first's choice;
// glm-5.2: the real shapes (21 of 78 layers index: GLM-5.2's pattern, HF's
// index_topk_freq 4 with index_skip_topk_offset 3).
Result<ModelConfig> PresetDsa(const std::string& name, std::string* default_dtype) {
  ModelConfig c = Base("glm_moe_dsa");
  DefaultsDsa(c);
  c.rms_norm_eps = 1e-5;
  *default_dtype = "bf16";
  int64_t freq = 1, offset = 2;
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 3;
    c.max_position_embeddings = 2048;
    Mla(c, 4, 32, 32, 16, 8, 16);
    Experts(c, 8, 2, 32, 1, 1);
    c.n_group = 2, c.topk_group = 1;
    c.index_topk = 5, c.index_head_dim = 12, c.index_n_heads = 8;
    c.indexer_types = {"full", "shared", "full"};
    *default_dtype = "fp32";
  } else if (name == "glm-5.2") {
    c.vocab_size = 154880, c.hidden_size = 6144, c.intermediate_size = 12288, c.num_hidden_layers = 78;
    c.max_position_embeddings = 1048576;
    c.rope_theta = 1000000.0;
    Mla(c, 64, 2048, 512, 192, 64, 256);
    Experts(c, 256, 8, 2048, 1, 3);
    c.num_nextn_predict_layers = 1;
    freq = 4, offset = 3;
  } else {
    return Status::Invalid("preset '" + name + "' is not one of tiny, glm-5.2");
  }
  if (c.indexer_types.empty())
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.indexer_types.push_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0 ? "full" : "shared");
  return c;
}

}  // namespace

extern const Family kGlmMoeDsaFamily;
const Family kGlmMoeDsaFamily{.model_type = "glm_moe_dsa",
                              .architecture = "GlmMoeDsaForCausalLM",
                              .presets = "tiny, glm-5.2",
                              .mla = true,
                              .defaults = DefaultsDsa,
                              .parse = Parse,
                              .write = Write,
                              .check = Check,
                              .layer_weights = LayerWeights,
                              .load_layer = LoadLayer,
                              .preset = PresetDsa};

extern const Family kDeepseekV2Family;
const Family kDeepseekV2Family{.model_type = "deepseek_v2",
                               .architecture = "DeepseekV2ForCausalLM",
                               .presets = "tiny, deepseek-v2-lite, deepseek-v2",
                               .yarn = true,
                               .mla = true,
                               .defaults = DefaultsV2,
                               .parse = Parse,
                               .write = Write,
                               .check = Check,
                               .layer_weights = LayerWeights,
                               .load_layer = LoadLayer,
                               .preset = PresetV2};

extern const Family kDeepseekV3Family;
const Family kDeepseekV3Family{.model_type = "deepseek_v3",
                               .architecture = "DeepseekV3ForCausalLM",
                               .presets = "tiny, kimi-k2.5, deepseek-v3",
                               .yarn = true,
                               .mla = true,
                               .defaults = DefaultsV3,
                               .parse = Parse,
                               .write = Write,
                               .check = Check,
                               .layer_weights = LayerWeights,
                               .load_layer = LoadLayer,
                               .preset = PresetV3};

}  // namespace loom::engine
