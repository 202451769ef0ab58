#include "engine/model/gated_deltanet.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace loom::engine {
namespace {

// An int64 index tensor on `device`.
at::Tensor Index(const std::vector<int64_t>& v, at::Device device) {
  return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong)).to(device);
}

void CheckOffsets(const std::vector<int64_t>& seq_begin, int64_t rows) {
  TORCH_CHECK(seq_begin.size() >= 1 && seq_begin.front() == 0 && seq_begin.back() == rows,
              "seq_begin must run from 0 to the row count ", rows);
  for (size_t i = 1; i < seq_begin.size(); ++i)
    TORCH_CHECK(seq_begin[i] >= seq_begin[i - 1], "seq_begin must not decrease");
}

// x * rsqrt(sum x^2 + eps) over the last dim (HF's l2norm, eps 1e-6 inside
// the root, as FLA's kernels).
at::Tensor L2Norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, true) + 1e-6); }

// The rule's inputs in its working form: fp32, heads before tokens
// ([B, Hv, L, d] and [B, Hv, L]), q and k repeated to Hv heads (each key
// head serving Hv / Hk consecutive value heads), L2-normalised, q scaled.
struct Prepared {
  at::Tensor q, k, v, g, beta;
  int64_t batch() const { return q.size(0); }
  int64_t heads() const { return q.size(1); }
  int64_t len() const { return q.size(2); }
  int64_t dk() const { return q.size(3); }
  int64_t dv() const { return v.size(3); }
};

// From tokens-first inputs q, k [B, L, Hk, dk], v [B, L, Hv, dv], g, beta [B, L, Hv].
Prepared Prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                 const at::Tensor& beta) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4, "q, k must be [.., Hk, dk], v [.., Hv, dv]");
  const int64_t B = q.size(0), L = q.size(1), Hk = q.size(2), Hv = v.size(2);
  TORCH_CHECK(v.size(0) == B && v.size(1) == L, "v must have q's rows");
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, "the value heads (", Hv, ") must be a multiple of the key heads (", Hk, ")");
  TORCH_CHECK(g.dim() == 3 && g.size(0) == B && g.size(1) == L && g.size(2) == Hv && beta.sizes() == g.sizes(),
              "g and beta must be [.., Hv]");
  const int64_t group = Hv / Hk;
  const auto heads_first = [&](const at::Tensor& x) {
    at::Tensor y = x.to(at::kFloat);
    if (group > 1) y = y.repeat_interleave(group, 2);
    return y.transpose(1, 2);
  };
  Prepared p;
  p.q = L2Norm(heads_first(q)) * (1.0 / std::sqrt(static_cast<double>(q.size(3))));
  p.k = L2Norm(heads_first(k));
  p.v = v.to(at::kFloat).transpose(1, 2);
  p.g = g.to(at::kFloat).transpose(1, 2);
  p.beta = beta.to(at::kFloat).transpose(1, 2);
  return p;
}

// The initial state [B, H, dk, dv] in fp32: the given one, or zeros.
at::Tensor InitialState(const at::Tensor& s, const Prepared& p) {
  const std::vector<int64_t> shape{p.batch(), p.heads(), p.dk(), p.dv()};
  if (!s.defined()) return at::zeros(shape, p.v.options());
  TORCH_CHECK(s.sizes() == at::IntArrayRef(shape), "the initial state must be [", p.heads(), ", ", p.dk(), ", ", p.dv(),
              "] a sequence, got ", s.sizes());
  return s.to(at::kFloat);
}

// One token of the recurrence, state S [B, H, dk, dv], q, k [B, H, dk],
// v [B, H, dv], g, beta [B, H]: decay, then the delta-rule write of the
// part of v the decayed state does not predict, then the read by q.
std::pair<at::Tensor, at::Tensor> Step(at::Tensor S, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& g, const at::Tensor& beta) {
  S = S * g.exp().unsqueeze(-1).unsqueeze(-1);
  const at::Tensor predicted = at::matmul(k.unsqueeze(-2), S).squeeze(-2);  // S^T k [B, H, dv]
  const at::Tensor delta = (v - predicted) * beta.unsqueeze(-1);
  S = S + k.unsqueeze(-1) * delta.unsqueeze(-2);
  return {at::matmul(q.unsqueeze(-2), S).squeeze(-2), S};
}

// The recurrence over p's L tokens: out [B, H, L, dv] and the final state.
std::pair<at::Tensor, at::Tensor> RecurrentCore(const Prepared& p, at::Tensor S) {
  const int64_t L = p.len();
  if (L == 0) return {at::zeros({p.batch(), p.heads(), 0, p.dv()}, p.v.options()), S};
  std::vector<at::Tensor> outs;
  outs.reserve(L);
  for (int64_t t = 0; t < L; ++t) {
    auto [o, next] =
        Step(S, p.q.select(2, t), p.k.select(2, t), p.v.select(2, t), p.g.select(2, t), p.beta.select(2, t));
    outs.push_back(o);
    S = next;
  }
  return {at::stack(outs, 2), S};
}

// The chunked form over p's L tokens, chunks of C (the last zero-padded).
// Within a chunk, with G_t the cumulative log decay from the chunk's start
// through t and S0 the state entering it, the value written at s is
//   u_s = beta_s (v_s - e^{G_s} S0^T k_s - sum_{r<s} e^{G_s - G_r} (k_r . k_s) u_r),
// i.e. (I + A) U = beta V - beta e^G K S0 with A[s, r] = beta_s e^{G_s - G_r}
// k_s . k_r (r < s): one unit-lower-triangular solve per chunk, for every
// chunk at once (W = (I + A)^-1 beta V, D = (I + A)^-1 beta e^G K, U = W - D S0).
// Then o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (k_s . q_t) u_s and
// the state leaving is e^{G_C} S0 + sum_s e^{G_C - G_s} k_s u_s^T; only this
// hand-off runs chunk by chunk. Pad rows (g = beta = k = q = 0) write
// nothing and do not decay.
std::pair<at::Tensor, at::Tensor> ChunkedCore(const Prepared& p, at::Tensor S, int64_t C) {
  TORCH_CHECK(C > 0, "the chunk length must be positive");
  const int64_t B = p.batch(), H = p.heads(), L = p.len(), dk = p.dk(), dv = p.dv();
  if (L == 0) return {at::zeros({B, H, 0, dv}, p.v.options()), S};
  const int64_t pad = (C - L % C) % C, N = (L + pad) / C;
  const auto rows = [&](const at::Tensor& x) {  // [B, H, L, d] -> [B, H, N, C, d]
    const at::Tensor y = pad ? at::constant_pad_nd(x, {0, 0, 0, pad}) : x;
    return y.reshape({B, H, N, C, x.size(3)});
  };
  const auto cols = [&](const at::Tensor& x) {  // [B, H, L] -> [B, H, N, C]
    const at::Tensor y = pad ? at::constant_pad_nd(x, {0, pad}) : x;
    return y.reshape({B, H, N, C});
  };
  const at::Tensor q = rows(p.q), k = rows(p.k), v = rows(p.v), beta = cols(p.beta);
  const at::Tensor G = cols(p.g).cumsum(-1);                 // [B, H, N, C]
  const at::Tensor gap = G.unsqueeze(-1) - G.unsqueeze(-2);  // [.., t, s] = G_t - G_s
  const auto bools = at::TensorOptions().dtype(at::kBool).device(q.device());
  const double ninf = -std::numeric_limits<double>::infinity();
  // Decays e^{G_t - G_s} for s <= t (the reads) and s < t (the solve); the
  // others are masked before the exp, where they would overflow.
  const at::Tensor decay_upto = gap.masked_fill(at::ones({C, C}, bools).triu(1), ninf).exp();
  const at::Tensor decay_before = gap.masked_fill(at::ones({C, C}, bools).triu(0), ninf).exp();
  const at::Tensor eG = G.exp().unsqueeze(-1);
  const at::Tensor kt = k.transpose(-1, -2);
  const at::Tensor kb = k * beta.unsqueeze(-1);
  const at::Tensor A = at::matmul(kb, kt) * decay_before;  // strictly lower
  const at::Tensor solved = at::linalg_solve_triangular(A, at::cat({v * beta.unsqueeze(-1), kb * eG}, -1),
                                                        /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  const at::Tensor W = solved.narrow(-1, 0, dv), D = solved.narrow(-1, dv, dk);
  const at::Tensor reads = at::matmul(q, kt) * decay_upto;  // [B, H, N, C, C]
  const at::Tensor q_in = q * eG;                           // reads of the entering state
  const at::Tensor G_end = G.narrow(-1, C - 1, 1);          // [B, H, N, 1]
  const at::Tensor k_out = k * (G_end - G).exp().unsqueeze(-1);
  const at::Tensor chunk_decay = G_end.exp().unsqueeze(-1);  // [B, H, N, 1, 1]
  std::vector<at::Tensor> outs;
  outs.reserve(N);
  for (int64_t c = 0; c < N; ++c) {
    const at::Tensor U = W.select(2, c) - at::matmul(D.select(2, c), S);  // [B, H, C, dv]
    outs.push_back(at::matmul(q_in.select(2, c), S) + at::matmul(reads.select(2, c), U));
    S = S * chunk_decay.select(2, c) + at::matmul(k_out.select(2, c).transpose(-1, -2), U);
  }
  const at::Tensor out = at::stack(outs, 2).reshape({B, H, N * C, dv});
  return {pad ? out.narrow(2, 0, L) : out, S};
}

// Back to tokens first ([B, L, H, dv]) in dtype.
at::Tensor TokensFirst(const at::Tensor& out, at::ScalarType dtype) { return out.transpose(1, 2).to(dtype); }

GdnResult OneSequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, const at::Tensor& initial_state, bool chunked, int64_t chunk) {
  const Prepared p = Prepare(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0));
  const at::Tensor S0 = InitialState(initial_state.defined() ? initial_state.unsqueeze(0) : initial_state, p);
  auto [out, S] = chunked ? ChunkedCore(p, S0, chunk) : RecurrentCore(p, S0);
  return {TokensFirst(out, q.scalar_type()).squeeze(0), S.squeeze(0)};
}

}  // namespace

GdnConvResult GdnCausalConv(const at::Tensor& x, const at::Tensor& weight, const std::vector<int64_t>& seq_begin,
                            const at::Tensor& initial_state) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1),
              "GdnCausalConv: x must be [T, C] and weight [C, K]");
  const int64_t T = x.size(0), C = x.size(1), K = weight.size(1), P = K - 1;
  TORCH_CHECK(K >= 1, "GdnCausalConv: the kernel needs a tap");
  CheckOffsets(seq_begin, T);
  const int64_t S = static_cast<int64_t>(seq_begin.size()) - 1;
  // The padded rows: each sequence's K-1 earlier inputs, then its own rows,
  // sequence after sequence ([T + S (K-1), C]). Row r of sequence i sits at
  // r + (i + 1)(K-1); its window is the K rows ending there.
  std::vector<int64_t> x_at(T), state_at, last_at;
  state_at.reserve(S * P);
  last_at.reserve(S * P);
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t r = seq_begin[i]; r < seq_begin[i + 1]; ++r) x_at[r] = r + (i + 1) * P;
    for (int64_t j = 0; j < P; ++j) {
      state_at.push_back(seq_begin[i] + i * P + j);
      last_at.push_back(seq_begin[i + 1] + i * P + j);
    }
  }
  const at::Device dev = x.device();
  const at::Tensor rows_at = Index(x_at, dev);
  at::Tensor padded = at::zeros({T + S * P, C}, x.options());
  if (T > 0) padded = padded.index_copy(0, rows_at, x);
  if (initial_state.defined() && S * P > 0) {
    TORCH_CHECK(initial_state.dim() == 3 && initial_state.size(0) == S && initial_state.size(1) == C &&
                    initial_state.size(2) == P,
                "GdnCausalConv: the initial state must be [S, C, K-1]");
    padded = padded.index_copy(0, Index(state_at, dev),
                               initial_state.to(x.scalar_type()).transpose(1, 2).reshape({S * P, C}));
  }
  at::Tensor y;
  if (T > 0) {
    const at::Tensor pf = padded.to(at::kFloat), wf = weight.to(at::kFloat);
    at::Tensor acc;
    for (int64_t j = 0; j < K; ++j) {  // tap j reads the row K-1-j back
      const at::Tensor term = pf.index_select(0, rows_at - (P - j)) * wf.select(1, j);
      acc = acc.defined() ? acc + term : term;
    }
    y = at::silu(acc).to(x.scalar_type());
  } else {
    y = at::empty({0, C}, x.options());
  }
  at::Tensor state = S * P > 0
                         ? padded.index_select(0, Index(last_at, dev)).view({S, P, C}).transpose(1, 2).contiguous()
                         : at::zeros({S, C, P}, x.options());
  return {y, state};
}

std::pair<at::Tensor, at::Tensor> GdnGates(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                                           const at::Tensor& dt_bias) {
  const at::Tensor g = -A_log.to(at::kFloat).exp() * at::softplus(a.to(at::kFloat) + dt_bias);
  return {g, at::sigmoid(b)};
}

GdnResult GatedDeltaRuleChunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, const at::Tensor& initial_state, int64_t chunk) {
  return OneSequence(q, k, v, g, beta, initial_state, /*chunked=*/true, chunk);
}

GdnResult GatedDeltaRuleRecurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, const at::Tensor& initial_state) {
  return OneSequence(q, k, v, g, beta, initial_state, /*chunked=*/false, 0);
}

GdnResult GatedDeltaStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                         const at::Tensor& beta, const at::Tensor& state) {
  const Prepared p = Prepare(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1));
  auto [o, S] = Step(InitialState(state, p), p.q.select(2, 0), p.k.select(2, 0), p.v.select(2, 0), p.g.select(2, 0),
                     p.beta.select(2, 0));
  return {o.to(q.scalar_type()), S};
}

GdnResult GatedDeltaRulePacked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const std::vector<int64_t>& seq_begin,
                               const at::Tensor& initial_state, GdnForm form, int64_t chunk) {
  TORCH_CHECK(q.dim() == 3 && v.dim() == 3 && g.dim() == 2,
              "GatedDeltaRulePacked: q, k, v must be [T, H, d], g [T, H]");
  const int64_t T = q.size(0);
  CheckOffsets(seq_begin, T);
  const int64_t S = static_cast<int64_t>(seq_begin.size()) - 1;
  int64_t longest = 0;
  for (int64_t i = 0; i < S; ++i) longest = std::max(longest, seq_begin[i + 1] - seq_begin[i]);
  const bool chunked = form == GdnForm::kChunked;
  TORCH_CHECK(!chunked || chunk > 0, "the chunk length must be positive");
  const int64_t L = chunked ? (longest + chunk - 1) / chunk * chunk : longest;
  // Row t of sequence i goes to padded row i L + t.
  std::vector<int64_t> at_row(T);
  for (int64_t i = 0; i < S; ++i)
    for (int64_t r = seq_begin[i]; r < seq_begin[i + 1]; ++r) at_row[r] = i * L + (r - seq_begin[i]);
  const at::Tensor where = Index(at_row, q.device());
  const auto padded = [&](const at::Tensor& x) {  // [T, ..] -> [S, L, ..], zeros between
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = S * L;
    at::Tensor y = at::zeros(shape, x.options());
    if (T > 0) y = y.index_copy(0, where, x);
    shape[0] = L;
    shape.insert(shape.begin(), S);
    return y.view(shape);
  };
  const Prepared p = Prepare(padded(q), padded(k), padded(v), padded(g), padded(beta));
  auto [out, state] = chunked ? ChunkedCore(p, InitialState(initial_state, p), chunk)
                              : RecurrentCore(p, InitialState(initial_state, p));
  const at::Tensor rows = TokensFirst(out, q.scalar_type()).reshape({S * L, p.heads(), p.dv()});
  return {T > 0 ? rows.index_select(0, where) : rows.narrow(0, 0, 0), state};
}

at::Tensor GatedRmsNorm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps) {
  const at::ScalarType dt = x.scalar_type();
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = (xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(dt);
  return ((weight * normed) * at::silu(z.to(at::kFloat))).to(dt);
}

namespace {

struct GdnInputs {
  at::Tensor q, k, v, g, beta;
};

// The conv's output y [T, C] split into heads, and the gates.
GdnInputs SplitHeads(const GdnWeights& w, const at::Tensor& y, const at::Tensor& a, const at::Tensor& b) {
  const int64_t T = y.size(0), Hk = w.key_heads, Hv = w.value_heads, dk = w.key_dim, dv = w.value_dim;
  auto [g, beta] = GdnGates(a, b, w.A_log, w.dt_bias);
  return {y.narrow(1, 0, Hk * dk).reshape({T, Hk, dk}), y.narrow(1, Hk * dk, Hk * dk).reshape({T, Hk, dk}),
          y.narrow(1, 2 * Hk * dk, Hv * dv).reshape({T, Hv, dv}), std::move(g), std::move(beta)};
}

}  // namespace

GdnResult GdnMix(const GdnWeights& w, const at::Tensor& mixed, const at::Tensor& a, const at::Tensor& b,
                 const std::vector<int64_t>& seq_begin) {
  const GdnInputs in = SplitHeads(w, GdnCausalConv(mixed, w.conv_w, seq_begin).y, a, b);
  return GatedDeltaRulePacked(in.q, in.k, in.v, in.g, in.beta, seq_begin);
}

GdnResult GdnMixStep(const GdnWeights& w, const at::Tensor& mixed, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& before, const at::Tensor& state) {
  std::vector<int64_t> one_each(static_cast<size_t>(mixed.size(0)) + 1);
  for (size_t i = 0; i < one_each.size(); ++i) one_each[i] = static_cast<int64_t>(i);
  const GdnInputs in = SplitHeads(w, GdnCausalConv(mixed, w.conv_w, one_each, before).y, a, b);
  return GatedDeltaStep(in.q, in.k, in.v, in.g, in.beta, state);
}

}  // namespace loom::engine
