#include "engine/lora/lora_nodes.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "engine/lora/slot_rows.h"
#include "engine/model/compat.h"

namespace loom::engine {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The plain forward of the segment form (also the no-grad path).
at::Tensor SegmentForward(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                          const std::vector<LoraRun>& runs, at::ScalarType ct, int64_t d_out) {
  const at::Tensor xc = x.to(ct);
  const int64_t rows = x.size(0);
  std::vector<at::Tensor> parts;
  int64_t covered = 0;
  for (const LoraRun& r : runs) {
    if (r.len == 0) continue;
    covered = r.begin + r.len;
    if (r.slot < 0) {
      parts.push_back(at::zeros({r.len, d_out}, xc.options()));
      continue;
    }
    const at::Tensor a = A.select(0, r.slot).narrow(0, 0, r.rank).to(ct);  // [r, d_in]
    const at::Tensor b = B.select(0, r.slot).narrow(1, 0, r.rank).to(ct);  // [d_out, r]
    // Scaled at rank width, not output width: one pass over [len, r] instead of [len, d_out].
    parts.push_back(at::linear(at::linear(xc.narrow(0, r.begin, r.len), a) * r.scale, b));
  }
  if (covered < rows) parts.push_back(at::zeros({rows - covered, d_out}, xc.options()));
  if (parts.empty()) return at::zeros({rows, d_out}, xc.options());
  if (parts.size() == 1) return parts[0];
  return at::cat(parts, 0);
}

std::vector<int64_t> PackRuns(const std::vector<LoraRun>& runs, std::vector<double>& scales) {
  std::vector<int64_t> v;
  for (const LoraRun& r : runs) {
    v.insert(v.end(), {r.begin, r.len, r.slot, r.rank});
    scales.push_back(r.scale);
  }
  return v;
}

std::vector<LoraRun> UnpackRuns(const std::vector<int64_t>& v, const std::vector<double>& scales) {
  std::vector<LoraRun> runs(scales.size());
  for (size_t i = 0; i < runs.size(); ++i) runs[i] = LoraRun{v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3], scales[i]};
  return runs;
}

class SegmentNode : public torch::autograd::Function<SegmentNode> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                            const std::vector<int64_t>& packed, const std::vector<double>& scales, int64_t ct,
                            int64_t d_out) {
    c10::NoGradGuard no_grad;
    ctx->save_for_backward({x, A, B});
    ctx->saved_data["runs"] = packed;
    ctx->saved_data["scales"] = scales;
    ctx->saved_data["ct"] = ct;
    return SegmentForward(x, A, B, UnpackRuns(packed, scales), static_cast<at::ScalarType>(ct), d_out);
  }

  // Per run, as the graph of linear(linear(x, a) * scale, b) gives it:
  // h = (x a^T) scale; gB = g^T h; gh = g b; gxa = gh scale; gA = gxa^T x; gx = gxa a.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &A = saved[1], &B = saved[2];
    const auto runs = UnpackRuns(ctx->saved_data["runs"].toIntVector(), ctx->saved_data["scales"].toDoubleVector());
    const auto ct = static_cast<at::ScalarType>(ctx->saved_data["ct"].toInt());
    const at::Tensor& g = grads[0];
    variable_list out(7);
    if (!g.defined()) return out;
    c10::NoGradGuard no_grad;
    const bool need_x = ctx->needs_input_grad(0);
    const at::Tensor xc = x.to(ct);
    const at::Tensor gc = g.to(ct);
    at::Tensor gx = need_x ? at::zeros(x.sizes(), xc.options()) : at::Tensor();
    for (const LoraRun& r : runs) {
      if (r.slot < 0 || r.len == 0) continue;
      const at::Tensor a = A.select(0, r.slot).narrow(0, 0, r.rank).to(ct);
      const at::Tensor b = B.select(0, r.slot).narrow(1, 0, r.rank).to(ct);
      const at::Tensor xr = xc.narrow(0, r.begin, r.len), gr = gc.narrow(0, r.begin, r.len);
      const at::Tensor h = at::linear(xr, a) * r.scale;  // [len, r]
      FactorGrad(B).select(0, r.slot).narrow(1, 0, r.rank).add_(at::mm(gr.t(), h));
      const at::Tensor gxa = at::mm(gr, b) * r.scale;  // [len, r]
      FactorGrad(A).select(0, r.slot).narrow(0, 0, r.rank).add_(at::mm(gxa.t(), xr));
      if (need_x) gx.narrow(0, r.begin, r.len).copy_(at::mm(gxa, a));
    }
    if (need_x) out[0] = gx.to(x.scalar_type());
    return out;
  }
};

// Whether at::_grouped_mm takes t as it is: bf16 on CUDA, 16-byte aligned,
// its last two dims row- or column-major with a 16-byte leading stride.
bool GroupedMmTakes(const at::Tensor& t) {
  if (!compat::kHasGroupedMm || !t.is_cuda() || t.scalar_type() != at::kBFloat16) return false;
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  const int64_t d = t.dim();
  const int64_t s0 = t.stride(d - 2), s1 = t.stride(d - 1);
  const bool rows = s1 == 1 && s0 >= t.size(d - 1) && s0 % 8 == 0;
  const bool cols = s0 == 1 && s1 >= t.size(d - 2) && s1 % 8 == 0;
  return (rows || cols) && (d == 2 || t.stride(0) % 8 == 0);
}

at::Tensor ForGroupedMm(const at::Tensor& t) { return GroupedMmTakes(t) ? t : t.contiguous(); }

// How a grouped node's rows [n, .] fall into its U groups: the padded order
// (U runs of Lmax rows, n = U * Lmax: batched GEMMs over [U, Lmax, .]
// views), or the ragged one (LoraGroups::ragged: group u's rows end at
// ends[u], n = T: grouped GEMMs over the packed rows, at::_grouped_mm for
// bf16 on CUDA, else one GEMM per group).
struct RowGroups {
  int64_t U = 0, L = 0;
  at::Tensor scale;               // padded: [U, 1, 1]; ragged: [n, 1]; in the compute type
  at::Tensor ends;                // ragged: [U] int32 (undefined: padded)
  std::vector<int64_t> ends_host;

  RowGroups(const LoraGroups& r, at::ScalarType ct)
      : U(r.num_slots()), L(r.max_rows), scale((r.ragged ? r.row_scale : r.scale).to(ct)),
        ends(r.ragged ? r.ends : at::Tensor()), ends_host(r.ragged ? r.ends_host : std::vector<int64_t>()) {}
  RowGroups(int64_t u, int64_t l, at::Tensor s, at::Tensor e, std::vector<int64_t> eh)
      : U(u), L(l), scale(std::move(s)), ends(std::move(e)), ends_host(std::move(eh)) {}
  bool ragged() const { return ends.defined(); }
  int64_t Begin(int64_t u) const { return u == 0 ? 0 : ends_host[static_cast<size_t>(u - 1)]; }
  bool Grouped(const at::Tensor& a, const at::Tensor& b) const {
    return compat::kHasGroupedMm && a.is_cuda() && a.scalar_type() == at::kBFloat16 &&
           b.scalar_type() == at::kBFloat16 && a.size(-1) % 8 == 0 && b.size(-1) % 8 == 0;
  }

  // x [n, K] times w[u] [K, N] for group u's rows: into out [n, N] (added
  // to it where add), or a new tensor (out undefined).
  at::Tensor Rows(const at::Tensor& x, const at::Tensor& w, at::Tensor out = {}, bool add = false) const {
    const int64_t N = w.size(2);
    if (!ragged()) {
      const at::Tensor xv = x.view({U, L, x.size(1)});
      if (!out.defined()) return at::bmm(xv, w).view({U * L, N});
      at::Tensor ov = out.view({U, L, N});
      if (add)
        ov.baddbmm_(xv, w);
      else
        at::bmm_out(ov, xv, w);
      return out;
    }
    if (Grouped(x, w)) {
      const at::Tensor y = compat::GroupedMm(ForGroupedMm(x), ForGroupedMm(w), ends);
      if (!out.defined()) return y;
      return add ? out.add_(y) : out.copy_(y);
    }
    if (!out.defined()) out = at::empty({x.size(0), N}, x.options());
    for (int64_t u = 0; u < U; ++u) {
      const int64_t b = Begin(u), n = ends_host[static_cast<size_t>(u)] - b;
      at::Tensor o = out.narrow(0, b, n);
      if (add)
        o.addmm_(x.narrow(0, b, n), w.select(0, u));
      else
        o.copy_(at::mm(x.narrow(0, b, n), w.select(0, u)));
    }
    return out;
  }
  // Each group's p_u^T q_u, p [n, M], q [n, N]: [U, M, N] (into out where given).
  at::Tensor Sum(const at::Tensor& p, const at::Tensor& q, at::Tensor out = {}) const {
    if (!ragged()) {
      const at::Tensor pv = p.view({U, L, p.size(1)}).transpose(1, 2), qv = q.view({U, L, q.size(1)});
      if (!out.defined()) return at::bmm(pv, qv);
      return at::bmm_out(out, pv, qv);
    }
    if (Grouped(p, q)) {
      const at::Tensor y = compat::GroupedMm(ForGroupedMm(p.t()), ForGroupedMm(q), ends);
      return out.defined() ? out.copy_(y) : y;
    }
    if (!out.defined()) out = at::empty({U, p.size(1), q.size(1)}, p.options());
    for (int64_t u = 0; u < U; ++u) {
      const int64_t b = Begin(u), n = ends_host[static_cast<size_t>(u)] - b;
      out.select(0, u).copy_(at::mm(p.narrow(0, b, n).t(), q.narrow(0, b, n)));
    }
    return out;
  }
  // h [n, R] times its group's alpha / r.
  at::Tensor Scaled(const at::Tensor& h) const {
    if (ragged()) return h * scale;
    return (h.view({U, L, h.size(1)}) * scale).view({U * L, h.size(1)});
  }
};

// A grouped node's gradient of one factor, Sum(p, q): into its view of the
// pass's gradient buffer when there is one (written once; the flush adds
// it), else added into the bank factor's .grad rows of `slots`. The same
// bf16 (or fp32) product either way, so the same bits reach .grad.
void FactorGradSum(const at::Tensor& into, const at::Tensor& factor, const at::Tensor& slots, const RowGroups& rg,
                   const at::Tensor& p, const at::Tensor& q) {
  if (into.defined()) {
    rg.Sum(p, q, into);
    return;
  }
  FactorGrad(factor).index_add_(0, slots, rg.Sum(p, q).to(factor.scalar_type()));
}

// A node's own copy of an optional tensor input's presence: custom nodes
// take only defined tensors.
at::Tensor OrEmpty(const at::Tensor& t) { return t.defined() ? t : at::empty({0}); }

// The grouped form's rows. Its GEMMs run over the padded order [U * Lmax]
// (LoraGroups): a gather of the packed rows (none for an identity routing),
// and back, a gather of the padded rows by each packed row's position, a
// zero row appended for rows without a training slot. No index_add either
// way: each packed row sits at exactly one padded position.
at::Tensor ToPadded(const at::Tensor& x, const at::Tensor& gather) { return x.index_select(0, gather); }
at::Tensor FromPadded(const at::Tensor& yp, const at::Tensor& scatter, bool base_rows) {
  const at::Tensor src = base_rows ? at::cat({yp, at::zeros({1, yp.size(1)}, yp.options())}, 0) : yp;
  return src.index_select(0, scatter);
}

// ToPadded as a recorded node: x's gradient is the padded gradient read back
// at each row's position (the pads' gradient is dropped).
class PadRowsNode : public torch::autograd::Function<PadRowsNode> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const LoraGroups* routing) {
    c10::NoGradGuard no_grad;
    ctx->save_for_backward({routing->scatter});
    ctx->saved_data["base_rows"] = routing->base_rows;
    return ToPadded(x, routing->gather);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::NoGradGuard no_grad;
    variable_list out(2);
    if (grads[0].defined())
      out[0] = FromPadded(grads[0], ctx->get_saved_variables()[0], ctx->saved_data["base_rows"].toBool());
    return out;
  }
};

// FromPadded as a recorded node: the padded gradient is the rows' gradient
// gathered to their positions, the pads' zeroed (so the grouped GEMMs'
// factor gradients add exact zeros for them, as for a zero row).
class UnpadRowsNode : public torch::autograd::Function<UnpadRowsNode> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& yp, const LoraGroups* routing) {
    c10::NoGradGuard no_grad;
    ctx->save_for_backward({routing->gather, routing->pads});
    return FromPadded(yp, routing->scatter, routing->base_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::NoGradGuard no_grad;
    variable_list out(2);
    if (!grads[0].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    at::Tensor gp = ToPadded(grads[0], saved[0]);
    if (saved[1].defined()) gp.index_fill_(0, saved[1], 0);
    out[0] = gp;
    return out;
  }
};

// f over x's rows in the routing's padded order (recorded), its output read
// back to x's rows; f(x) itself where the rows already are in that order.
template <typename F>
at::Tensor InPaddedOrder(const at::Tensor& x, const LoraGroups& routing, F&& f) {
  if (routing.identity) return f(x);
  return UnpadRowsNode::apply(f(PadRowsNode::apply(x, &routing)), &routing);
}

// What the grouped form's backward reuses of its forward: the padded input
// and rank-wide hidden, the scale in the compute type, and (for few groups,
// where the copies are small) the slots' factors in the compute type.
struct GroupedSaved {
  at::Tensor xp, h, scale, a, b;
};
constexpr int64_t kKeepFactorsUpTo = 2;  // groups; the memory plan's probes take 2 slots

// The grouped form over rows already in padded order, xp [U * Lmax, d_in]:
// [U * Lmax, d_out] in the compute type.
at::Tensor GroupedPadded(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const LoraGroups& routing,
                         at::ScalarType ct, int64_t d_out, const at::Tensor& a_cast, const at::Tensor& b_cast,
                         GroupedSaved* saved = nullptr) {
  const int64_t U = routing.num_slots(), L = routing.max_rows, d_in = x.size(1);
  const at::Tensor xp = x.to(ct).view({U, L, d_in});
  const bool cast = a_cast.defined() && b_cast.defined();
  const at::Tensor a = cast ? a_cast : A.index_select(0, routing.slots).to(ct);  // [U, R, d_in]
  const at::Tensor b = cast ? b_cast : B.index_select(0, routing.slots).to(ct);  // [U, d_out, R]
  const at::Tensor scale = routing.scale.to(ct);
  const at::Tensor h = at::bmm(xp, a.transpose(1, 2)) * scale;   // [U, L, R]
  if (saved) {
    *saved = GroupedSaved{xp, h, scale, at::Tensor(), at::Tensor()};
    if (cast || U <= kKeepFactorsUpTo) {  // views of the pass's cast factors cost nothing to keep
      saved->a = a;
      saved->b = b;
    }
  }
  return at::bmm(h, b.transpose(1, 2)).view({U * L, d_out});
}

// The plain forward of the grouped form. Gather first, then cast: a copy of
// the padded rows only (none when the rows already are in padded order, e.g.
// 16 tenants x 512).
at::Tensor GroupedForward(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const LoraGroups& routing,
                          at::ScalarType ct, int64_t d_out, const at::Tensor& a_cast, const at::Tensor& b_cast) {
  if (routing.num_slots() == 0) return at::zeros({x.size(0), d_out}, x.options().dtype(ct));
  if (routing.identity) return GroupedPadded(x, A, B, routing, ct, d_out, a_cast, b_cast);
  return FromPadded(GroupedPadded(ToPadded(x, routing.gather), A, B, routing, ct, d_out, a_cast, b_cast),
                    routing.scatter, routing.base_rows);
}

// The grouped form's node over rows in padded order (GroupedLoraDelta puts
// them there and back with the two nodes above).
class GroupedNode : public torch::autograd::Function<GroupedNode> {
 public:
  // token: the pass's flush token, or empty (no gradient buffer).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                            const at::Tensor& token, const LoraGroups* routing, int64_t ct, int64_t d_out,
                            const JointTarget* cast) {
    c10::NoGradGuard no_grad;
    (void)token;
    GroupedSaved sv;
    const at::Tensor none;
    at::Tensor y = GroupedPadded(x, A, B, *routing, static_cast<at::ScalarType>(ct), d_out, cast ? cast->a : none,
                                 cast ? cast->b : none, &sv);
    // Not saved_for_backward: the buffer is written by every node of the
    // pass, which would fail the saved-variable version check.
    ctx->saved_data["ga"] = cast ? cast->ga : none;
    ctx->saved_data["gb"] = cast ? cast->gb : none;
    ctx->save_for_backward({sv.xp, sv.h, A, B, routing->slots, sv.scale, sv.a, sv.b});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xp = saved[0], &h = saved[1], &A = saved[2], &B = saved[3], &slots = saved[4],
                     &scale = saved[5];  // scale in the compute type
    const int64_t U = xp.size(0), L = xp.size(1), d_in = xp.size(2);
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const at::Tensor& g = grads[0];
    variable_list out(9);
    if (!g.defined()) return out;
    c10::NoGradGuard no_grad;
    const at::ScalarType ct = xp.scalar_type();
    const at::Tensor ga = ctx->saved_data["ga"].toTensor(), gb = ctx->saved_data["gb"].toTensor();
    const at::Tensor gp = g.to(ct).view({U, L, -1});
    const at::Tensor a = saved[6].defined() ? saved[6] : A.index_select(0, slots).to(ct);  // [U, R, d_in]
    const at::Tensor b = saved[7].defined() ? saved[7] : B.index_select(0, slots).to(ct);  // [U, d_out, R]
    const RowGroups rg(U, L, scale, at::Tensor(), {});  // the padded order, over flat [U * L, .] rows
    const auto flat = [&](const at::Tensor& t) { return t.view({U * L, -1}); };
    // y = bmm(h, b^T): gB = gp^T h; gh = gp b; h = bmm(xp, a^T) scale: gxa = gh scale.
    FactorGradSum(gb, B, slots, rg, flat(gp), flat(h));
    const at::Tensor gxa = at::bmm(gp, b) * scale;  // [U, L, R]
    FactorGradSum(ga, A, slots, rg, flat(gxa), flat(xp));
    if (!ctx->needs_input_grad(0)) return out;
    out[0] = at::bmm(gxa, a).view({U * L, d_in}).to(x_dtype);
    return out;
  }
};

// The targets' cast a factors side by side, [U, sum R, d_in] (a copy of a
// few MB; none for one target).
at::Tensor JointA(const std::vector<JointTarget>& targets) {
  if (targets.size() == 1) return targets[0].a;
  std::vector<at::Tensor> as;
  for (const JointTarget& t : targets) as.push_back(t.a);
  return at::cat(as, 1);
}

// Several targets of one input over the grouped form with rows in padded
// order (routing.identity) or ragged, and factors cast once
// (JointGroupedLoraDelta).
class JointGroupedNode : public torch::autograd::Function<JointGroupedNode> {
 public:
  // anchor: the first target's A (a leaf that requires grad, so that the
  // node is recorded even where x needs no gradient); the factors' own
  // gradients are added in place (FactorGrad), as GroupedNode's.
  // weight (and bias), when not empty: the frozen base projection of the
  // targets' columns, computed here too (ProjectedJointLora).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& anchor,
                            const at::Tensor& token, const at::Tensor& weight, const at::Tensor& bias,
                            const std::vector<JointTarget>* targets, const LoraGroups* routing, int64_t ct_in) {
    c10::NoGradGuard no_grad;
    (void)anchor, (void)token;
    std::vector<at::Tensor> into;  // the targets' gradient views (B's, A's), or undefined; not saved (GroupedNode)
    const auto ct = static_cast<at::ScalarType>(ct_in);
    const RowGroups rg(*routing, ct);
    int64_t width = 0;
    for (const JointTarget& t : *targets) width += t.b.size(1);
    const at::Tensor xc = x.to(ct);
    const bool base = weight.numel() > 0, biased = bias.numel() > 0;
    // With the base, the deltas are written first and the base GEMM adds
    // itself to them (beta 1): its epilogue reads them while its main loop,
    // which bounds it, runs; the other way round, each delta's rank-R GEMM
    // would read the base's [n, d_out] columns and write them again (memory
    // bound). With a bias, the base is first and each delta added into its
    // columns (the padded order's GEMMs: beta 1). Deltas first, each delta
    // is rounded once on its own before the base is added.
    const bool deltas_first = base && !biased;
    const bool own_output = deltas_first && targets->size() == 1;  // y is the one delta GEMM's output
    at::Tensor y = base && biased ? at::linear(x, weight, bias)
                   : own_output   ? at::Tensor()
                                  : at::empty({x.size(0), width}, xc.options());
    // One GEMM for every target's hidden (they read the same rows): the
    // targets' a side by side, [U, sum R, d_in]; h [n, sum R].
    const at::Tensor a_all = JointA(*targets);
    const at::Tensor h_all = rg.Scaled(rg.Rows(xc, a_all.transpose(1, 2)));
    variable_list keep{xc, rg.scale, OrEmpty(rg.ends), routing->slots, weight, h_all};
    std::vector<int64_t> widths, ranks;
    int64_t at = 0, r_at = 0;
    for (const JointTarget& t : *targets) {
      const int64_t w = t.b.size(1), r = t.a.size(1);
      if (own_output)
        y = rg.Rows(h_all, t.b.transpose(1, 2));  // no copy where ragged
      else
        rg.Rows(h_all.narrow(1, r_at, r), t.b.transpose(1, 2), y.narrow(1, at, w), base && biased);
      keep.insert(keep.end(), {t.a, t.b, t.A, t.B});
      into.insert(into.end(), {t.gb, t.ga});
      widths.push_back(w);
      ranks.push_back(r);
      at += w;
      r_at += r;
    }
    if (deltas_first) y.addmm_(x, weight.t());
    ctx->save_for_backward(keep);
    ctx->saved_data["into"] = c10::List<at::Tensor>(into);
    ctx->saved_data["widths"] = widths;
    ctx->saved_data["ranks"] = ranks;
    ctx->saved_data["groups"] = std::vector<int64_t>{rg.U, rg.L};
    ctx->saved_data["ends"] = rg.ends_host;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["need_x"] = x.requires_grad();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto widths = ctx->saved_data["widths"].toIntVector();
    const auto ranks = ctx->saved_data["ranks"].toIntVector();
    const auto groups = ctx->saved_data["groups"].toIntVector();
    const at::Tensor &xc = saved[0], &slots = saved[3], &weight = saved[4], &h_all = saved[5];
    const RowGroups rg(groups[0], groups[1], saved[1], saved[2].numel() > 0 ? saved[2] : at::Tensor(),
                       ctx->saved_data["ends"].toIntVector());
    const at::Tensor& g = grads[0];
    variable_list out(8);  // one per apply() argument
    const auto into = ctx->saved_data["into"].toTensorList();
    if (!g.defined()) return out;
    c10::NoGradGuard no_grad;
    const size_t n = widths.size();
    const at::Tensor gp = g.to(xc.scalar_type());
    const bool need_x = ctx->saved_data["need_x"].toBool();
    const auto target = [&](size_t i, int k) -> const at::Tensor& { return saved[6 + 4 * i + k]; };  // a, b, A, B
    // Per target: B's gradient and gh = g b; then, for all of them at once,
    // gxa = gh scale [n, sum R], A's gradients and x's.
    std::vector<at::Tensor> gh;
    int64_t at = 0, r_at = 0;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor gt = gp.narrow(1, at, widths[i]);
      FactorGradSum(into.get(2 * i), target(i, 3), slots, rg, gt, h_all.narrow(1, r_at, ranks[i]));
      gh.push_back(rg.Rows(gt, target(i, 1)));
      at += widths[i];
      r_at += ranks[i];
    }
    const at::Tensor gxa = rg.Scaled(n == 1 ? gh[0] : at::cat(gh, 1));  // [n, sum R]
    bool all_into = true;
    for (size_t i = 0; i < n; ++i) all_into = all_into && into.get(2 * i + 1).defined();
    if (all_into && n > 1) {
      // One GEMM over x for every A, its rows then copied to their buffers.
      const at::Tensor ga = rg.Sum(gxa, xc);  // [U, sum R, d_in]
      r_at = 0;
      for (size_t i = 0; i < n; ++i) {
        into.get(2 * i + 1).copy_(ga.narrow(1, r_at, ranks[i]));
        r_at += ranks[i];
      }
    } else {
      r_at = 0;
      for (size_t i = 0; i < n; ++i) {
        FactorGradSum(into.get(2 * i + 1), target(i, 2), slots, rg, gxa.narrow(1, r_at, ranks[i]), xc);
        r_at += ranks[i];
      }
    }
    // One input gradient for all the targets: the deltas' GEMM writes it and
    // the base's, where there is one, adds itself to it (beta 1), as in the
    // forward.
    if (need_x) {
      std::vector<at::Tensor> as;
      for (size_t i = 0; i < n; ++i) as.push_back(target(i, 0));
      const at::Tensor a_all = n == 1 ? as[0] : at::cat(as, 1);
      at::Tensor gx = rg.Rows(gxa, a_all);
      if (weight.numel() > 0) gx.addmm_(g, weight);
      out[0] = gx.to(static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt()));
    }
    return out;
  }
};

bool Differentiable(const at::Tensor& A) { return c10::GradMode::is_enabled() && A.requires_grad(); }

}  // namespace

at::Tensor& FactorGrad(const at::Tensor& factor) {
  at::Tensor& g = const_cast<at::Tensor&>(factor).mutable_grad();
  if (!g.defined()) g = at::zeros_like(factor);
  return g;
}

at::Tensor SegmentLoraDelta(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                            const std::vector<LoraRun>& runs, at::ScalarType ct, int64_t d_out) {
  if (!Differentiable(A)) return SegmentForward(x, A, B, runs, ct, d_out);
  std::vector<double> scales;
  const std::vector<int64_t> packed = PackRuns(runs, scales);
  return SegmentNode::apply(x, A, B, packed, scales, static_cast<int64_t>(ct), d_out);
}

at::Tensor GroupedLoraDelta(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const LoraGroups& routing,
                            at::ScalarType ct, int64_t d_out, const JointTarget* cast, const at::Tensor& token) {
  if (!Differentiable(A) || routing.num_slots() == 0)
    return GroupedForward(x, A, B, routing, ct, d_out, cast ? cast->a : at::Tensor(), cast ? cast->b : at::Tensor());
  // The cast factors go by pointer: as node inputs, autograd would route
  // gradients to them (they are computed from the bank without a graph).
  // Ragged rows take the joint node of one target, which runs over them as
  // they are.
  if (routing.ragged && cast) return JointGroupedLoraDelta(x, {*cast}, routing, ct, token);
  return InPaddedOrder(x, routing, [&](const at::Tensor& xp) {
    return GroupedNode::apply(xp, A, B, OrEmpty(token), &routing, static_cast<int64_t>(ct), d_out, cast);
  });
}

at::Tensor JointGroupedLoraDelta(const at::Tensor& x, const std::vector<JointTarget>& targets,
                                 const LoraGroups& routing, at::ScalarType ct, const at::Tensor& token) {
  TORCH_CHECK(!targets.empty() && routing.num_slots() > 0 && x.size(0) == routing.rows,
              "JointGroupedLoraDelta: targets and a routing of x's rows with a group");
  if (!Differentiable(targets[0].A)) {
    std::vector<at::Tensor> parts;
    for (const JointTarget& t : targets) parts.push_back(GroupedForward(x, t.A, t.B, routing, ct, t.b.size(1), t.a, t.b));
    return at::cat(parts, 1);
  }
  const at::Tensor none = at::empty({0}, x.options());
  const auto joint = [&](const at::Tensor& xp) {
    return JointGroupedNode::apply(xp, targets[0].A, OrEmpty(token), none, none, &targets, &routing,
                                   static_cast<int64_t>(ct));
  };
  return routing.ragged ? joint(x) : InPaddedOrder(x, routing, joint);
}

at::Tensor ProjectedJointLora(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                              const std::vector<JointTarget>& targets, const LoraGroups& routing,
                              const at::Tensor& token) {
  int64_t width = 0;
  for (const JointTarget& t : targets) width += t.b.size(1);
  TORCH_CHECK((routing.identity || routing.ragged) && !routing.base_rows && !targets.empty() &&
                  x.size(0) == routing.rows && Differentiable(targets[0].A) && weight.size(0) == width &&
                  targets[0].a.scalar_type() == x.scalar_type(),
              "ProjectedJointLora: rows in padded order or ragged, every row in a group, factors in x's dtype, "
              "weight rows the targets' columns");
  return JointGroupedNode::apply(x, targets[0].A, OrEmpty(token), weight,
                                 bias.defined() ? bias : at::empty({0}, x.options()), &targets, &routing,
                                 static_cast<int64_t>(x.scalar_type()));
}

namespace {

// The pass's gradient buffer into the bank, once (GradientFlushToken).
class FlushNode : public torch::autograd::Function<FlushNode> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& anchor, const at::Tensor* grad,
                            const at::Tensor* flat_grad_cols, const at::Tensor* slots) {
    ctx->set_materialize_grads(false);  // the nodes behind it send no gradient, only the signal that they ran
    ctx->saved_data["grad"] = *grad;
    ctx->saved_data["into"] = *flat_grad_cols;
    ctx->saved_data["slots"] = *slots;
    return at::zeros({1}, anchor.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list) {
    c10::NoGradGuard no_grad;
    AddSlotRows(ctx->saved_data["into"].toTensor(), ctx->saved_data["slots"].toTensor(),
                ctx->saved_data["grad"].toTensor());
    return variable_list(4);
  }
};

}  // namespace

at::Tensor GradientFlushToken(const at::Tensor& anchor, const at::Tensor& grad, const at::Tensor& flat_grad_cols,
                              const at::Tensor& slots) {
  return FlushNode::apply(anchor, &grad, &flat_grad_cols, &slots);
}

}  // namespace loom::engine
