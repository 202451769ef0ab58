#include "engine/model/families/gpt_oss.h"

#include <nlohmann/json.hpp>

#include <vector>

#include "engine/model/family.h"
#include "engine/model/transformer_impl.h"

namespace loom::engine {

at::Tensor GateUpFromInterleaved(const at::Tensor& w) {
  const at::Tensor rows = w.transpose(1, 2);  // [E, 2I, H], rows interleaved
  return at::cat({rows.slice(1, 0, rows.size(1), 2), rows.slice(1, 1, rows.size(1), 2)}, 1).contiguous();
}

at::Tensor GateUpBiasFromInterleaved(const at::Tensor& b) {
  const int64_t n = b.size(-1);
  return at::cat({b.slice(-1, 0, n, 2), b.slice(-1, 1, n, 2)}, -1).contiguous();
}

at::Tensor InterleaveGateUp(const at::Tensor& halves, int64_t dim) {
  const int64_t inter = halves.size(dim) / 2;
  // [.., I, 2, ..] with gate at 0 and up at 1, then merged: gate j lands at 2j.
  return at::stack({halves.narrow(dim, 0, inter), halves.narrow(dim, inter, inter)}, dim + 1)
      .flatten(dim, dim + 1)
      .contiguous();
}

at::Tensor DequantizeMxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype) {
  // E2M1 by code: bit 3 the sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  static const float kFp4[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  const at::Tensor lut = at::from_blob(const_cast<float*>(kFp4), {16}, at::kFloat).to(blocks.device());
  const at::Tensor b = blocks.to(at::kLong);
  const at::Tensor lo = lut.index_select(0, at::bitwise_and(b, 0x0F).reshape(-1)).view(b.sizes());
  const at::Tensor hi = lut.index_select(0, at::bitwise_right_shift(b, 4).reshape(-1)).view(b.sizes());
  std::vector<int64_t> shape = blocks.sizes().vec();  // [.., R, G, 16]
  shape.back() = 32;
  const at::Tensor values = at::stack({lo, hi}, -1).view(shape);  // low nibble first: element 2b, then 2b + 1
  // 2^(s - 127) built from its fp32 bits (exact; s = 0 is the subnormal
  // 2^-127, s = 255 overflows to inf as HF's ldexp does).
  const at::Tensor s = scales.to(at::kInt);
  const at::Tensor bits = at::where(s == 0, at::full_like(s, 0x00400000), at::bitwise_left_shift(s, 23));
  const at::Tensor out = values * bits.view(at::kFloat).unsqueeze(-1);  // exact in fp32
  shape.pop_back();
  shape.back() *= 32;  // [.., R, G * 32]
  return out.reshape(shape).to(dtype);
}

namespace {

using namespace config_json;

void Defaults(ModelConfig& c) {  // GptOssConfig's RoPE when config.json states none
  c.rope_theta = 150000.0;
  c.rope_type = "yarn";
  c.rope_factor = 32.0;
  c.yarn_beta_fast = 32.0;
  c.yarn_beta_slow = 1.0;
  c.yarn_truncate = false;
  c.rope_original_max_position = 4096;
}

// The expert and attention fields (HF GptOssConfig): every layer is MoE
// with experts of width intermediate_size; layer_types defaults to sliding
// on even layers, full on odd ones.
Status Parse(const nlohmann::json& j, ModelConfig& c) {
  if (Status s = ExpertCounts(j, "num_local_experts", &c); !s.ok()) return s;
  c.moe_intermediate_size = c.intermediate_size;
  c.norm_topk_prob = true;  // the softmax runs over the k chosen logits
  c.attention_bias = true;
  if (Status s = GetBool(j, "attention_bias", &c.attention_bias); !s.ok()) return s;
  c.qk_norm = false;
  c.sliding_window = 128;
  if (auto it = j.find("sliding_window"); it != j.end() && it->is_null()) c.sliding_window = 0;
  if (Status s = GetInt(j, "sliding_window", false, &c.sliding_window); !s.ok()) return s;
  if (c.sliding_window < 0) return Status::Invalid("config.json: 'sliding_window' must be positive or null");
  if (Status s = LayerTypes(j, AlternatingLayerTypes(c.num_hidden_layers), &c); !s.ok()) return s;
  // HF's bf16 experts clamp at 7.0 whatever the config says (only its MXFP4
  // kernels read the field), so another value has no single meaning.
  if (Status s = GetDouble(j, "swiglu_limit", &c.swiglu_limit); !s.ok()) return s;
  if (c.swiglu_limit != 7.0)
    return Status::Invalid("config.json: 'swiglu_limit' " + std::to_string(c.swiglu_limit) +
                           " is not supported (7.0, the limit HF's bf16 experts use)");
  if (auto act = j.find("hidden_act"); act != j.end() && !act->is_null() && !act->is_string())
    return Status::Invalid("config.json: 'hidden_act' must be a string");
  return Status::Ok();
}

void Write(const ModelConfig& c, nlohmann::ordered_json& j) {
  j["attention_bias"] = c.attention_bias;
  j["num_local_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["sliding_window"] = c.sliding_window > 0 ? nlohmann::ordered_json(c.sliding_window) : nlohmann::ordered_json();
  j["layer_types"] = c.layer_types;
  j["swiglu_limit"] = c.swiglu_limit;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.9;
}

Status Check(const ModelConfig& c) {
  if (Status s = CheckExperts(c); !s.ok()) return s;
  if (static_cast<int64_t>(c.layer_types.size()) != c.num_hidden_layers)
    return Status::Invalid("config.layer_types must name every layer's attention for gpt_oss");
  return Status::Ok();
}

// HF's bf16 GptOss params: experts fused and transposed ([E, in, out]).
void LayerWeights(const ModelConfig& c, int64_t layer, WeightShapes& w) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t h = c.hidden_size, e = c.num_experts, inter = c.intermediate_size;
  w.push_back({p + "self_attn.sinks", {c.num_attention_heads}});
  PostNormWeightShape(c, p, w);
  w.push_back({p + "mlp.router.weight", {e, h}});
  w.push_back({p + "mlp.router.bias", {e}});
  w.push_back({p + "mlp.experts.gate_up_proj", {e, h, 2 * inter}});
  w.push_back({p + "mlp.experts.gate_up_proj_bias", {e, 2 * inter}});
  w.push_back({p + "mlp.experts.down_proj", {e, inter, h}});
  w.push_back({p + "mlp.experts.down_proj_bias", {e, h}});
}

// Sinks and window, router and experts (permuted into moe.h's layout).
void LoadSinksAndExperts(LayerLoad& l) {
  const ModelConfig& c = l.config;
  const int64_t layer = l.index;
  const std::string& p = l.prefix;
  const WeightGetter& get = l.get;
  DecoderLayerWeights& w = l.layer;
  w.attn.sinks = get(p + "self_attn.sinks");
  w.attn.window = c.IsSlidingLayer(layer) ? c.sliding_window : 0;
  MoeWeights& m = w.moe;
  m.router = get(p + "mlp.router.weight");
  m.router_bias = get(p + "mlp.router.bias");
  m.gate_up = GateUpFromInterleaved(get(p + "mlp.experts.gate_up_proj"));
  m.gate_up_bias = GateUpBiasFromInterleaved(get(p + "mlp.experts.gate_up_proj_bias"));
  m.down = get(p + "mlp.experts.down_proj").transpose(1, 2).contiguous();  // [E, I, H] -> [E, H, I]
  m.down_bias = get(p + "mlp.experts.down_proj_bias");
  m.top_k = c.num_experts_per_tok;
  m.router_kind = MoeRouter::kTopKSoftmax;
  m.activation = MoeActivation::kClampedSwiGlu;
}

Status LoadLayer(LayerLoad& l) {
  LoadAttention(l, /*o_bias=*/true);
  LoadSinksAndExperts(l);
  return Status::Ok();
}

// tiny: one sliding layer (window 4, under the test sequences' lengths) and
// one full; 8 experts, top-2 (make-model's init makes the sinks, biases and
// expert pre-activations large enough to matter). gpt-oss-20b: the real
// shapes (bf16 experts, no MXFP4).
Result<ModelConfig> Preset(const std::string& name, std::string* default_dtype) {
  ModelConfig c;
  c.model_type = "gpt_oss";
  c.initializer_range = 0.02;
  c.rms_norm_eps = 1e-5;
  Defaults(c);
  c.attention_bias = true, c.qk_norm = false, c.tie_word_embeddings = false;
  *default_dtype = "bf16";
  if (name == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 32, c.num_hidden_layers = 2;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 16;
    c.num_experts = 8, c.num_experts_per_tok = 2, c.sliding_window = 4;
    c.max_position_embeddings = 2048, c.rope_original_max_position = 64;
    *default_dtype = "fp32";
  } else if (name == "gpt-oss-20b" || name == "gpt-oss-120b") {
    // 120b: the 20b's layer, 36 of them with 128 experts (about 234 GB in
    // bf16: several GPUs, `--tp/--ep`).
    const bool big = name == "gpt-oss-120b";
    c.vocab_size = 201088, c.hidden_size = 2880, c.intermediate_size = 2880, c.num_hidden_layers = big ? 36 : 24;
    c.num_attention_heads = 64, c.num_key_value_heads = 8, c.head_dim = 64;
    c.num_experts = big ? 128 : 32, c.num_experts_per_tok = 4, c.sliding_window = 128;
    c.max_position_embeddings = 131072, c.rope_original_max_position = 4096;
  } else {
    return Status::Invalid("preset '" + name + "' is not one of tiny, gpt-oss-20b, gpt-oss-120b");
  }
  c.moe_intermediate_size = c.intermediate_size;
  c.norm_topk_prob = true;
  c.layer_types = AlternatingLayerTypes(c.num_hidden_layers);
  return c;
}

}  // namespace

std::vector<std::string> AlternatingLayerTypes(int64_t layers) {
  std::vector<std::string> t;
  for (int64_t i = 0; i < layers; ++i) t.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  return t;
}

extern const Family kGptOssFamily;
const Family kGptOssFamily{.model_type = "gpt_oss",
                           .architecture = "GptOssForCausalLM",
                           .presets = "tiny, gpt-oss-20b, gpt-oss-120b",
                           .yarn = true,
                           .checks_hidden_act = false,
                           .norms_fp32 = true,
                           .mxfp4_experts = true,
                           .interleaved_gate_up = true,
                           .experts_in_out = true,
                           .writes_sliding = true,
                           .defaults = Defaults,
                           .parse = Parse,
                           .write = Write,
                           .check = Check,
                           .layer_weights = LayerWeights,
                           .load_layer = LoadLayer,
                           .preset = Preset};

}  // namespace loom::engine
