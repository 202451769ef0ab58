#include "engine/model/mla.h"

#include <cmath>
#include <limits>

namespace loom::engine {
namespace {

// Slot s's kv_b LoRA factors at its own rank, for the decode's latent
// space: A [r, R] and B [H (dn + dv), r] in fp32, and alpha/r; or none.
struct SlotFactors {
  at::Tensor A, B;
  double scale = 0;
  bool defined() const { return A.defined(); }
};

SlotFactors Factors(const SlotBank& bank, const LoraTarget* kv_b, int slot) {
  if (!kv_b || slot < 0 || !bank.trains(slot, kv_b->group)) return {};
  const LoraConfig& c = bank.slot(slot).config;
  return {kv_b->A.select(0, slot).narrow(0, 0, c.rank), kv_b->B.select(0, slot).narrow(1, 0, c.rank),
          c.alpha / c.rank};
}

}  // namespace

at::Tensor MlaRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor c = cos.narrow(-1, 0, half), s = sin.narrow(-1, 0, half);
  at::Tensor x0, x1;
  if (interleave) {
    const at::Tensor pairs = xf.unflatten(-1, {half, 2});
    x0 = pairs.select(-1, 0);
    x1 = pairs.select(-1, 1);
  } else {
    x0 = xf.narrow(-1, 0, half);
    x1 = xf.narrow(-1, half, half);
  }
  const at::Tensor y0 = x0 * c - x1 * s, y1 = x1 * c + x0 * s;
  const at::Tensor y = interleave ? at::stack({y0, y1}, -1).flatten(-2) : at::cat({y0, y1}, -1);
  return y.to(x.scalar_type());
}

at::Tensor MlaDecodeAttention(const MlaWeights& w, const at::Tensor& q, const at::Tensor& pool, const at::Tensor& rows,
                              const at::Tensor& mask, const SlotBank& bank, const LoraTarget* kv_b,
                              const std::vector<int>& seq_slot) {
  const int64_t S = q.size(0), H = w.heads, dn = w.nope, dv = w.v, R = w.rank, L = rows.size(1);
  const at::ScalarType dt = q.scalar_type();
  const at::Tensor lat = pool.index_select(0, rows.reshape({-1})).view({S, L, -1}).to(dt);  // [S, L, R + dr]
  const at::Tensor c = lat.narrow(-1, 0, R), k_rope = lat.narrow(-1, R, w.rope);
  const at::Tensor q_nope = q.narrow(-1, 0, dn), q_rope = q.narrow(-1, dn, w.rope);
  const at::Tensor wb = w.kv_b_w.view({H, dn + dv, R});
  const at::Tensor wk = wb.narrow(1, 0, dn), wv = wb.narrow(1, dn, dv);  // [H, dn, R], [H, dv, R]
  // Each head's query in the latent space: q_nope W_k,h ([S, H, R]), plus
  // the row's LoRA: alpha/r (q_nope B_k,h) A.
  at::Tensor q_lat = at::einsum("shd,hdr->shr", {q_nope, wk});
  std::vector<SlotFactors> factors(S);
  for (int64_t i = 0; i < S; ++i) factors[i] = Factors(bank, kv_b, seq_slot[i]);
  for (int64_t i = 0; i < S; ++i) {
    const SlotFactors& f = factors[i];
    if (!f.defined()) continue;
    const at::Tensor bk = f.B.view({H, dn + dv, -1}).narrow(1, 0, dn).to(at::kFloat);  // [H, dn, r]
    const at::Tensor mid = at::einsum("hd,hdk->hk", {q_nope[i].to(at::kFloat), bk});    // [H, r]
    q_lat[i] += (at::matmul(mid, f.A.to(at::kFloat)) * f.scale).to(dt);
  }
  at::Tensor scores = (at::einsum("shr,slr->shl", {q_lat, c}) + at::einsum("shd,sld->shl", {q_rope, k_rope})) *
                      (1.0 / std::sqrt(static_cast<double>(w.qk())));
  scores = scores.masked_fill(mask.logical_not().unsqueeze(1), -std::numeric_limits<double>::infinity());
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(dt);
  const at::Tensor ctx = at::einsum("shl,slr->shr", {probs, c});  // [S, H, R]
  at::Tensor out = at::einsum("shr,hvr->shv", {ctx, wv});         // [S, H, dv]
  for (int64_t i = 0; i < S; ++i) {
    const SlotFactors& f = factors[i];
    if (!f.defined()) continue;
    const at::Tensor bv = f.B.view({H, dn + dv, -1}).narrow(1, dn, dv).to(at::kFloat);  // [H, dv, r]
    const at::Tensor mid = at::matmul(ctx[i].to(at::kFloat), f.A.to(at::kFloat).t());  // [H, r]
    out[i] += (at::einsum("hvk,hk->hv", {bv, mid}) * f.scale).to(dt);
  }
  return out.reshape({S, H * dv});
}

std::pair<at::Tensor, at::Tensor> MlaExpandLatent(const MlaWeights& w, const at::Tensor& lat, const SlotBank& bank,
                                                  const LoraTarget* kv_b, int slot) {
  const int64_t n = lat.size(0), H = w.heads, dn = w.nope;
  const at::Tensor c = lat.narrow(-1, 0, w.rank), k_rope = lat.narrow(-1, w.rank, w.rope);
  at::Tensor kv = at::linear(c, w.kv_b_w);  // [n, H (dn + dv)]
  if (const SlotFactors f = Factors(bank, kv_b, slot); f.defined())
    kv = kv + (at::linear(at::linear(c.to(at::kFloat), f.A.to(at::kFloat)), f.B.to(at::kFloat)) * f.scale)
                  .to(kv.scalar_type());
  const at::Tensor heads = kv.view({n, H, dn + w.v});
  const at::Tensor k = at::cat({heads.narrow(-1, 0, dn), k_rope.unsqueeze(1).expand({n, H, w.rope})}, -1);
  return {k, heads.narrow(-1, dn, w.v)};
}

}  // namespace loom::engine
