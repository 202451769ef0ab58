#include "engine/model/moe.h"

#include <algorithm>
#include <tuple>

#include "engine/model/compat.h"
#include "engine/model/lean_ops.h"

namespace loom::engine {
namespace {

const auto kLong = at::TensorOptions().dtype(at::kLong);

// The LoRA delta of one expert target over the sorted pairs' rows x [P, d_in]
// (counts: rows per (expert, slot group) segment, G = E * (U + 1)): each
// segment times its own slot's factors for its expert, scaled by the slot's
// alpha/r; the rows of tokens without a slot (group U) come out exactly 0.
at::Tensor ExpertDelta(const SlotBank& bank, const LoraTarget& t, const at::Tensor& x, const at::Tensor& counts,
                       const ExpertLoraRouting& lora, const at::Tensor& row_group) {
  const int64_t U = lora.num_slots(), sub = U + 1, G = counts.size(0);
  const at::Device dev = x.device();
  // Segment g = e * sub + u uses expert e and slot u (group U: slot 0's
  // factors, whose rows are then selected away, never multiplied by 0).
  const at::Tensor g = at::arange(G, kLong.device(dev));
  const at::Tensor ids = at::cat({lora.slot_ids, lora.slot_ids.narrow(0, 0, 1)});
  const at::Tensor seg_slot = ids.index_select(0, at::remainder(g, sub));
  const at::Tensor seg_expert = at::div(g, sub, "floor");
  const auto factor = [&](const at::Tensor& f, bool per_expert) {
    return per_expert ? f.index({seg_slot, seg_expert}) : f.index_select(0, seg_slot);
  };
  const at::ScalarType ct = bank.ComputeType(x);
  const at::Tensor a = factor(t.A, t.per_expert == ExpertFactor::kA).to(ct);  // [G, R, d_in]
  const at::Tensor b = factor(t.B, t.per_expert == ExpertFactor::kB).to(ct);  // [G, d_out, R]
  const at::Tensor mid = GroupedLinear(x.to(ct), a, counts);                  // [P, R]
  const at::Tensor out = GroupedLinear(mid, b, counts);                       // [P, d_out]
  const at::Tensor scale = lora.scale.index_select(0, row_group).unsqueeze(1).to(ct);
  return at::where((row_group < U).unsqueeze(1), out * scale, at::zeros_like(out)).to(x.scalar_type());
}

// gpt_oss's clamped SwiGLU over gate_up [P, 2I] (gate then up), as HF's
// GptOssExperts._apply_gate: plain ops, so autograd's clamp gradients (zero
// outside the range, boundary inclusive) are torch's, as in HF. It keeps
// more for the backward than SwiGluLean does.
at::Tensor ClampedSwiGlu(const at::Tensor& gate_up) {
  constexpr double kLimit = 7.0, kAlpha = 1.702;
  const int64_t inter = gate_up.size(-1) / 2;
  const at::Tensor gate = gate_up.narrow(-1, 0, inter).clamp_max(kLimit);
  const at::Tensor up = gate_up.narrow(-1, inter, inter).clamp(-kLimit, kLimit);
  return (up + 1) * (gate * at::sigmoid(gate * kAlpha));
}

}  // namespace

ExpertLoraRouting ExpertLoraRouting::Make(const SlotBank& bank, const std::vector<int64_t>& seq_begin,
                                          const std::vector<int>& seq_slot, at::Device device) {
  ExpertLoraRouting r;
  const int64_t T = seq_begin.empty() ? 0 : seq_begin.back();
  std::vector<int64_t> seq_group(seq_slot.size());
  for (size_t i = 0; i < seq_slot.size(); ++i) {
    const int s = seq_slot[i];
    if (!bank.trains(s, TargetGroup::kMlp)) {
      seq_group[i] = -1;
      continue;
    }
    auto it = std::find(r.slots.begin(), r.slots.end(), s);
    seq_group[i] = it - r.slots.begin();
    if (it == r.slots.end()) r.slots.push_back(s);
  }
  const int64_t U = r.num_slots();
  if (U == 0) return r;
  at::Tensor group = at::empty({T}, kLong);
  int64_t* gp = group.data_ptr<int64_t>();
  for (size_t i = 0; i + 1 < seq_begin.size(); ++i)
    std::fill(gp + seq_begin[i], gp + seq_begin[i + 1], seq_group[i] < 0 ? U : seq_group[i]);
  r.token_group = group.to(device);
  r.slot_ids = at::tensor(r.slots, kLong).to(device);
  r.scale = at::cat({bank.scales().index_select(0, r.slot_ids), at::zeros({1}, bank.scales().options())});
  return r;
}

at::Tensor GroupedLinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
  const int64_t out = w.size(1), G = w.size(0);
  const bool grouped = compat::kHasGroupedMm && x.is_cuda() && x.scalar_type() == at::kBFloat16 &&
                       w.scalar_type() == at::kBFloat16 && x.size(1) % 8 == 0 && out % 8 == 0;
  // at::_grouped_mm takes fewer than 1024 groups per call (its check is
  // group_count < 1024: 1024 groups failed on the H200 as 1152 did).
  constexpr int64_t kMaxGroups = 512;
  if (grouped && G <= kMaxGroups)
    return compat::GroupedMm(x.contiguous(), w.transpose(1, 2), counts.cumsum(0).to(at::kInt));
  // Runs of kMaxGroups segments per grouped GEMM, or one matmul per segment
  // (the reference path); either way the row ranges come from the counts.
  const at::Tensor host = counts.cpu();
  const int64_t* n = host.data_ptr<int64_t>();
  const int64_t run = grouped ? kMaxGroups : 1;
  std::vector<at::Tensor> parts;
  int64_t begin = 0;
  for (int64_t g0 = 0; g0 < G; g0 += run) {
    const int64_t g1 = std::min(G, g0 + run);
    int64_t rows = 0;
    for (int64_t g = g0; g < g1; ++g) rows += n[g];
    if (rows == 0) continue;
    const at::Tensor xs = x.narrow(0, begin, rows);
    parts.push_back(grouped ? compat::GroupedMm(xs.contiguous(), w.narrow(0, g0, g1 - g0).transpose(1, 2),
                                                counts.narrow(0, g0, g1 - g0).cumsum(0).to(at::kInt))
                            : at::mm(xs, w.select(0, g0).t()));
    begin += rows;
  }
  if (parts.empty()) return at::zeros({x.size(0), out}, x.options());
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

at::Tensor MoeForward(const MoeWeights& w, const at::Tensor& h, const SlotBank& bank, const LoraTarget* gate_up,
                      const LoraTarget* down, const ExpertLoraRouting* lora) {
  const int64_t T = h.size(0), E = w.router.size(0), K = w.top_k;
  // Route (HF's order for each router kind; moe.h).
  const at::Tensor logits = at::linear(h, w.router, w.router_bias);
  at::Tensor top_p, top_e;
  if (w.router_kind == MoeRouter::kTopKSoftmax) {
    std::tie(top_p, top_e) = logits.topk(K, -1);
    top_p = at::softmax(top_p, -1, top_p.scalar_type());
  } else {
    std::tie(top_p, top_e) = at::softmax(logits.to(at::kFloat), -1).topk(K, -1);
    if (w.norm_topk) top_p = top_p / top_p.sum(-1, /*keepdim=*/true);
    top_p = top_p.to(h.scalar_type());
  }

  // The T * K (token, choice) pairs sorted by segment: expert, then the
  // token's LoRA group within the expert (stable: token order within).
  const bool with_lora = lora && lora->num_slots() > 0 && gate_up && down;
  const int64_t sub = with_lora ? lora->num_slots() + 1 : 1;
  const at::Tensor pair_token = at::arange(T, kLong.device(h.device())).unsqueeze(1).expand({T, K}).reshape({-1});
  at::Tensor key = top_e.reshape({-1});
  if (with_lora) key = key * sub + lora->token_group.index_select(0, pair_token);
  const at::Tensor order = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor counts = at::zeros({E * sub}, key.options()).scatter_add_(0, key, at::ones_like(key));
  const at::Tensor expert_counts = with_lora ? counts.view({E, sub}).sum(1) : counts;
  const at::Tensor token = pair_token.index_select(0, order);
  const at::Tensor x = h.index_select(0, token);  // [P, H]
  at::Tensor row_group;
  if (with_lora) row_group = lora->token_group.index_select(0, token);

  at::Tensor pair_expert;  // each sorted pair's expert, for the biases
  if (w.gate_up_bias.defined() || w.down_bias.defined()) pair_expert = top_e.reshape({-1}).index_select(0, order);

  at::Tensor gu = GroupedLinear(x, w.gate_up, expert_counts);  // [P, 2I]
  if (w.gate_up_bias.defined()) gu = gu + w.gate_up_bias.index_select(0, pair_expert);
  if (with_lora) gu = gu + ExpertDelta(bank, *gate_up, x, counts, *lora, row_group);
  const at::Tensor act = w.activation == MoeActivation::kClampedSwiGlu ? ClampedSwiGlu(gu) : SwiGluLean(gu);  // [P, I]
  at::Tensor y = GroupedLinear(act, w.down, expert_counts);  // [P, H]
  if (w.down_bias.defined()) y = y + w.down_bias.index_select(0, pair_expert);
  if (with_lora) y = y + ExpertDelta(bank, *down, act, counts, *lora, row_group);
  y = y * top_p.reshape({-1}).index_select(0, order).unsqueeze(1);
  return at::zeros_like(h).index_add(0, token, y);
}

}  // namespace loom::engine
