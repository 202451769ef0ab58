#include "engine/model/moe.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <tuple>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "engine/lora/lora_nodes.h"
#include "engine/model/compat.h"
#include "engine/model/lean_ops.h"

#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>

#include "engine/model/cuda/gemv.h"
#include "engine/model/cuda/moe_route.h"
#endif

namespace loom::engine {
namespace {

const auto kLong = at::TensorOptions().dtype(at::kLong);
// The groups GroupedLinear gives one grouped GEMM (at::_grouped_mm's limit is under 1024).
constexpr int64_t kGroupedMmMaxGroups = 512;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Row permutations whose backward is the inverse gather, not index_select's
// index_add (atomic adds, in bf16 the slowest kernel of an MoE pass).
// y = x[perm]; dx = dy[inverse].
struct PermuteRowsNode : torch::autograd::Function<PermuteRowsNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& perm, const at::Tensor& inverse) {
    ctx->saved_data["inverse"] = inverse;
    return x.index_select(0, perm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0].index_select(0, ctx->saved_data["inverse"].toTensor()), at::Tensor(), at::Tensor()};
  }
};

// The dispatch of T tokens to their P = T * K sorted pairs and back. pair
// j's token is token[j]; token t's k-th pair sits at position[t * K + k].
//   Dispatch: x [P, d] = h[token]; dh[t] = sum over k of dx[position[t K + k]].
//   Combine:  out [T, d] = sum over k of y[position[t K + k]]; dy = dout[token].
// Both sums are one reduction over K (fp32 accumulation), so no atomics.
struct DispatchNode : torch::autograd::Function<DispatchNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& token, const at::Tensor& position,
                            int64_t K) {
    ctx->saved_data["position"] = position;
    ctx->saved_data["K"] = K;
    return h.index_select(0, token);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t K = ctx->saved_data["K"].toInt();
    const at::Tensor g = grads[0].index_select(0, ctx->saved_data["position"].toTensor());
    return {g.view({-1, K, g.size(1)}).sum(1), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct CombineNode : torch::autograd::Function<CombineNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& token, const at::Tensor& position,
                            int64_t K) {
    ctx->saved_data["token"] = token;
    const at::Tensor g = y.index_select(0, position);
    return g.view({-1, K, g.size(1)}).sum(1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0].index_select(0, ctx->saved_data["token"].toTensor()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Which rows of a factor F one use takes: out[i] = where(keep[i], F[slot[i]]
// (or F[slot[i], expert[i]]) * mul[i], 0); expert, mul ([S] fp32) and keep
// ([S] bool) are optional.
struct FactorRows {
  at::Tensor slot, expert, mul, keep;
  at::Tensor Gather(const at::Tensor& F) const {
    at::Tensor g = expert.defined() ? F.index({slot, expert}) : F.index_select(0, slot);
    if (mul.defined()) g = g * mul.view({-1, 1, 1});
    if (keep.defined()) g = at::where(keep.view({-1, 1, 1}), g, at::zeros_like(g));
    return g;
  }
};

// FactorRows' rows of F cast to the compute type ct, as one node whose
// backward adds the rows' gradients into F's .grad in place (FactorGrad, as
// lora_nodes.h's nodes do) and returns none for F: no dense zero gradient
// of F's whole [N, ...] shape (every slot of the bank) per use. F is an
// input only so that the node is part of every backward that reaches the
// factors.
struct FactorGatherNode : torch::autograd::Function<FactorGatherNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& F, const FactorRows& rows, int64_t ct) {
    ctx->saved_data["F"] = F;
    ctx->saved_data["slot"] = rows.slot;
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"expert", &rows.expert},
                                  {"mul", &rows.mul},
                                  {"keep", &rows.keep}})
      if (t->defined()) ctx->saved_data[name] = *t;
    at::NoGradGuard no_grad;
    return rows.Gather(F).to(static_cast<at::ScalarType>(ct));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor F = ctx->saved_data["F"].toTensor();
    const auto saved = [&](const char* name) {
      auto it = ctx->saved_data.find(name);
      return it == ctx->saved_data.end() ? at::Tensor() : it->second.toTensor();
    };
    const FactorRows rows{saved("slot"), saved("expert"), saved("mul"), saved("keep")};
    at::Tensor g = grads[0].to(F.scalar_type());
    if (rows.mul.defined()) g = g * rows.mul.view({-1, 1, 1});
    if (rows.keep.defined()) g = at::where(rows.keep.view({-1, 1, 1}), g, at::zeros_like(g));
    at::Tensor& grad = FactorGrad(F);
    if (rows.expert.defined())
      grad.index_put_({rows.slot, rows.expert}, g, /*accumulate=*/true);
    else
      grad.index_add_(0, rows.slot, g);
    return {at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// FactorGatherNode's value, through the node where F takes gradients (else
// plain ops).
at::Tensor GatherFactors(const at::Tensor& F, const FactorRows& rows, at::ScalarType ct) {
  if (c10::GradMode::is_enabled() && F.requires_grad())
    return FactorGatherNode::apply(F, rows, static_cast<int64_t>(ct));
  return rows.Gather(F).to(ct);
}

// The T * K (token, choice) pairs in sorted order (see DispatchNode), or,
// with the experts split over ranks, the run of them that this rank's
// experts take (a token has 0..K of those: plain gathers and index adds).
struct Pairs {
  at::Tensor token;     // [P] each sorted pair's token
  at::Tensor position;  // [P] where pair (t, k) sits in the sorted order, at t * K + k (whole pairs only)
  int64_t K = 0;
  bool subset = false;  // this rank's run of the pairs
  int64_t rows = 0;     // T, for Combine of a subset
  at::Tensor Dispatch(const at::Tensor& h) const {
    return subset ? h.index_select(0, token) : DispatchNode::apply(h, token, position, K);
  }
  at::Tensor Combine(const at::Tensor& y) const {
    return subset ? at::zeros({rows, y.size(1)}, y.options()).index_add(0, token, y)
                  : CombineNode::apply(y, token, position, K);
  }
};

// The expert LoRA of one batch (moe.h): its slots' factors and the two
// orders it runs in. The shared factors (gate_up's A, down's B) run per
// token, over the tokens sorted by LoRA group (U + 1 segments, the last the
// tokens without a slot); the per-expert factors run per (expert, group)
// segment of the sorted pairs, over the non-empty segments only (a decode
// step routes a few dozen of E * (U + 1)), so no factor is gathered for a
// segment without rows, nor a shared one once per expert. A token meets only
// its own slot's factors, with alpha/r folded into its shared factor; group
// U (no slot) meets zero factors, so its rows are exactly 0 whatever slot
// 0's factors hold, and no [pairs, width] tensor is masked or scaled.
struct ExpertLoraPlan {
  const SlotBank* bank = nullptr;
  const ExpertLoraRouting* lora = nullptr;
  at::Tensor tok_order, tok_inverse, tok_counts;  // tokens sorted by group; its inverse; [U + 1]
  at::Tensor seg_slot, seg_expert, seg_counts;    // the non-empty (expert, group) segments
  at::Tensor group_scale;                         // [U + 1]: each group's alpha/r (0 for U)
  // Only when some token has no slot (ExpertLoraRouting::unslotted), else undefined:
  at::Tensor seg_keep;                            // [S] bool: the segment's group has a slot
  at::Tensor group_keep;                          // [U + 1] bool: group < U

  ExpertLoraPlan(const SlotBank& b, const ExpertLoraRouting& r, const at::Tensor& counts, int64_t T) : bank(&b), lora(&r) {
    const int64_t U = r.num_slots(), sub = U + 1;
    const at::Device dev = counts.device();
    tok_order = std::get<1>(at::sort(r.token_group, /*stable=*/true, /*dim=*/0, /*descending=*/false));
    tok_inverse = at::empty_like(tok_order).scatter_(0, tok_order, at::arange(T, kLong.device(dev)));
    tok_counts = at::zeros({sub}, kLong.device(dev)).scatter_add_(0, r.token_group, at::ones_like(r.token_group));
    const at::Tensor nz = at::nonzero(counts).squeeze(1);  // one host sync: the non-empty segments
    seg_counts = counts.index_select(0, nz);
    const at::Tensor seg_group = at::remainder(nz, sub);
    seg_slot = r.group_slot.index_select(0, seg_group);
    seg_expert = at::div(nz, sub, "floor");
    group_scale = r.scale;
    if (r.unslotted) {
      seg_keep = seg_group < U;
      group_keep = at::arange(sub, kLong.device(dev)) < U;
    }
  }
  // y [T, out] = alpha/r x [T, in] f[slot(token)]^T, f [N, out, in] a shared
  // factor (0 for tokens without a slot).
  at::Tensor PerToken(const at::Tensor& x, const at::Tensor& f) const {
    const FactorRows rows{lora->group_slot, at::Tensor(), group_scale, group_keep};
    const at::Tensor w = GatherFactors(f, rows, x.scalar_type());  // [U + 1, out, in]
    const at::Tensor sorted = PermuteRowsNode::apply(x, tok_order, tok_inverse);
    return PermuteRowsNode::apply(GroupedLinear(sorted, w, tok_counts), tok_inverse, tok_order);
  }
  // y [P, out] = x [P, in] f[slot, expert]^T per sorted pair, f [N, E, out, in]
  // (0 for segments without a slot).
  at::Tensor PerSegment(const at::Tensor& x, const at::Tensor& f) const {
    const FactorRows rows{seg_slot, seg_expert, at::Tensor(), seg_keep};
    const at::Tensor w = GatherFactors(f, rows, x.scalar_type());  // [S, out, in]
    return GroupedLinear(x, w, seg_counts);
  }
};

// Rows of tokens without a slot exactly 0 (so a slot's non-finite factors
// never reach them), the others times alpha/r: y's rows are tokens, or
// (token given) the sorted pairs of those tokens.
at::Tensor Scaled(const ExpertLoraRows& rows, const at::Tensor& y, const at::Tensor& token = {}) {
  const auto take = [&](const at::Tensor& v) { return token.defined() ? v.index_select(0, token) : v; };
  return at::where(take(rows.keep), y * take(rows.scale).to(y.scalar_type()), at::zeros_like(y));
}

// gate_up's delta per sorted pair [P, 2I] (A shared, B per expert):
// (h A_slot^T) alpha/r per token, taken to the pairs, times the segment's B.
at::Tensor GateUpDelta(const ExpertLoraPlan& p, const LoraTarget& t, const at::Tensor& h, const Pairs& pairs,
                       at::ScalarType out) {
  const at::ScalarType ct = p.bank->ComputeType(h);
  const at::Tensor mid = p.PerToken(h.to(ct), t.A);  // [T, R]
  return p.PerSegment(pairs.Dispatch(mid), t.B).to(out);
}

// down's delta per token [T, H] (A per expert, B shared), already weighted
// by the routes: alpha/r B_slot (sum over the token's pairs of p * A_segment
// act), which is the sum of the pairs' weighted deltas with one B product per
// token.
at::Tensor DownDelta(const ExpertLoraPlan& p, const LoraTarget& t, const at::Tensor& act, const Pairs& pairs,
                     const at::Tensor& weight) {
  const at::ScalarType ct = p.bank->ComputeType(act);
  const at::Tensor mid = p.PerSegment(act.to(ct), t.A) * weight.to(ct);  // [P, R]
  return p.PerToken(pairs.Combine(mid), t.B).to(act.scalar_type());
}

// The pair form (ExpertLoraRows): the same deltas with batched matmuls over
// factors gathered per token (the shared ones) and per sorted pair (the
// per-expert ones: each pair's (slot, expert) as two indices), those in
// runs of ExpertLoraRows::run_bytes.
struct PairFactors {
  at::Tensor slot, expert;  // [P] each sorted pair's slot and expert (this rank's)
};

// f(begin, n) over the P pairs in runs whose gathers of the per-expert
// factor (one pair's [a, b]) hold at most rows.run_bytes in fp32, concatenated.
template <typename F>
at::Tensor InPairRuns(const ExpertLoraRows& rows, int64_t P, const at::Tensor& per_expert, F&& f) {
  const int64_t per_pair = per_expert.size(-2) * per_expert.size(-1) * static_cast<int64_t>(sizeof(float));
  const int64_t run = std::max<int64_t>(1, rows.run_bytes / per_pair);
  if (P <= run) return f(0, P);
  std::vector<at::Tensor> parts;
  for (int64_t b = 0; b < P; b += run) parts.push_back(f(b, std::min(run, P - b)));
  return at::cat(parts, 0);
}

at::Tensor GateUpDeltaPairs(const SlotBank& bank, const ExpertLoraRows& rows, const LoraTarget& t, const at::Tensor& h,
                            const Pairs& pairs, const PairFactors& f, at::ScalarType out) {
  const at::ScalarType ct = bank.ComputeType(h);
  const at::Tensor a = t.A.index_select(0, rows.slot).to(ct);                           // [T, R, H]
  const at::Tensor mid = pairs.Dispatch(at::bmm(a, h.to(ct).unsqueeze(2)).squeeze(2));  // [P, R]
  const at::Tensor d = InPairRuns(rows, mid.size(0), t.B, [&](int64_t b, int64_t n) {
    const at::Tensor factor = t.B.index({f.slot.narrow(0, b, n), f.expert.narrow(0, b, n)}).to(ct);  // [n, 2I, R]
    return at::bmm(factor, mid.narrow(0, b, n).unsqueeze(2)).squeeze(2);                            // [n, 2I]
  });
  return Scaled(rows, d, pairs.token).to(out);
}

at::Tensor DownDeltaPairs(const SlotBank& bank, const ExpertLoraRows& rows, const LoraTarget& t, const at::Tensor& act,
                          const Pairs& pairs, const PairFactors& f, const at::Tensor& weight) {
  const at::ScalarType ct = bank.ComputeType(act);
  const at::Tensor x = act.to(ct), wt = weight.to(ct);
  const at::Tensor mid = InPairRuns(rows, x.size(0), t.A, [&](int64_t b, int64_t n) {
    const at::Tensor factor = t.A.index({f.slot.narrow(0, b, n), f.expert.narrow(0, b, n)}).to(ct);  // [n, R, I]
    return at::bmm(factor, x.narrow(0, b, n).unsqueeze(2)).squeeze(2) * wt.narrow(0, b, n);          // [n, R]
  });
  const at::Tensor b = t.B.index_select(0, rows.slot).to(ct);                     // [T, H, R]
  const at::Tensor d = at::bmm(b, pairs.Combine(mid).unsqueeze(2)).squeeze(2);  // [T, H]
  return Scaled(rows, d).to(act.scalar_type());
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

// The grouped routers (moe.h): {weights [T, K] fp32, experts [T, K]} from
// the fp32 logits.
std::pair<at::Tensor, at::Tensor> GroupedRoute(const MoeWeights& w, const at::Tensor& logits) {
  const int64_t T = logits.size(0), E = logits.size(1), G = w.groups;
  const bool sigmoid = w.router_kind == MoeRouter::kGroupedSigmoid;
  const at::Tensor scores = sigmoid ? logits.sigmoid() : at::softmax(logits, -1);
  at::Tensor choice = sigmoid && w.score_bias.defined() ? scores + w.score_bias.to(at::kFloat).unsqueeze(0) : scores;
  if (G > 1 && w.topk_groups < G) {
    const at::Tensor by_group = choice.view({T, G, E / G});
    const at::Tensor group_scores =
        sigmoid ? std::get<0>(by_group.topk(std::min<int64_t>(2, E / G), -1)).sum(-1) : std::get<0>(by_group.max(-1));
    const at::Tensor best = std::get<1>(group_scores.topk(w.topk_groups, -1));
    const at::Tensor keep = at::zeros({T, G}, choice.options().dtype(at::kBool)).scatter_(1, best, true);
    choice = choice.masked_fill(keep.unsqueeze(-1).expand({T, G, E / G}).reshape({T, E}).logical_not(), 0.0);
  }
  const at::Tensor experts = std::get<1>(choice.topk(w.top_k, -1));
  at::Tensor weights = scores.gather(1, experts);
  if (sigmoid && w.norm_topk) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
  return {weights * w.routed_scale, experts};
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
      r.unslotted = r.unslotted || (i + 1 < seq_begin.size() && seq_begin[i + 1] > seq_begin[i]);
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
  r.group_slot = at::cat({r.slot_ids, r.slot_ids.narrow(0, 0, 1)});
  r.rows.slot = r.group_slot.index_select(0, r.token_group);
  r.rows.keep = (r.token_group < U).unsqueeze(1);
  r.rows.scale = r.scale.index_select(0, r.token_group).unsqueeze(1);
  return r;
}

at::Tensor GroupedLinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
  const int64_t out = w.size(1), G = w.size(0);
  const bool grouped = compat::kHasGroupedMm && x.is_cuda() && x.scalar_type() == at::kBFloat16 &&
                       w.scalar_type() == at::kBFloat16 && x.size(1) % 8 == 0 && out % 8 == 0;
  // at::_grouped_mm takes fewer than 1024 groups per call (its check is
  // group_count < 1024: 1024 groups failed on the H200 as 1152 did).
  constexpr int64_t kMaxGroups = kGroupedMmMaxGroups;
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

namespace {

// {weights [T, K], experts [T, K]} as HF routes (moe.h): the grouped
// routers' weights in fp32, the others' in h's dtype.
std::pair<at::Tensor, at::Tensor> Route(const MoeWeights& w, const at::Tensor& h) {
  const int64_t K = w.top_k;
  const bool grouped = w.router_kind == MoeRouter::kGroupedSoftmax || w.router_kind == MoeRouter::kGroupedSigmoid;
  const at::Tensor logits =
      grouped ? at::linear(h.to(at::kFloat), w.router.to(at::kFloat)) : at::linear(h, w.router, w.router_bias);
  if (grouped) return GroupedRoute(w, logits);
  at::Tensor top_p, top_e;
  if (w.router_kind == MoeRouter::kTopKSoftmax) {
    std::tie(top_p, top_e) = logits.topk(K, -1);
    return {at::softmax(top_p, -1, top_p.scalar_type()), top_e};
  }
  std::tie(top_p, top_e) = at::softmax(logits.to(at::kFloat), -1).topk(K, -1);
  if (w.norm_topk) top_p = top_p / top_p.sum(-1, /*keepdim=*/true);
  return {top_p.to(h.scalar_type()), top_e};
}

#if LOOM_CUDA_KERNELS
// Route for the pair form's few tokens: the logits (the matrix-vector
// kernel for up to 4 rows, as the decode projections), then one kernel for
// the softmax, top-k and normalisation (cuda::MoeRoute) where the router has
// one softmax; the grouped routers take Route.
std::pair<at::Tensor, at::Tensor> RouteFew(const MoeWeights& w, const at::Tensor& h, cudaStream_t stream) {
  const bool one_softmax = w.router_kind == MoeRouter::kSoftmaxTopK || w.router_kind == MoeRouter::kTopKSoftmax;
  const int64_t T = h.size(0), E = w.router.size(0), K = w.top_k;
  const bool same_dtype = w.router.scalar_type() == h.scalar_type() &&
                          (!w.router_bias.defined() || w.router_bias.scalar_type() == h.scalar_type());
  if (!one_softmax || !same_dtype || E > cuda::kMoeRouteMaxExperts || K > cuda::kMoeRouteMaxK ||
      !w.router.is_contiguous())
    return Route(w, h);
  at::Tensor logits = at::empty({T, E}, h.options());
  const at::Tensor bias = w.router_bias.defined() ? w.router_bias.contiguous() : at::Tensor();
  if (!cuda::Gemv(true, h.data_ptr(), h.stride(0), w.router.data_ptr(), bias.defined() ? bias.data_ptr() : nullptr,
                  logits.data_ptr(), false, T, E, h.size(1), stream))
    logits = at::linear(h, w.router, w.router_bias);
  at::Tensor weights = at::empty({T, K}, h.options()), experts = at::empty({T, K}, kLong.device(h.device()));
  const auto kind = w.router_kind == MoeRouter::kSoftmaxTopK ? cuda::MoeRouteKind::kSoftmaxTopK
                                                             : cuda::MoeRouteKind::kTopKSoftmax;
  if (!cuda::MoeRoute(true, kind, w.norm_topk, logits.data_ptr(), weights.data_ptr(), experts.data_ptr<int64_t>(), T,
                      E, K, stream))
    throw std::logic_error("MoeForward: MoeRoute refused a router RouteFew checked");
  return {weights, experts};
}
#endif

// The pair form's block for a decode step's few pairs (moe.h,
// MoeForward's pair_gemv): routed by RouteFew; the T * K pairs in (token,
// choice) order, each pair's two projections one matrix-vector product over
// its own expert's rows (cuda::ExpertGemv), so no sort, no dispatch, and no
// grouped GEMM whose tiles are mostly padding at a row or two a group; the
// pairs' outputs weighted and summed per token by one kernel
// (cuda::MoeCombine). Undefined where PairGemvApplies is false (the caller
// then runs the grouped path). No autograd: the sampler's no-grad steps
// only.
at::Tensor PairGemvBlock(const MoeWeights& w, const at::Tensor& h, const SlotBank& bank, const LoraTarget* gate_up,
                         const LoraTarget* down, const ExpertLoraRows* rows) {
#if LOOM_CUDA_KERNELS
  static_assert(kPairGemvMaxPairs == cuda::kExpertGemvMaxPairs);
  if (!PairGemvApplies(w, h)) return {};
  const int64_t T = h.size(0), K = w.top_k, P = T * K, H = h.size(1);
  const int64_t I2 = w.gate_up.size(1), I = w.down.size(2);
  const at::Tensor x = h.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(h.device().index()).stream();
  const auto [top_p, top_e] = RouteFew(w, x, stream);
  const at::Tensor experts = top_e.reshape({-1}).to(at::kLong).contiguous();
  at::Tensor gu = at::empty({P, I2}, h.options());
  const at::Tensor gate_up_bias = w.gate_up_bias.defined() ? w.gate_up_bias.contiguous() : at::Tensor();
  const at::Tensor down_bias = w.down_bias.defined() ? w.down_bias.contiguous() : at::Tensor();
  const auto bias = [](const at::Tensor& b) { return b.defined() ? b.data_ptr() : nullptr; };
  // PairGemvApplies checked what ExpertGemv refuses.
  const auto launched = [](bool ok) {
    if (!ok) throw std::logic_error("MoeForward: ExpertGemv refused operands PairGemvApplies passed");
  };
  launched(cuda::ExpertGemv(true, x.data_ptr(), H, K, w.gate_up.data_ptr(), bias(gate_up_bias),
                            experts.data_ptr<int64_t>(), gu.data_ptr(), P, I2, H, stream));
  const bool lora = rows && rows->defined() && gate_up && down;
  Pairs pairs;
  PairFactors factors;
  if (lora) {
    pairs.K = K;
    pairs.position = at::arange(P, kLong.device(h.device()));
    pairs.token = at::arange(T, kLong.device(h.device())).unsqueeze(1).expand({T, K}).reshape({-1});
    factors = {rows->slot.index_select(0, pairs.token), experts};
    gu = gu + GateUpDeltaPairs(bank, *rows, *gate_up, x, pairs, factors, gu.scalar_type());
  }
  const at::Tensor act =
      (w.activation == MoeActivation::kClampedSwiGlu ? ClampedSwiGlu(gu) : SwiGluLean(gu)).contiguous();  // [P, I]
  at::Tensor y = at::empty({P, H}, h.options());
  launched(cuda::ExpertGemv(true, act.data_ptr(), I, 1, w.down.data_ptr(), bias(down_bias), experts.data_ptr<int64_t>(),
                            y.data_ptr(), P, H, I, stream));
  const at::Tensor weight = top_p.contiguous();  // [T, K]: h's dtype, fp32 from the grouped routers
  if (weight.scalar_type() != at::kFloat && weight.scalar_type() != h.scalar_type())
    throw std::logic_error("MoeForward: routing weights neither fp32 nor the model dtype");
  at::Tensor out = at::empty({T, H}, h.options());
  cuda::MoeCombine(true, y.data_ptr(), weight.data_ptr(), weight.scalar_type() == at::kFloat, out.data_ptr(), T, K, H,
                   stream);
  if (lora) out = out + DownDeltaPairs(bank, *rows, *down, act, pairs, factors, weight.reshape({-1}).unsqueeze(1));
  return out;
#else
  (void)w, (void)h, (void)bank, (void)gate_up, (void)down, (void)rows;
  return {};
#endif
}

// The block (moe.h) with the expert LoRA in the segment form (seg), the
// pair form (rows), or neither; pair_gemv: the pair form may take
// PairGemvBlock.
at::Tensor Block(const MoeWeights& w, const at::Tensor& h, const SlotBank& bank, const LoraTarget* gate_up,
                 const LoraTarget* down, const ExpertLoraRouting* seg, const ExpertLoraRows* rows,
                 bool pair_gemv = false) {
  const int64_t T = h.size(0), E = w.router.size(0), K = w.top_k;
  // Experts split over ranks (parallel.h): this rank's are [e0, e0 + El).
  const int64_t El = w.gate_up.size(0), e0 = w.expert_begin;
  if (pair_gemv && !seg && !at::GradMode::is_enabled())
    if (at::Tensor out = PairGemvBlock(w, h, bank, gate_up, down, rows); out.defined()) return out;
  const auto [top_p, top_e] = Route(w, h);

  // The T * K (token, choice) pairs sorted by segment: expert, then (the
  // segment form) the token's LoRA group within the expert (stable: token
  // order within).
  const bool segments = seg && seg->num_slots() > 0 && gate_up && down;
  const bool per_pair = !segments && rows && rows->defined() && gate_up && down;
  if ((segments || per_pair) && (gate_up->per_expert != ExpertFactor::kB || down->per_expert != ExpertFactor::kA))
    throw std::logic_error("MoeForward: the expert LoRA layout is gate_up B and down A per expert (slot_bank.h)");
  const int64_t sub = segments ? seg->num_slots() + 1 : 1;
  const at::Tensor pair_token = at::arange(T, kLong.device(h.device())).unsqueeze(1).expand({T, K}).reshape({-1});
  at::Tensor key = top_e.reshape({-1});
  if (segments) key = key * sub + seg->token_group.index_select(0, pair_token);
  at::Tensor order = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  at::Tensor counts = at::zeros({E * sub}, key.options()).scatter_add_(0, key, at::ones_like(key));
  Pairs pairs;
  pairs.K = K;
  if (El != E) {
    // This rank's experts' pairs are one run of the sorted order (one host read of the counts).
    const at::Tensor host = counts.cpu();
    const int64_t* n = host.data_ptr<int64_t>();
    int64_t start = 0, len = 0;
    for (int64_t g = 0; g < e0 * sub; ++g) start += n[g];
    for (int64_t g = e0 * sub; g < (e0 + El) * sub; ++g) len += n[g];
    order = order.narrow(0, start, len);
    counts = counts.narrow(0, e0 * sub, El * sub);
    pairs.subset = true;
    pairs.rows = T;
    pairs.token = pair_token.index_select(0, order);
  } else {
    pairs.token = pair_token.index_select(0, order);
    pairs.position = at::empty_like(order).scatter_(0, order, at::arange(T * K, kLong.device(h.device())));
  }
  const at::Tensor expert_counts = segments ? counts.view({El, sub}).sum(1) : counts;
  const at::Tensor x = pairs.Dispatch(h);  // [P, H]

  at::Tensor pair_expert;  // each sorted pair's expert (among this rank's), for the biases and the pair form
  if (w.gate_up_bias.defined() || w.down_bias.defined() || per_pair)
    pair_expert = top_e.reshape({-1}).index_select(0, order) - e0;

  const at::Tensor weight = top_p.reshape({-1}).index_select(0, order).unsqueeze(1);  // [P, 1]
  std::optional<ExpertLoraPlan> plan;
  if (segments) plan.emplace(bank, *seg, counts, T);
  PairFactors factors;
  if (per_pair) factors = {rows->slot.index_select(0, pairs.token), pair_expert};

  at::Tensor gu = GroupedLinear(x, w.gate_up, expert_counts);  // [P, 2I]
  if (w.gate_up_bias.defined()) gu = gu + w.gate_up_bias.index_select(0, pair_expert);
  if (plan) gu = gu + GateUpDelta(*plan, *gate_up, h, pairs, gu.scalar_type());
  if (per_pair) gu = gu + GateUpDeltaPairs(bank, *rows, *gate_up, h, pairs, factors, gu.scalar_type());
  const at::Tensor act = w.activation == MoeActivation::kClampedSwiGlu ? ClampedSwiGlu(gu) : SwiGluLean(gu);  // [P, I]
  at::Tensor y = GroupedLinear(act, w.down, expert_counts);  // [P, H]
  if (w.down_bias.defined()) y = y + w.down_bias.index_select(0, pair_expert);
  at::Tensor out = pairs.Combine((y * weight).to(y.scalar_type()));  // the grouped routers' weights are fp32
  if (plan) out = out + DownDelta(*plan, *down, act, pairs, weight);
  if (per_pair) out = out + DownDeltaPairs(bank, *rows, *down, act, pairs, factors, weight);
  return out;
}

}  // namespace

ExpertLoraRows ExpertLoraRows::FromSlots(const SlotBank& bank, const at::Tensor& slots) {
  ExpertLoraRows rows;
  const at::Tensor s = slots.to(at::kLong);
  rows.keep = (s >= 0).unsqueeze(1);
  rows.slot = s.clamp_min(0);
  const at::Tensor scale = bank.scales().index_select(0, rows.slot).unsqueeze(1);
  rows.scale = at::where(rows.keep, scale, at::zeros_like(scale));
  return rows;
}

bool MoeReadsNoHost(const MoeWeights& w, at::ScalarType dtype, const at::Device& device) {
  const int64_t E = w.router.size(0), H = w.gate_up.size(2), I = w.down.size(2);
  return compat::kHasGroupedMm && device.is_cuda() && dtype == at::kBFloat16 &&
         w.gate_up.scalar_type() == at::kBFloat16 && w.down.scalar_type() == at::kBFloat16 &&
         w.gate_up.size(0) == E && E <= kGroupedMmMaxGroups && H % 8 == 0 && I % 8 == 0;
}

bool PairGemvApplies(const MoeWeights& w, const at::Tensor& h) {
#if LOOM_CUDA_KERNELS
  constexpr bool kHasKernels = true;
#else
  constexpr bool kHasKernels = false;
#endif
  const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  const int64_t H = h.size(1), I = w.down.size(2);
  return kHasKernels && h.is_cuda() && h.scalar_type() == at::kBFloat16 &&
         w.gate_up.scalar_type() == at::kBFloat16 && w.down.scalar_type() == at::kBFloat16 &&
         w.gate_up.size(0) == w.router.size(0) && h.size(0) * w.top_k <= kPairGemvMaxPairs && H % 8 == 0 &&
         I % 8 == 0 && w.gate_up.is_contiguous() && w.down.is_contiguous() && aligned(w.gate_up) && aligned(w.down);
}

bool PairFormFits(int64_t pairs, const at::Device& device) {
  return pairs <= (device.is_cuda() ? kPairFormMaxPairs : kPairFormMaxPairsCpu);
}

at::Tensor MoeForward(const MoeWeights& w, const at::Tensor& h, const SlotBank& bank, const LoraTarget* gate_up,
                      const LoraTarget* down, const ExpertLoraRouting* lora) {
  return Block(w, h, bank, gate_up, down, lora, nullptr);
}

at::Tensor MoeForward(const MoeWeights& w, const at::Tensor& h, const SlotBank& bank, const LoraTarget* gate_up,
                      const LoraTarget* down, const ExpertLoraRows& rows, bool pair_gemv) {
  return Block(w, h, bank, gate_up, down, nullptr, &rows, pair_gemv);
}

}  // namespace loom::engine
