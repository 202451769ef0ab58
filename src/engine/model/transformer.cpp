#include "engine/model/transformer.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <utility>

#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"
#include "engine/model/families/gpt_oss.h"
#include "engine/model/family.h"
#include "engine/model/recompute.h"
#include "engine/model/rope.h"
#include "engine/model/transformer_impl.h"
#include "engine/model/unembed.h"

namespace loom::engine {
namespace {

std::string ShapeText(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t HeadDim(const ModelConfig& c) {
  return c.head_dim > 0 ? c.head_dim : (c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
}

std::string LayerPrefix(int64_t i) { return "model.layers." + std::to_string(i) + "."; }

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A family may keep its RMSNorm weights in fp32 in any model dtype (HF's
// _keep_in_fp32_modules; gpt_oss); lean_ops.h then scales in fp32. An
// expert router's correction bias is fp32 in every family (deepseek_v3).
bool KeepsFp32(const Family& f, const std::string& name) {
  return (f.norms_fp32 && EndsWith(name, "norm.weight")) || EndsWith(name, "e_score_correction_bias") ||
         EndsWith(name, "indexer.weights_proj.weight");  // HF's _keep_in_fp32_modules (glm_moe_dsa)
}

// A family whose RMSNorms scale by (1 + w) (qwen3_5_moe: HF stores w
// zero-initialised) has 1 added to those weights at load (in fp32, where
// they are kept), so every norm here scales by its weight; the Gated
// DeltaNet's output norm is a plain x * w one.
bool OffsetNorm(const Family& f, const std::string& name) {
  return f.norm_offset && EndsWith(name, "norm.weight") && !EndsWith(name, "linear_attn.norm.weight");
}

// A multimodal checkpoint's text model (qwen3_5_moe: model.language_model.*
// beside model.visual.* and an mtp.* layer): the name loom reads it by, or
// "" for a tensor it skips. Other checkpoints' names are themselves.
const std::string kWrappedText = "model.language_model.";
std::string TextName(const std::string& name) {
  if (name.rfind(kWrappedText, 0) == 0) return "model." + name.substr(kWrappedText.size());
  if (name.rfind("model.visual.", 0) == 0 || name.rfind("mtp.", 0) == 0) return "";
  return name;
}

// MXFP4 experts (a family with mxfp4_experts: gpt_oss): X_blocks and
// X_scales stand for the bf16 param X (gpt_oss.h: DequantizeMxfp4, then [E, in, out]).
bool IsMxfp4Part(const std::string& name) { return EndsWith(name, "_blocks") || EndsWith(name, "_scales"); }

// Checkpoint entries that carry no weights (old rotary caches), or weights
// loom does not use: the multi-token-prediction layers after the last one,
// and a DSA "shared" layer's indexer (it takes the choice of the full layer
// below; transformers 5.17 builds none there, earlier ports one in every layer).
bool IsIgnorable(const std::string& name, const ModelConfig& c) {
  if (EndsWith(name, "rotary_emb.inv_freq")) return true;
  if (name.rfind("model.layers.", 0) != 0) return false;
  const int64_t layer = std::atoll(name.c_str() + std::strlen("model.layers."));
  if (c.IsDsa() && layer < c.num_hidden_layers && c.DsaSource(layer) != layer &&
      name.find(".self_attn.indexer.") != std::string::npos)
    return true;
  return c.num_nextn_predict_layers > 0 && layer >= c.num_hidden_layers &&
         layer < c.num_hidden_layers + c.num_nextn_predict_layers;
}

Status ConfigError(const std::string& field, const std::string& why) {
  return Status::Invalid("config." + field + " " + why);
}

Status CheckConfig(const ModelConfig& c) {
  const Family* family = FindFamily(c.model_type);
  if (!family) return ConfigError("model_type", "'" + c.model_type + "' is not supported (" + FamilyNames() + ")");
  if (family->check)
    if (Status s = family->check(c); !s.ok()) return s;
  if (c.vocab_size <= 0) return ConfigError("vocab_size", "must be > 0");
  if (c.hidden_size <= 0) return ConfigError("hidden_size", "must be > 0");
  if (c.intermediate_size <= 0) return ConfigError("intermediate_size", "must be > 0");
  if (c.num_hidden_layers <= 0) return ConfigError("num_hidden_layers", "must be > 0");
  if (c.num_attention_heads <= 0) return ConfigError("num_attention_heads", "must be > 0");
  if (c.num_key_value_heads <= 0 || c.num_attention_heads % c.num_key_value_heads != 0)
    return ConfigError("num_key_value_heads", "must be > 0 and divide num_attention_heads");
  const int64_t hd = HeadDim(c);
  if (hd <= 0 || hd % 2 != 0) return ConfigError("head_dim", "must be a positive even number");
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1) || c.RotaryDim() % 2 != 0 || c.RotaryDim() <= 0)
    return ConfigError("partial_rotary_factor", "must be in (0, 1] with head_dim * it a positive even number");
  if (c.head_dim <= 0 && c.hidden_size % c.num_attention_heads != 0)
    return ConfigError("hidden_size", "must be a multiple of num_attention_heads when head_dim is absent");
  if (!(c.rope_theta > 0)) return ConfigError("rope_theta", "must be > 0");
  return Status::Ok();
}

}  // namespace

void LoadAttention(LayerLoad& l, bool o_bias) {
  const ModelConfig& c = l.config;
  const std::string& p = l.prefix;
  DecoderLayerWeights& w = l.layer;
  w.qkv_w = at::cat({l.get(p + "self_attn.q_proj.weight"), l.get(p + "self_attn.k_proj.weight"),
                     l.get(p + "self_attn.v_proj.weight")}, 0);
  if (c.attention_bias)
    w.qkv_b = at::cat({l.get(p + "self_attn.q_proj.bias"), l.get(p + "self_attn.k_proj.bias"),
                       l.get(p + "self_attn.v_proj.bias")}, 0);
  if (c.qk_norm) {
    w.q_norm = l.get(p + "self_attn.q_norm.weight");
    w.k_norm = l.get(p + "self_attn.k_norm.weight");
  }
  w.o_w = l.get(p + "self_attn.o_proj.weight");
  if (c.attention_bias && o_bias) w.o_b = l.get(p + "self_attn.o_proj.bias");
}

void LoadDenseMlp(LayerLoad& l) {
  const std::string& p = l.prefix;
  l.layer.gate_up_w = at::cat({l.get(p + "mlp.gate_proj.weight"), l.get(p + "mlp.up_proj.weight")}, 0);
  l.layer.down_w = l.get(p + "mlp.down_proj.weight");
}

void LoadHubExperts(LayerLoad& l) {
  std::vector<at::Tensor> gate_up, down;
  for (int64_t e = 0; e < l.config.num_experts; ++e) {
    const std::string x = l.prefix + "mlp.experts." + std::to_string(e) + ".";
    gate_up.push_back(at::cat({l.get(x + "gate_proj.weight"), l.get(x + "up_proj.weight")}, 0));
    down.push_back(l.get(x + "down_proj.weight"));
  }
  l.layer.moe.gate_up = at::stack(gate_up, 0);
  gate_up.clear();
  l.layer.moe.down = at::stack(down, 0);
}

PackedBatch PackedBatch::Make(const std::vector<std::vector<int32_t>>& seqs, const std::vector<int>& slots,
                              at::Device device, const std::vector<int>& prefix) {
  PackedBatch b;
  TORCH_CHECK(prefix.empty() || prefix.size() == seqs.size(), "packed batch: ", prefix.size(), " prefixes for ",
              seqs.size(), " sequences");
  b.seq_begin.reserve(seqs.size() + 1);
  b.seq_begin.push_back(0);
  for (const auto& s : seqs) b.seq_begin.push_back(b.seq_begin.back() + static_cast<int64_t>(s.size()));
  const int64_t total = b.seq_begin.back();
  at::Tensor tokens = at::empty({total}, at::TensorOptions().dtype(at::kLong));
  at::Tensor positions = at::empty({total}, at::TensorOptions().dtype(at::kLong));
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* pp = positions.data_ptr<int64_t>();
  int64_t k = 0;
  for (size_t j = 0; j < seqs.size(); ++j) {
    const int p = prefix.empty() ? -1 : prefix[j];
    TORCH_CHECK(p < static_cast<int>(j), "packed batch: sequence ", j, " continues a later one (", p, ")");
    const int64_t first = p < 0 ? 0 : static_cast<int64_t>(seqs[static_cast<size_t>(p)].size());
    for (size_t i = 0; i < seqs[j].size(); ++i, ++k) {
      tp[k] = seqs[j][i];
      pp[k] = first + static_cast<int64_t>(i);
    }
  }
  for (int p : prefix)
    if (p >= 0) {
      b.seq_prefix = prefix;
      break;
    }
  b.tokens = tokens.to(device);
  b.positions = positions.to(device);
  b.seq_slot = slots;
  b.seq_slot.resize(seqs.size(), -1);
  return b;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> Transformer::ExpectedWeights(const ModelConfig& c) {
  return BaseWeightShapes(c);
}

std::vector<LoraTargetSpec> Transformer::Targets(bool whole) const {
  const ModelConfig& c = config_;
  // Split over tp ranks (parallel.h): a column-split target keeps this
  // rank's rows of B (A whole, its gradient a part per rank), a row-split
  // one this rank's columns of A (B whole, likewise).
  const int64_t tp = whole ? 1 : parallel_.tp_size(), ep = whole ? 1 : parallel_.ep_size(),
                rank = whole ? 0 : parallel_.rank;
  const auto column = [&](LoraTargetSpec spec) {
    if (tp == 1) return spec;
    const int64_t part = spec.d_out / tp;
    spec.b_shard = {ShardKind::kSplit, 0, spec.d_out, rank * part};
    spec.a_shard = {ShardKind::kPartial};
    spec.d_out = part;
    return spec;
  };
  const auto row = [&](LoraTargetSpec spec) {
    if (tp == 1) return spec;
    const int64_t part = spec.d_in / tp;
    spec.a_shard = {ShardKind::kSplit, 1, spec.d_in, rank * part};
    spec.b_shard = {ShardKind::kPartial};
    spec.d_in = part;
    return spec;
  };
  const int64_t hd = HeadDim(c), h = c.hidden_size, q = c.num_attention_heads * hd, inter = c.intermediate_size;
  std::vector<LoraTargetSpec> t;
  const auto mlp = [&](const std::string& p, int64_t width) {
    t.push_back(column({p + "gate_proj", TargetGroup::kMlp, h, width}));
    t.push_back(column({p + "up_proj", TargetGroup::kMlp, h, width}));
    t.push_back(row({p + "down_proj", TargetGroup::kMlp, width, h}));
  };
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = LayerPrefix(i);
    if (c.IsMla()) {  // engine/model/mla.h
      const int64_t qk = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim);
      if (c.q_lora_rank > 0) {
        t.push_back({p + "self_attn.q_a_proj", TargetGroup::kAttn, h, c.q_lora_rank});
        t.push_back({p + "self_attn.q_b_proj", TargetGroup::kAttn, c.q_lora_rank, qk});
      } else {
        t.push_back({p + "self_attn.q_proj", TargetGroup::kAttn, h, qk});
      }
      t.push_back({p + "self_attn.kv_a_proj_with_mqa", TargetGroup::kAttn, h, c.kv_lora_rank + c.qk_rope_head_dim});
      t.push_back({p + "self_attn.kv_b_proj", TargetGroup::kAttn, c.kv_lora_rank,
                   c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)});
      t.push_back({p + "self_attn.o_proj", TargetGroup::kAttn, c.num_attention_heads * c.v_head_dim, h});
    } else if (c.IsLinearLayer(i)) {  // engine/model/gated_deltanet.h
      const int64_t v = c.linear_num_value_heads * c.linear_value_head_dim;
      t.push_back({p + "linear_attn.in_proj_qkv", TargetGroup::kAttn, h, c.LinearConvDim()});
      t.push_back({p + "linear_attn.in_proj_z", TargetGroup::kAttn, h, v});
      t.push_back({p + "linear_attn.in_proj_b", TargetGroup::kAttn, h, c.linear_num_value_heads});
      t.push_back({p + "linear_attn.in_proj_a", TargetGroup::kAttn, h, c.linear_num_value_heads});
      t.push_back({p + "linear_attn.out_proj", TargetGroup::kAttn, v, h});
    } else {
      const int64_t kvh = c.KvHeads(i), vd = c.ValueDim();
      t.push_back(column({p + "self_attn.q_proj", TargetGroup::kAttn, h, c.attn_output_gate ? 2 * q : q}));
      t.push_back(column({p + "self_attn.k_proj", TargetGroup::kAttn, h, kvh * hd}));
      t.push_back(column({p + "self_attn.v_proj", TargetGroup::kAttn, h, kvh * vd}));
      t.push_back(row({p + "self_attn.o_proj", TargetGroup::kAttn, c.num_attention_heads * vd, h}));
    }
    if (c.IsMoeLayer(i)) {  // engine/model/moe.h: the experts' fused gate_up and down
      const int64_t e = c.num_experts, mi = c.moe_intermediate_size;
      LoraTargetSpec gate_up{p + "mlp.experts.gate_up_proj", TargetGroup::kMlp, h, 2 * mi, e, ExpertFactor::kB,
                             /*hf_interleaved=*/FindFamily(c.model_type)->interleaved_gate_up};
      LoraTargetSpec down{p + "mlp.experts.down_proj", TargetGroup::kMlp, mi, h, e, ExpertFactor::kA};
      if (ep > 1) {  // this rank's experts' factors; the shared ones whole, their gradient a part per rank
        const int64_t el = e / ep;
        gate_up.experts = down.experts = el;
        gate_up.b_shard = down.a_shard = {ShardKind::kSplit, 0, e, rank * el};
        gate_up.a_shard = down.b_shard = {ShardKind::kPartial};
      }
      t.push_back(gate_up);
      t.push_back(down);
      if (c.n_shared_experts > 0) mlp(p + "mlp.shared_experts.", mi * c.n_shared_experts);
      if (c.shared_expert_intermediate_size > 0) mlp(p + "mlp.shared_expert.", c.shared_expert_intermediate_size);
      continue;
    }
    mlp(p + "mlp.", inter);
  }
  t.push_back({"lm_head", TargetGroup::kUnembed, h, c.vocab_size});
  return t;
}

Status Transformer::SplitSupport(const ModelConfig& c, int tp, int ep) {
  if (tp < 1 || ep < 1) return Status::Invalid("parallel: tp " + std::to_string(tp) + ", ep " + std::to_string(ep));
  if (ep > 1) {
    if (c.num_experts <= 0) return Status::Invalid("expert parallel " + std::to_string(ep) + ": " + c.model_type +
                                                   " has no experts");
    if (c.num_experts % ep != 0)
      return Status::Invalid("expert parallel " + std::to_string(ep) + ": " + c.model_type + " has " +
                             std::to_string(c.num_experts) + " experts, which " + std::to_string(ep) +
                             " ranks do not divide");
  }
  if (tp == 1) return Status::Ok();
  const auto refuse = [&](const std::string& what) {
    return Status::Invalid("tensor parallel " + std::to_string(tp) + ": " + c.model_type + " " + what);
  };
  if (c.IsMla()) return refuse("attends by multi-head latent attention, which does not split yet");
  if (c.attn_output_gate) return refuse("has gated attention (q_proj's gate rows), which does not split yet");
  if (c.num_attention_heads % tp != 0)
    return refuse("has " + std::to_string(c.num_attention_heads) + " attention heads, which " + std::to_string(tp) +
                  " ranks do not divide");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string layer = "layer " + std::to_string(i);
    if (c.IsLinearLayer(i)) return refuse(layer + " is a Gated DeltaNet layer, which does not split yet");
    if (c.KvHeads(i) % tp != 0)
      return refuse(layer + " has " + std::to_string(c.KvHeads(i)) + " key/value heads, which " + std::to_string(tp) +
                    " ranks do not divide");
    const int64_t width = !c.IsMoeLayer(i)                       ? c.intermediate_size
                          : c.n_shared_experts > 0               ? c.moe_intermediate_size * c.n_shared_experts
                          : c.shared_expert_intermediate_size > 0 ? c.shared_expert_intermediate_size
                                                                  : 0;
    if (width % tp != 0)
      return refuse(layer + "'s MLP is " + std::to_string(width) + " wide, which " + std::to_string(tp) +
                    " ranks do not divide");
  }
  return Status::Ok();
}

namespace {

// Rank r of n's part of layer l (parallel.h): q/k/v rows of its heads,
// o's matching columns (its bias on rank 0 only), the sinks of its heads,
// the dense MLP's (or shared experts') gate/up rows and down columns.
void SplitLayer(DecoderLayerWeights& l, int64_t heads, int64_t hd, int64_t r, int64_t n) {
  const int64_t kvh = l.kv_heads, vd = l.v_dim, hl = heads / n, kvl = kvh / n;
  const auto rows = [&](const at::Tensor& w) {  // [H hd + KVH hd + KVH vd, ...] -> this rank's heads
    if (!w.defined()) return w;
    return at::cat({w.narrow(0, r * hl * hd, hl * hd), w.narrow(0, heads * hd + r * kvl * hd, kvl * hd),
                    w.narrow(0, heads * hd + kvh * hd + r * kvl * vd, kvl * vd)})
        .contiguous();
  };
  l.qkv_w = rows(l.qkv_w);
  l.qkv_b = rows(l.qkv_b);
  l.o_w = l.o_w.narrow(1, r * hl * vd, hl * vd).contiguous();
  if (r != 0) l.o_b = at::Tensor();
  if (l.attn.sinks.defined()) l.attn.sinks = l.attn.sinks.narrow(0, r * hl, hl).contiguous();
  l.kv_heads = kvl;
  if (l.gate_up_w.defined()) {
    const int64_t inter = l.gate_up_w.size(0) / 2, il = inter / n;
    l.gate_up_w = at::cat({l.gate_up_w.narrow(0, r * il, il), l.gate_up_w.narrow(0, inter + r * il, il)}).contiguous();
    l.down_w = l.down_w.narrow(1, r * il, il).contiguous();
  }
}

// Rank r of n's experts of an MoE layer (the r-th run of E / n); the router
// stays whole.
void SplitExperts(MoeWeights& w, int64_t r, int64_t n) {
  const int64_t e = w.router.size(0), el = e / n;
  const auto part = [&](at::Tensor& t) {
    if (t.defined()) t = t.narrow(0, r * el, el).contiguous();
  };
  part(w.gate_up);
  part(w.gate_up_bias);
  part(w.down);
  part(w.down_bias);
  w.expert_begin = r * el;
}

}  // namespace

Result<std::unique_ptr<Transformer>> Transformer::FromTensors(const ModelConfig& config,
                                                              const std::map<std::string, at::Tensor>& weights,
                                                              at::Device device, at::ScalarType dtype,
                                                              const Parallel& parallel) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, tensor] : weights) {
    if (!tensor.defined()) return Status::Invalid("weight '" + name + "' has shape (undefined)");
    shapes[name] = tensor.sizes().vec();
  }
  return Build(config, shapes, [&](const std::string& name) { return weights.at(name); }, device, dtype, parallel);
}

Result<std::unique_ptr<Transformer>> Transformer::Build(const ModelConfig& config,
                                                        const std::map<std::string, std::vector<int64_t>>& shapes,
                                                        const std::function<at::Tensor(const std::string&)>& read,
                                                        at::Device device, at::ScalarType dtype,
                                                        const Parallel& parallel) {
  if (Status s = CheckConfig(config); !s.ok()) return s;
  if (Status s = SplitSupport(config, parallel.tp_size(), parallel.ep_size()); !s.ok()) return s;
  if (parallel.split() && !parallel.group) return Status::Invalid("tensor parallel: no process group");
  if (dtype != at::kFloat && dtype != at::kBFloat16)
    return Status::Invalid("dtype must be float32 or bfloat16");
  const auto expected = ExpectedWeights(config);
  std::set<std::string> wanted;
  for (const auto& [name, shape] : expected) {
    wanted.insert(name);
    auto it = shapes.find(name);
    if (it == shapes.end()) return Status::Invalid("weight '" + name + "' is missing");
    if (it->second != shape)
      return Status::Invalid("weight '" + name + "' has shape " + ShapeText(it->second) + ", expected " +
                             ShapeText(shape));
  }
  for (const auto& [name, shape] : shapes) {
    if (wanted.count(name) || IsIgnorable(name, config)) continue;
    // A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
    if (name == "lm_head.weight" && config.tie_word_embeddings) continue;
    return Status::Invalid("weight '" + name + "' is not expected by " + config.model_type + " with this config");
  }

  c10::NoGradGuard no_grad;
  const Family& family = *FindFamily(config.model_type);
  const WeightGetter get = [&](const std::string& name) {
    const at::Tensor w = read(name).detach().to(device, KeepsFp32(family, name) ? at::kFloat : dtype);
    return (OffsetNorm(family, name) ? w + 1.0 : w).contiguous();
  };
  auto impl = std::make_shared<Impl>();
  impl->heads = config.num_attention_heads;
  impl->kv_heads = config.num_key_value_heads;
  impl->head_dim = HeadDim(config);
  impl->inter = config.intermediate_size;
  impl->mla = config.IsMla();
  impl->embed = get("model.embed_tokens.weight");
  impl->norm = get("model.norm.weight");
  impl->lm_head = config.tie_word_embeddings ? impl->embed : get("lm_head.weight");
  const RopeFrequencies rope = MakeRopeFrequencies(config, config.IsMla() ? impl->head_dim : config.RotaryDim());
  impl->inv_freq = rope.inv_freq.to(device);
  impl->rope_scale = rope.scale;
  if (config.rope_theta_sliding > 0) {  // mimo_v2_flash: the sliding layers' own theta
    ModelConfig sliding = config;
    sliding.rope_theta = config.rope_theta_sliding;
    impl->inv_freq_sliding = MakeRopeFrequencies(sliding, config.RotaryDim()).inv_freq.to(device);
  }
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    Impl::Layer l;
    l.kv_heads = config.KvHeads(i);
    l.v_dim = config.ValueDim();
    l.v_scale = config.attention_value_scale;
    l.rope_sliding = impl->inv_freq_sliding.defined() && config.IsSlidingLayer(i);
    LayerLoad load{config, i, LayerPrefix(i), get, l};
    l.input_norm = get(load.prefix + "input_layernorm.weight");
    l.post_norm = get(load.prefix + "post_attention_layernorm.weight");
    if (Status s = family.load_layer(load); !s.ok()) return s;
    if (parallel.tp) SplitLayer(l, config.num_attention_heads, impl->head_dim, parallel.rank, parallel.size);
    if (parallel.ep && l.moe.defined()) SplitExperts(l.moe, parallel.rank, parallel.size);
    impl->layers.push_back(std::move(l));
  }
  if (parallel.tp) {
    impl->heads /= parallel.size;
    impl->kv_heads /= parallel.size;
    impl->inter /= parallel.size;
    impl->tp = parallel.group.get();
  }
  if (parallel.ep) impl->ep = parallel.group.get();
  std::unique_ptr<Transformer> t(new Transformer());
  t->impl_ = std::move(impl);
  t->parallel_ = parallel;
  t->config_ = config;
  t->device_ = device;
  t->dtype_ = dtype;
  return t;
}

Result<std::unique_ptr<Transformer>> Transformer::Load(const std::string& model_dir, at::Device device,
                                                       at::ScalarType dtype, const Parallel& parallel) {
  Result<ModelConfig> config = ModelConfig::Load(model_dir);
  if (!config.ok()) return config.status();
  if (Status s = CheckConfig(*config); !s.ok()) return s;
  if (Status s = SplitSupport(*config, parallel.tp_size(), parallel.ep_size()); !s.ok()) return s;
  const Family& family = *FindFamily(config->model_type);
  // Split over ranks, each tensor is read from the mapped files only when the
  // model takes it (into host memory, then its device, one layer split at a
  // time): a rank holds no more than its part plus one whole layer, in host
  // memory as on its device, however many ranks share the machine. MXFP4
  // experts are dequantized then too, one tensor at a time.
  const bool lazy = parallel.split();
  Result<ModelWeights> files = ModelWeights::Open(model_dir);
  if (!files.ok()) return files.status();
  // Check names and shapes on the mapped views first: a bad file fails
  // before any tensor is copied.
  const auto expected = ExpectedWeights(*config);
  std::map<std::string, at::Tensor> weights;
  for (const auto& [name, shape] : expected) {
    const TensorView* view = files->find(name);
    if (!view && name.rfind("model.", 0) == 0) view = files->find(kWrappedText + name.substr(6));
    if (!view && family.mxfp4_experts && files->find(name + "_blocks") && files->find(name + "_scales"))
      continue;  // MXFP4: its shape is checked once dequantized (FromTensors)
    if (!view) return Status::Invalid("weight '" + name + "' is missing from " + model_dir);
    if (view->shape != shape)
      return Status::Invalid("weight '" + name + "' has shape " + ShapeText(view->shape) + ", expected " +
                             ShapeText(shape));
  }
  std::map<std::string, const TensorView*> views;  // lazy: read when taken
  std::map<std::string, std::pair<const TensorView*, const TensorView*>> mxfp4;  // lazy: blocks, scales
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [file_name, view] : files->tensors()) {
    const std::string name = TextName(file_name);
    if (name.empty() || IsIgnorable(name, *config)) continue;
    if (name == "lm_head.weight" && config->tie_word_embeddings) continue;
    if (family.mxfp4_experts && IsMxfp4Part(name)) continue;
    if (lazy) {
      views[name] = &view;
      shapes[name] = view.shape;
      continue;
    }
    Result<at::Tensor> t = LoadTensor(view, KeepsFp32(family, name) ? at::kFloat : dtype, device);
    if (!t.ok()) return t.status();
    weights[name] = std::move(*t);
  }
  for (const auto& [name, shape] : expected) {
    if (weights.count(name) || views.count(name) || !family.mxfp4_experts) continue;
    const TensorView *blocks = files->find(name + "_blocks"), *scales = files->find(name + "_scales");
    if (!blocks || !scales) continue;
    if (blocks->dtype != "U8" || scales->dtype != "U8" || blocks->shape.size() != 4 || blocks->shape.back() != 16 ||
        std::vector<int64_t>(blocks->shape.begin(), blocks->shape.end() - 1) != scales->shape)
      return Status::Invalid("weight '" + name + "_blocks' / '_scales' are not MXFP4 ([E, R, G, 16] and [E, R, G] U8)");
    if (lazy) {  // dequantized when the model takes it: [E, R, G, 16] blocks are [E, G * 32, R] values
      mxfp4[name] = {blocks, scales};
      shapes[name] = {blocks->shape[0], blocks->shape[2] * 32, blocks->shape[1]};
      continue;
    }
    Result<at::Tensor> b = LoadTensor(*blocks, device);
    if (!b.ok()) return b.status();
    Result<at::Tensor> sc = LoadTensor(*scales, device);
    if (!sc.ok()) return sc.status();
    weights[name] = DequantizeMxfp4(*b, *sc, dtype).transpose(1, 2);
  }
  if (!lazy) return FromTensors(*config, weights, device, dtype, parallel);
  auto built = Build(
      *config, shapes,
      [&](const std::string& name) -> at::Tensor {
        if (auto it = mxfp4.find(name); it != mxfp4.end()) {
          Result<at::Tensor> b = LoadTensor(*it->second.first, at::kCPU);
          if (!b.ok()) throw std::runtime_error(b.status().message());
          Result<at::Tensor> sc = LoadTensor(*it->second.second, at::kCPU);
          if (!sc.ok()) throw std::runtime_error(sc.status().message());
          return DequantizeMxfp4(*b, *sc, dtype).transpose(1, 2);
        }
        Result<at::Tensor> t = LoadTensor(*views.at(name), KeepsFp32(family, name) ? at::kFloat : dtype, at::kCPU);
        if (!t.ok()) throw std::runtime_error(t.status().message());
        return *t;
      },
      device, dtype, parallel);
  return built;
}

std::vector<at::Tensor> Transformer::BaseWeights() const {
  const Impl& m = *impl_;
  std::vector<at::Tensor> w{m.embed, m.norm, m.lm_head};
  for (const Impl::Layer& l : m.layers)
    for (const at::Tensor& t :
         {l.input_norm, l.post_norm, l.qkv_w, l.qkv_b, l.q_norm, l.k_norm, l.o_w, l.o_b, l.attn.sinks, l.gate_up_w,
          l.down_w, l.moe.router, l.moe.router_bias, l.moe.score_bias, l.moe.gate_up, l.moe.gate_up_bias, l.moe.down,
          l.moe.down_bias, l.mla.q_w, l.mla.q_a_w, l.mla.q_a_b, l.mla.q_a_norm, l.mla.q_b_w, l.mla.kv_a_w, l.mla.kv_a_b,
          l.mla.kv_a_norm, l.mla.kv_b_w, l.mla.indexer.wq_b, l.mla.indexer.wk, l.mla.indexer.k_norm_w,
          l.mla.indexer.k_norm_b, l.mla.indexer.weights_proj, l.gdn.in_qkv_w, l.gdn.in_z_w, l.gdn.in_b_w,
          l.gdn.in_a_w, l.gdn.out_w, l.gdn.conv_w, l.gdn.A_log, l.gdn.dt_bias, l.gdn.norm_w, l.shared_gate})
      if (t.defined()) w.push_back(t);
  return w;
}

namespace {

// What every layer of one packed pass shares: the LoRA routing, the padded
// attention layout and the RoPE tables. Held by a shared_ptr so that the
// recomputed layers' backward (after Hidden has returned) still has it.
struct PassState {
  PassState(const SlotBank& bank, const PackedBatch& batch, bool attn, bool mlp)
      : delta(batch.uniform ? BatchLora(bank, *batch.uniform) : BatchLora(bank, batch.seq_begin, batch.seq_slot, attn, mlp)),
        padded(batch.uniform            ? PaddedLayout::Make(batch.seq_begin, batch.tokens.device())
               : batch.seq_prefix.empty() ? PaddedLayout::IfPreferred(batch.seq_begin, batch.tokens.device())
                                          : PaddedLayout{}) {}
  BatchLora delta;
  PaddedLayout padded;
  Rope rope;
  ExpertLoraRouting experts;  // MoE models whose batch trains the mlp group
  std::vector<std::vector<at::Tensor>> dsa;  // DSA models: each indexing layer's choice per sequence (dsa.h)
};

// The LoRA leaves layer i's graph reaches for the groups this pass trains.
std::vector<at::Tensor> LayerLeaves(const SlotBank& bank, size_t layer, bool attn, bool mlp) {
  std::vector<at::Tensor> leaves;
  const auto [gate_up, down] = ExpertTargets(bank, layer);
  const bool experts = gate_up != nullptr;
  for (int k = 0; k < kNumLayerTargets; ++k) {
    const LoraTarget* t = LayerTarget(bank, layer, k);
    if (!t || !(t->group == TargetGroup::kAttn ? attn : mlp)) continue;
    leaves.push_back(t->A);
    leaves.push_back(t->B);
  }
  if (experts && mlp)
    for (const LoraTarget* t : {gate_up, down}) {
      leaves.push_back(t->A);
      leaves.push_back(t->B);
    }
  return leaves;
}

}  // namespace

at::Tensor Transformer::Hidden(const PackedBatch& batch, const SlotBank& bank, int64_t recompute_layers) const {
  const Impl& m = *impl_;
  const double eps = config_.rms_norm_eps;

  const bool attn_lora = batch.uniform ? batch.uniform->attn_on : AnyTrains(bank, batch.seq_slot, TargetGroup::kAttn);
  const bool mlp_lora = batch.uniform ? batch.uniform->mlp_on : AnyTrains(bank, batch.seq_slot, TargetGroup::kMlp);
  // The routing is planned once per target group for the batch, and one
  // batched attention per layer replaces one per sequence where cheaper.
  auto state = std::make_shared<PassState>(bank, batch, attn_lora, mlp_lora);
  // A recomputed layer's backward runs its own graph, which would reach the flush token early.
  state->delta.set_pass_grads(recompute_layers <= 0);
  state->rope = Rope::Make(m, batch.positions, dtype_);
  if (mlp_lora && config_.num_experts > 0)
    state->experts = ExpertLoraRouting::Make(bank, batch.seq_begin, batch.seq_slot, batch.tokens.device());
  if (config_.IsDsa()) state->dsa.resize(m.layers.size());
  // A training pass's plain attention on the varlen flash kernel unless its
  // shape recurs (attention.h: cuDNN's plans cost more than they save on
  // shapes that change with every batch). Not the uniform layout's passes:
  // their shapes are a few buckets, and they may be captured as CUDA graphs,
  // where the kernel's offsets could not be copied to the device.
  if (!batch.seq_prefix.empty()) {
    TORCH_CHECK(config_.SharesPrefixes() && !batch.uniform,
                "a packed batch with shared prefixes on a model whose layers cannot see past a sequence's start");
    // Shared prefixes take the varlen flash kernel wherever it runs (cuDNN's
    // fused kernel has no form for keys that differ from the queries).
    const bool varlen = attention_kernel_ == AttentionKernel::kSdpa && VariantFlashAvailable() &&
                        batch.tokens.is_cuda() && (dtype_ == at::kBFloat16 || dtype_ == at::kHalf);
    state->padded = PaddedLayout::Shared(batch.seq_begin, batch.seq_prefix, batch.tokens.device(), varlen);
  } else if (at::GradMode::is_enabled() && !batch.uniform && !config_.IsDsa() &&
             attention_kernel_ == AttentionKernel::kSdpa)
    if (TrainOnVarlenFlash(batch.seq_begin, config_.num_attention_heads, config_.num_key_value_heads,
                           config_.head_dim, batch.tokens.device(), dtype_))
      state->padded.SetVarlen(batch.seq_begin, batch.tokens.device());
  const AttentionKernel kernel = attention_kernel_;
  const std::vector<int64_t>& seq_begin = batch.seq_begin;
  // One layer of this pass. It reads only the pass state, the frozen weights
  // and the bank's factors, all alive until the backward is done (the
  // engine runs the backward inside its forward_backward call).
  auto layer = [&m, &bank, &seq_begin, state, kernel, eps, attn_lora, mlp_lora](size_t i, const at::Tensor& x) {
    auto lora = [&](size_t l, std::initializer_list<int> ks, const at::Tensor& in, const at::Tensor& w,
                    const at::Tensor& b, bool on) { return state->delta.Project(l, ks, in, w, b, on); };
    auto attend = [&](size_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
                      const DsaIndex* index) {
      if (const DsaIndexerWeights& dsa = m.layers[l].mla.indexer; dsa.defined())
        return DsaPackedAttention(q, k, v, seq_begin, kernel, state->padded.get(), dsa, index, l, state->dsa);
      return PackedCausalAttention(q, k, v, seq_begin, kernel, state->padded.get(), &m.layers[l].attn);
    };
    auto moe = [&](size_t l, const at::Tensor& h) {
      const auto [gate_up, down] = ExpertTargets(bank, l);
      return MoeForward(m.layers[l].moe, h, bank, gate_up, down, &state->experts);
    };
    auto mix = [&](size_t l, const at::Tensor& mixed, const at::Tensor& a, const at::Tensor& b) {
      return GdnMix(m.layers[l].gdn, mixed, a, b, seq_begin).out;
    };
    return DecoderLayer(m, i, x, state->rope, eps, attn_lora, mlp_lora, lora, attend, moe, mix);
  };
  at::Tensor x = at::embedding(m.embed, batch.tokens);
  const bool recompute = c10::GradMode::is_enabled() && (attn_lora || mlp_lora);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    if (recompute && static_cast<int64_t>(i) < recompute_layers) {
      auto fn = std::make_shared<const LayerFn>([layer, i](const at::Tensor& in) { return layer(i, in); });
      x = RecomputedLayer(std::move(fn), x, LayerLeaves(bank, i, attn_lora, mlp_lora));
    } else {
      x = layer(i, x);
    }
  }
  return FinalNorm(m, x, eps);
}

at::Tensor Transformer::TargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets, const PackedBatch& batch,
                                       const SlotBank& bank, int64_t chunk_tokens, UnembedMode mode) const {
  if (batch.uniform) {
    const LoraTarget* t = bank.find("lm_head");
    const int64_t len = batch.seq_begin.size() > 1 ? batch.seq_begin[1] : 1;
    const int64_t chunk = std::max<int64_t>(1, chunk_tokens / len) * len;  // whole sequences
    if (t && batch.uniform->unembed_on)
      return UniformTargetLogprobs(hidden, targets, impl_->lm_head, t->A, t->B, batch.uniform->unembed, chunk, mode);
    return ChunkedTargetLogprobs(hidden, targets, impl_->lm_head, UnembedSpec{}, chunk, mode);
  }
  UnembedSpec spec = MakeUnembedSpec(bank, batch.seq_begin, batch.seq_slot);
  return ChunkedTargetLogprobs(hidden, targets, impl_->lm_head, spec, chunk_tokens, mode);
}

at::Tensor Transformer::Logits(const at::Tensor& hidden, const PackedBatch& batch, const SlotBank& bank) const {
  at::Tensor logits = at::linear(hidden.to(dtype_), impl_->lm_head).to(at::kFloat);
  const LoraTarget* t = bank.find("lm_head");
  if (t && bank.Uses(*t, batch.seq_slot)) logits = logits + bank.Delta(*t, hidden, batch.seq_begin, batch.seq_slot);
  return logits;
}

}  // namespace loom::engine
