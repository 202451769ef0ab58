// Transformer::Impl: the frozen base weights in the layout the forward
// passes use, and the decoder-layer math both forwards share. Private to
// engine/model (transformer.cpp: the packed forward; transformer_decode.cpp:
// the KV-cached forward of the sampler).
//
// Threading: read-only after Load; any thread may read it.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "engine/lora/lora_nodes.h"
#include "engine/model/attention.h"
#include "engine/model/config.h"
#include "engine/model/gated_deltanet.h"
#include "engine/model/lean_ops.h"
#include "engine/model/mla.h"
#include "engine/model/moe.h"
#include "engine/model/parallel.h"
#include "engine/model/transformer.h"

namespace loom::engine {

// Indices of kLayerTargets (below) beyond the dense seven: MLA's, deepseek's
// shared experts, a Gated DeltaNet layer's, qwen3_5_moe's shared expert.
inline constexpr int kTargetQa = 7, kTargetQb = 8, kTargetKvA = 9, kTargetKvB = 10, kTargetSharedGate = 11;
inline constexpr int kTargetGdnQkv = 14, kTargetGdnZ = 15, kTargetGdnB = 16, kTargetGdnA = 17, kTargetGdnOut = 18;
inline constexpr int kTargetSharedExpertGate = 19;

// One decoder layer's frozen weights in the layout the forwards use. q/k/v
// and gate/up are stored fused (one matmul each per layer); their LoRA
// deltas are added to the matching slices.
struct DecoderLayerWeights {
  at::Tensor input_norm, post_norm;
  at::Tensor qkv_w, qkv_b;  // [(H + 2 KVH) * hd, hidden]; bias may be undefined
  at::Tensor q_norm, k_norm;  // [hd] (qwen3) or undefined
  at::Tensor o_w;             // [hidden, H * hd]
  at::Tensor o_b;             // [hidden] (qwen3 with attention_bias, gpt_oss) or undefined
  AttentionVariant attn;      // gpt_oss: sinks and the sliding window (attention.h); plain otherwise
  at::Tensor gate_up_w;       // [2 * inter, hidden]: the dense MLP, or an MoE layer's shared experts (or undefined)
  at::Tensor down_w;          // [hidden, inter]
  MoeWeights moe;             // an MoE layer's router and experts (moe.h); undefined when dense
  MlaWeights mla;             // multi-head latent attention (mla.h) in place of qkv_w and the rest; or undefined
  GdnWeights gdn;             // a Gated DeltaNet layer (gated_deltanet.h) in place of the attention; or undefined
  bool gated_q = false;       // q_proj's rows per head are [query | gate], the output times sigmoid(gate) (qwen3_5_moe)
  at::Tensor shared_gate;     // [1, hidden]: the shared expert's output times sigmoid(h shared_gate^T) (qwen3_5_moe), or undefined
  int shared_target = kTargetSharedGate;  // kLayerTargets index of the shared experts' gate_proj (or kTargetSharedExpertGate)
  int64_t kv_heads = 0, v_dim = 0;  // this layer's key/value heads and value width (ModelConfig::KvHeads, ValueDim)
  double v_scale = 0;               // values times this after the projection (mimo_v2_flash; 0: none)
  bool rope_sliding = false;        // RoPE from the sliding layers' tables (Rope::cos_sliding)
};

// A base weight by its HF name, on the model's device in the model dtype
// (fp32 for the norms of a family that keeps them so).
using WeightGetter = std::function<at::Tensor(const std::string& name)>;

// What a family's load_layer (family.h) maps: layer `index` of `config`,
// its tensors by name through `get`, into `layer` (its norms already set).
struct LayerLoad {
  const ModelConfig& config;
  int64_t index;
  std::string prefix;  // "model.layers.{index}."
  const WeightGetter& get;
  DecoderLayerWeights& layer;
};

// The shared blocks' loaders: the fused q/k/v (with biases when
// attention_bias), o (its bias when attention_bias and o_bias), the q/k
// norms when qk_norm; a dense SwiGLU MLP (fused gate/up, down).
void LoadAttention(LayerLoad& l, bool o_bias);
void LoadDenseMlp(LayerLoad& l);
// An MoE layer's experts from the hub's one tensor per expert and projection
// (mlp.experts.{e}.gate_proj/up_proj/down_proj), stacked as HF 5 fuses them:
// gate_up [E, 2I, H] (gate rows first), down [E, H, I]; router and routing
// settings are the family's.
void LoadHubExperts(LayerLoad& l);

// The frozen base weights.
struct Transformer::Impl {
  using Layer = DecoderLayerWeights;
  at::Tensor embed;    // [vocab, hidden]
  at::Tensor norm;     // [hidden]
  at::Tensor lm_head;  // [vocab, hidden]; aliases embed when tied
  at::Tensor inv_freq; // [rotary dim / 2] fp32
  at::Tensor inv_freq_sliding;  // the sliding layers' own (mimo_v2_flash), or undefined
  double rope_scale = 1.0;  // YaRN's attention factor on cos and sin (1: plain RoPE)
  std::vector<Layer> layers;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, inter = 0;  // this rank's part when split (parallel.h)
  bool mla = false;  // the layers attend by MLA (head_dim is then its RoPE width)
  Collective* tp = nullptr;  // the ranks the attention and dense MLPs are split over; null: whole
  Collective* ep = nullptr;  // the ranks each MoE layer's experts are split over; null: whole
};

// RMSNorm as Hugging Face computes it (lean_ops.h): normalise in fp32,
// cast back to the input dtype, then scale by the weight; under grad mode
// the node keeps x and 1/rms only.
inline at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormLean(x, weight, eps);
}

// The layer's LoRA targets as module-path suffixes: a dense layer's seven
// in LoraTargets() order, then MLA's projections (mla.h) and an MoE layer's
// shared experts.
inline constexpr const char* kLayerTargets[] = {
    "self_attn.q_proj",   "self_attn.k_proj",   "self_attn.v_proj",           "self_attn.o_proj",
    "mlp.gate_proj",      "mlp.up_proj",        "mlp.down_proj",              "self_attn.q_a_proj",
    "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "mlp.shared_experts.gate_proj",
    "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
    "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.out_proj", "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"};
inline constexpr int kNumLayerTargets = sizeof(kLayerTargets) / sizeof(kLayerTargets[0]);

// The bank's target for the layer's k-th LoRA target (kLayerTargets). Bank
// targets are expected in LoraTargets() order (7 per dense layer); lookup by
// name is the fallback (models with MoE layers, whose MLP targets are the
// experts': ExpertTargets).
inline const LoraTarget* LayerTarget(const SlotBank& bank, size_t layer, int k) {
  const std::string module = "model.layers." + std::to_string(layer) + "." + kLayerTargets[k];
  const size_t index = layer * 7 + static_cast<size_t>(k);
  const auto& ts = bank.targets();
  if (k < 7 && index < ts.size() && ts[index].module == module) return &ts[index];
  return bank.find(module);
}

// The bank's expert targets of MoE layer `layer` (gate_up, down), or nulls.
inline std::pair<const LoraTarget*, const LoraTarget*> ExpertTargets(const SlotBank& bank, size_t layer) {
  const std::string p = "model.layers." + std::to_string(layer) + ".mlp.experts.";
  return {bank.find(p + "gate_up_proj"), bank.find(p + "down_proj")};
}

// Whether any of the slots trains group g (else its LoRA is skipped entirely).
inline bool AnyTrains(const SlotBank& bank, const std::vector<int>& slots, TargetGroup g) {
  for (int s : slots)
    if (bank.trains(s, g)) return true;
  return false;
}

// The LoRA deltas of one packed batch (rows routed to slots by seg_begin /
// seg_slot). Many slots' LoRA runs in a fixed number of kernels where that
// is cheaper (SlotBank::ChooseForm): the form and its routing are chosen once
// per target group for the whole batch and shared by every target of the
// group in every layer. delta(t, x) is in x's dtype.
class BatchLora {
 public:
  BatchLora(const SlotBank& bank, const std::vector<int64_t>& seg_begin, const std::vector<int>& seg_slot,
            bool attn, bool mlp)
      : bank_(bank), seg_begin_(seg_begin), seg_slot_(seg_slot) {
    if (attn) Plan(TargetGroup::kAttn, attn_);
    if (mlp) Plan(TargetGroup::kMlp, mlp_);
  }
  // Whether a pass's few grouped slots write their gradients into one buffer
  // per group, added into the bank once at the end of the backward
  // (SlotBank::PassGroup): only where no layer is recomputed.
  void set_pass_grads(bool on) { pass_grads_ = on; }
  // The uniform layout's routing (transformer.h, UniformLora): the grouped
  // form with the given device-side groups, planned nothing on the host.
  BatchLora(const SlotBank& bank, const UniformLora& u) : bank_(bank), seg_begin_(none_), seg_slot_(none_slots_) {
    attn_.form = mlp_.form = LoraForm::kGrouped;
    attn_.grouped = u.attn;
    mlp_.grouped = u.mlp;
  }
  at::Tensor operator()(const LoraTarget* t, const at::Tensor& x) const {
    const Group& p = t->group == TargetGroup::kAttn ? attn_ : mlp_;
    switch (p.form) {
      case LoraForm::kRouted: return bank_.RoutedDelta(*t, x, p.routed).to(x.scalar_type());
      case LoraForm::kGrouped: return bank_.GroupedDelta(*t, x, p.grouped, Pass(p, x)).to(x.scalar_type());
      case LoraForm::kSegment: break;
    }
    return bank_.Delta(*t, x, seg_begin_, seg_slot_).to(x.scalar_type());
  }
  // The deltas of layer `layer`'s targets ks (kLayerTargets indices; targets
  // of one group that all read x) side by side, [T, sum d_out] in x's dtype:
  // the cat of operator()'s. Where the group's slots' factors are cast for
  // the pass, one node (JointGroupedLoraDelta) writes them into one tensor
  // and gives x one gradient, where the cat would copy and autograd add per
  // target; rows not already in padded order are gathered once for all the
  // targets, not once per target.
  at::Tensor Joint(size_t layer, std::initializer_list<int> ks, const at::Tensor& x) const {
    const std::vector<const LoraTarget*> ts = Targets(layer, ks);
    const Group& p = ts[0]->group == TargetGroup::kAttn ? attn_ : mlp_;
    if (p.form == LoraForm::kGrouped && ts.size() > 1) {
      if (const PassFactors* pass = Pass(p, x)) {
        std::vector<JointTarget> joint;
        for (const LoraTarget* t : ts) joint.push_back(bank_.CastFactors(*t, *pass));
        return JointGroupedLoraDelta(x, joint, p.grouped, bank_.ComputeType(x), pass->token).to(x.scalar_type());
      }
    }
    if (ts.size() == 1) return (*this)(ts[0], x);
    std::vector<at::Tensor> parts;
    for (const LoraTarget* t : ts) parts.push_back((*this)(t, x));
    return at::cat(parts, 1);
  }

  // The projection of layer `layer`'s targets ks (their fused base weight
  // [sum d_out, d_in] and bias, or undefined) and, with `on`, its LoRA:
  // {base, deltas} as at::linear and Joint give them, for the caller to add
  // (fused into its next kernel where it can). On CUDA, in a recorded pass
  // whose group has its factors cast once and its rows in padded order or
  // ragged (LoraGroups), one node instead (ProjectedJointLora): {base +
  // deltas, undefined}, the deltas accumulated into the base GEMM's output
  // and x's gradient into the base's (ragged rows: added to them).
  std::pair<at::Tensor, at::Tensor> Project(size_t layer, std::initializer_list<int> ks, const at::Tensor& x,
                                            const at::Tensor& weight, const at::Tensor& bias, bool on) const {
    if (!on) return {at::linear(x, weight, bias), at::Tensor()};
    const std::vector<const LoraTarget*> ts = Targets(layer, ks);
    const Group& p = ts[0]->group == TargetGroup::kAttn ? attn_ : mlp_;
    if (x.is_cuda() && c10::GradMode::is_enabled() && ts[0]->A.requires_grad() &&
        bank_.ComputeType(x) == x.scalar_type()) {
      const LoraGroups* routing = Unpadded(p, ts[0]->group);
      if (const PassFactors* pass = routing ? Pass(p, x) : nullptr) {
        std::vector<JointTarget> joint;
        for (const LoraTarget* t : ts) joint.push_back(bank_.CastFactors(*t, *pass));
        return {ProjectedJointLora(x, weight, bias, joint, *routing, pass->token), at::Tensor()};
      }
    }
    return {at::linear(x, weight, bias), Joint(layer, ks, x)};
  }

 private:
  std::vector<const LoraTarget*> Targets(size_t layer, std::initializer_list<int> ks) const {
    std::vector<const LoraTarget*> ts;
    for (int k : ks) ts.push_back(LayerTarget(bank_, layer, k));
    return ts;
  }
  struct Group {
    LoraForm form = LoraForm::kSegment;
    LoraRouting routed;
    mutable LoraGroups grouped;    // the segment form's one-slot identity too (Identity)
    mutable bool single_made = false;
    mutable PassFactors pass;  // the grouped slots' factors in the compute type, made at first use (Pass)
  };
  // Few grouped slots' factors are cast once for the pass (SlotBank::PassGroup):
  // each target then needs no gather and cast of its own (4 kernels a use, as
  // many again in the backward), and, in a pass with a gradient buffer, writes
  // its gradients there (2 kernels a factor fewer; one flush per group).
  // Up to SlotBank::kCastOncePerPassUpTo slots (the copies are about 132 MB
  // a slot on qwen3-4b at rank 32, as much again for the gradient buffer;
  // the engine's plan leaves room for those past its probes' two); beyond,
  // each target gathers its own.
  const PassFactors* Pass(const Group& p, const at::Tensor& x) const {
    const int64_t U = p.grouped.num_slots();
    if (U == 0 || U > SlotBank::kCastOncePerPassUpTo) return nullptr;
    const TargetGroup g = &p == &attn_ ? TargetGroup::kAttn : TargetGroup::kMlp;
    // An MoE model's mlp group is mostly its experts' factors (GiBs a slot at
    // real shapes), which only its dense layers' few targets would read here.
    if (bank_.GroupHasExperts(g)) return nullptr;
    if (!p.pass.cast.defined() || p.pass.cast.scalar_type() != bank_.ComputeType(x))
      p.pass = bank_.PassGroup(g, p.grouped.slots, bank_.ComputeType(x), pass_grads_ && c10::GradMode::is_enabled());
    return &p.pass;
  }
  // The group's routing where the grouped form runs over the rows as they
  // are (an identity: rows in padded order; or ragged; every row in a
  // group), for Project; null where it does not. A segment-form group of one
  // slot over every row is an identity too (U = 1): its routing is made at
  // first use.
  const LoraGroups* Unpadded(const Group& p, TargetGroup g) const {
    if (p.form == LoraForm::kSegment && !p.single_made) {
      p.single_made = true;
      LoraGroups one = bank_.Group(g, seg_begin_, seg_slot_);
      if (one.num_slots() == 1 && one.identity && !one.base_rows) p.grouped = std::move(one);
    }
    if (p.form == LoraForm::kRouted || p.grouped.num_slots() == 0) return nullptr;
    return (p.grouped.identity || p.grouped.ragged) && !p.grouped.base_rows ? &p.grouped : nullptr;
  }
  bool pass_grads_ = false;
  void Plan(TargetGroup g, Group& p) {
    p.form = bank_.ChooseForm(g, seg_begin_, seg_slot_);
    if (p.form == LoraForm::kRouted) p.routed = bank_.Route(g, seg_begin_, seg_slot_);
    if (p.form == LoraForm::kGrouped) p.grouped = bank_.Group(g, seg_begin_, seg_slot_);
  }
  const std::vector<int64_t> none_;
  const std::vector<int> none_slots_;
  const SlotBank& bank_;
  const std::vector<int64_t>& seg_begin_;
  const std::vector<int>& seg_slot_;
  Group attn_, mlp_;
};

// RoPE tables for a batch's positions [T]: cos and sin [T, 1, hd] in the
// model dtype (computed in fp32, scaled by rope_scale when YaRN's, then
// cast, as HF does).
struct Rope {
  at::Tensor cos, sin;
  at::Tensor cos32, sin32;  // MLA models: the same tables in fp32 (mla.h rotates in fp32, as HF)
  at::Tensor cos_sliding, sin_sliding;  // the sliding layers' (Model::inv_freq_sliding), or undefined
  template <typename Model>
  static Rope Make(const Model& m, const at::Tensor& positions, at::ScalarType dtype) {
    const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(1) * m.inv_freq.unsqueeze(0);  // [T, hd/2]
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    if (m.mla) return Rope{{}, {}, (emb.cos() * m.rope_scale).unsqueeze(1), (emb.sin() * m.rope_scale).unsqueeze(1)};
    Rope r = m.rope_scale != 1.0 ? Rope{(emb.cos() * m.rope_scale).to(dtype).unsqueeze(1),
                                        (emb.sin() * m.rope_scale).to(dtype).unsqueeze(1)}
                                 : Rope{emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)};
    if (m.inv_freq_sliding.defined()) {
      const at::Tensor f = positions.to(at::kFloat).unsqueeze(1) * m.inv_freq_sliding.unsqueeze(0);
      const at::Tensor e = at::cat({f, f}, -1);
      r.cos_sliding = e.cos().to(dtype).unsqueeze(1);
      r.sin_sliding = e.sin().to(dtype).unsqueeze(1);
    }
    return r;
  }
};

// Decoder layer i over token rows x [T, hidden]. The two forwards differ
// only in how a layer attends and how LoRA is applied, so both are
// arguments:
//   lora(layer, {k...}, in, W, b, on)
//                             the projection of input rows `in` onto the
//                             layer's targets k... (kLayerTargets; fused
//                             weight W and bias b) and, with `on`, their
//                             LoRA: {base, deltas} or {base + deltas,
//                             undefined} (BatchLora::Project);
//   attend(layer, q, k, v, latent, index)
//                             attention [T, H * dv] for post-RoPE q [T, H, hd]
//                             and k [T, KVH, hd], v [T, KVH, dv] (dv = hd but
//                             in MLA layers); latent: an MLA layer's rows
//                             [T, R + dr] for the sampler's cache (mla.h),
//                             undefined otherwise; index: the rows' DSA
//                             indexer (dsa.h) where the layer runs its own,
//                             else null (a shared DSA layer's attend takes
//                             the choice of its indexer.source layer);
//   moe(layer, h)             an MoE layer's block output [T, hidden] for its
//                             normed rows h (MoeForward with the batch's
//                             expert LoRA);
//   mix(layer, mixed, a, b)   a Gated DeltaNet layer's token mixing [T, Hv, dv]
//                             for its rows' projections (GdnMix over the
//                             pass's sequences; the sampler over their
//                             cached rows too).
// Invariant: the op order and dtypes are the same for every caller, so a token
// gets the same hidden state from either forward (to float rounding).
// (Model is Transformer::Impl, deduced: the type is private to Transformer.)
template <typename Model, typename Lora, typename Attend, typename Moe, typename Mix>
at::Tensor DecoderLayer(const Model& m, size_t i, at::Tensor x, const Rope& rope, double eps, bool attn_lora,
                        bool mlp_lora, Lora&& lora, Attend&& attend, Moe&& moe, Mix&& mix) {
  const int64_t hd = m.head_dim;
  const auto& l = m.layers[i];
  // Attention block. Split over ranks (parallel.h), each rank attends with
  // its heads: the normed rows' gradient is summed over the ranks, and the
  // output projection's parts are summed in finish.
  at::Tensor h = TpEnter(RmsNorm(x, l.input_norm, eps), m.tp);
  // The projection of targets ks with its LoRA added (where Project left it apart).
  const auto project = [&](std::initializer_list<int> ks, const at::Tensor& in, const at::Tensor& w,
                           const at::Tensor& b, bool on) {
    auto [y, delta] = lora(i, ks, in, w, b, on);
    return delta.defined() ? y + delta : y;
  };
  // A dense SwiGLU (the layer's MLP, or an MoE layer's shared experts) on
  // normed rows; split over ranks, each rank's part of the width, summed.
  const auto dense_mlp = [&](int gate, const at::Tensor& in) {
    const at::Tensor act =
        SwiGluLean(project({gate, gate + 1}, TpEnter(in, m.tp), l.gate_up_w, at::Tensor(), mlp_lora));
    return TpLeave(project({gate + 2}, act, l.down_w, at::Tensor(), mlp_lora), m.tp);
  };
  // The MLP block after the attention: SwiGLU, or the experts' with any shared experts.
  const auto mlp_block = [&](const at::Tensor& in) {
    if (!l.moe.defined()) return dense_mlp(4, in);
    // Experts split over ranks: each rank's experts' share of every token, summed.
    const at::Tensor y = TpLeave(moe(i, TpEnter(in, m.ep)), m.ep);
    if (!l.gate_up_w.defined()) return y;
    const at::Tensor shared = dense_mlp(l.shared_target, in);
    return y + (l.shared_gate.defined() ? at::sigmoid(at::linear(in, l.shared_gate)) * shared : shared);
  };
  // The block's output projection (target `out`), the residual add with the
  // MLP block's norm (one kernel each way on CUDA), and the MLP block.
  const auto finish = [&](int out, const at::Tensor& rows, const at::Tensor& w, const at::Tensor& b) {
    const auto [o, o_delta] = lora(i, {out}, rows, w, b, attn_lora);
    if (m.tp != nullptr) {
      std::tie(x, h) = AddRmsNormLean(x, TpLeave(o_delta.defined() ? o + o_delta : o, m.tp), at::Tensor(),
                                      l.post_norm, eps);
    } else {
      std::tie(x, h) = AddRmsNormLean(x, o, o_delta, l.post_norm, eps);
    }
    return x + mlp_block(h);
  };
  if (l.gdn.defined()) {  // Gated DeltaNet (gated_deltanet.h)
    const GdnWeights& g = l.gdn;
    const int64_t T = h.size(0);
    const at::Tensor mixed = project({kTargetGdnQkv}, h, g.in_qkv_w, at::Tensor(), attn_lora);
    const at::Tensor z = project({kTargetGdnZ}, h, g.in_z_w, at::Tensor(), attn_lora);
    const at::Tensor b = project({kTargetGdnB}, h, g.in_b_w, at::Tensor(), attn_lora);
    const at::Tensor a = project({kTargetGdnA}, h, g.in_a_w, at::Tensor(), attn_lora);
    const at::Tensor core = mix(i, mixed, a, b);  // [T, Hv, dv]
    const at::Tensor y = GatedRmsNorm(core, z.view({T, g.value_heads, g.value_dim}), g.norm_w, eps)
                             .reshape({T, g.value_heads * g.value_dim});
    return finish(kTargetGdnOut, y, g.out_w, at::Tensor());
  }
  if (l.gated_q) {  // q_proj's rows per head [query | gate]; the output gated (qwen3_5_moe)
    const int64_t T = h.size(0), H = m.heads, kvh = l.kv_heads;
    const at::Tensor qkv = project({0, 1, 2}, h, l.qkv_w, l.qkv_b, attn_lora);
    const at::Tensor qg = qkv.narrow(1, 0, 2 * H * hd).view({T, H, 2 * hd});
    const at::Tensor gate = qg.narrow(2, hd, hd).reshape({T, H * hd});
    const at::Tensor plain = at::cat({qg.narrow(2, 0, hd).reshape({T, H * hd}), qkv.narrow(1, 2 * H * hd, 2 * kvh * hd)}, 1);
    const QkvHeads heads = QkvTailLean(plain, at::Tensor(), l.q_norm, l.k_norm, rope.cos, rope.sin, H, kvh, hd, eps);
    return finish(3, attend(i, heads.q, heads.k, heads.v, at::Tensor(), nullptr) * at::sigmoid(gate), l.o_w, l.o_b);
  }
  if (l.mla.defined()) {
    const MlaWeights& a = l.mla;
    const int64_t T = h.size(0), H = a.heads;
    const at::Tensor q_resid =  // q's compressed rows (q compression only)
        a.q_w.defined() ? at::Tensor() : RmsNorm(project({kTargetQa}, h, a.q_a_w, a.q_a_b, attn_lora), a.q_a_norm, MlaWeights::kNormEps);
    const at::Tensor q = (a.q_w.defined() ? project({0}, h, a.q_w, at::Tensor(), attn_lora)
                                          : project({kTargetQb}, q_resid, a.q_b_w, at::Tensor(), attn_lora))
                             .view({T, H, a.qk()});
    const bool indexes = a.indexer.defined() && a.indexer.source == static_cast<int64_t>(i);
    const DsaIndex index = indexes ? DsaIndexRows(a.indexer, h, q_resid, rope.cos32, rope.sin32) : DsaIndex{};
    const at::Tensor kv_a = project({kTargetKvA}, h, a.kv_a_w, a.kv_a_b, attn_lora);
    const at::Tensor c = RmsNorm(kv_a.narrow(1, 0, a.rank).contiguous(), a.kv_a_norm, MlaWeights::kNormEps);
    const at::Tensor k_rope = MlaRope(kv_a.narrow(1, a.rank, a.rope).unsqueeze(1), rope.cos32, rope.sin32, a.interleave);
    const at::Tensor kv = project({kTargetKvB}, c, a.kv_b_w, at::Tensor(), attn_lora).view({T, H, a.nope + a.v});
    at::Tensor qf = at::cat({q.narrow(-1, 0, a.nope), MlaRope(q.narrow(-1, a.nope, a.rope), rope.cos32, rope.sin32,
                                                               a.interleave)}, -1);
    // The attention paths scale by 1/sqrt(dn + dr); a larger scale goes into q.
    const double extra = a.scale * std::sqrt(static_cast<double>(a.qk()));
    if (std::abs(extra - 1.0) > 1e-12) qf = qf * extra;
    const at::Tensor k = at::cat({kv.narrow(-1, 0, a.nope), k_rope.expand({T, H, a.rope})}, -1);
    const at::Tensor attn = attend(i, qf, k, kv.narrow(-1, a.nope, a.v), at::cat({c, k_rope.squeeze(1)}, -1),
                                   indexes ? &index : nullptr);
    return finish(3, attn, l.o_w, l.o_b);
  }
  // The LoRA deltas are added to the fused projection before it is split,
  // never to the split views: q/k/v (and gate/up below) are then views of
  // one [T, n] tensor on both paths. Adding to a view makes a contiguous
  // copy, and ATen's elementwise and reduction kernels round differently on
  // strided and contiguous inputs (vector body vs scalar tail, which also
  // depends on the CPU's vector width), so a zero delta would not give the
  // base's bits.
  const auto [qkv, delta] = lora(i, {0, 1, 2}, h, l.qkv_w, l.qkv_b, attn_lora);
  // Split into heads, q/k norms (qwen3) and RoPE: one kernel on CUDA.
  const QkvHeads heads =
      QkvTailLean(qkv, delta, l.q_norm, l.k_norm, l.rope_sliding ? rope.cos_sliding : rope.cos,
                  l.rope_sliding ? rope.sin_sliding : rope.sin, m.heads, l.kv_heads, hd, eps, l.v_dim);
  const at::Tensor &q = heads.q, &k = heads.k;
  const at::Tensor v = l.v_scale != 0 ? heads.v * l.v_scale : heads.v;
  return finish(3, attend(i, q, k, v, at::Tensor(), nullptr), l.o_w, l.o_b);
}

// The final norm, fp32 for the loss.
template <typename Model>
at::Tensor FinalNorm(const Model& m, const at::Tensor& x, double eps) {
  return RmsNorm(x, m.norm, eps).to(at::kFloat);
}

// The whole stack: embeddings x [T, hidden] at `positions` [T] in,
// final-normed hidden states (fp32) out.
template <typename Model, typename Lora, typename Attend, typename Moe, typename Mix>
at::Tensor DecoderStack(const Model& m, at::Tensor x, const at::Tensor& positions,
                        at::ScalarType dtype, double eps, bool attn_lora, bool mlp_lora, Lora&& lora,
                        Attend&& attend, Moe&& moe, Mix&& mix) {
  const Rope rope = Rope::Make(m, positions, dtype);
  for (size_t i = 0; i < m.layers.size(); ++i)
    x = DecoderLayer(m, i, std::move(x), rope, eps, attn_lora, mlp_lora, lora, attend, moe, mix);
  return FinalNorm(m, x, eps);
}

}  // namespace loom::engine
