#include "engine/model/dsa.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/model/mla.h"

namespace loom::engine {

DsaIndex DsaIndexRows(const DsaIndexerWeights& w, const at::Tensor& h, const at::Tensor& q_resid,
                      const at::Tensor& cos, const at::Tensor& sin) {
  c10::NoGradGuard no_grad;  // the indexer only chooses keys: no gradient flows through it
  const int64_t T = h.size(0), dr = w.rope;
  const at::Tensor hd = h.detach(), qr = q_resid.detach();
  const at::Tensor q = at::linear(qr, w.wq_b).view({T, w.heads, w.dim});
  const at::Tensor k = at::layer_norm(at::linear(hd, w.wk), {w.dim}, w.k_norm_w, w.k_norm_b, 1e-6);
  // RoPE on the first dr dims (adjacent pairs, as the MLA's), the rest as they are.
  const at::Tensor q_rot = at::cat({MlaRope(q.narrow(-1, 0, dr), cos, sin, true), q.narrow(-1, dr, w.dim - dr)}, -1);
  const at::Tensor k_rot =
      at::cat({MlaRope(k.narrow(-1, 0, dr).unsqueeze(1), cos, sin, true).squeeze(1), k.narrow(-1, dr, w.dim - dr)}, -1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(w.heads)) / std::sqrt(static_cast<double>(w.dim));
  const at::Tensor iw = at::linear(hd.to(at::kFloat), w.weights_proj.to(at::kFloat)) * scale;
  return {q_rot.to(at::kFloat), iw, k_rot};
}

at::Tensor DsaScores(const at::Tensor& iq, const at::Tensor& iw, const at::Tensor& ik) {
  // [.., n, Hi, Di] x [.., Di, L] -> [.., n, Hi, L]; relu, weighted sum over the heads.
  const at::Tensor kt = ik.to(at::kFloat).transpose(-1, -2).unsqueeze(-3);
  return (at::relu(at::matmul(iq, kt)) * iw.unsqueeze(-1)).sum(-2);
}

at::Tensor DsaChoose(const at::Tensor& scores, const at::Tensor& visible, int64_t topk) {
  const int64_t L = scores.size(-1);
  if (topk >= L) return visible;
  // Unseen keys score -inf, so a query that sees at most topk keys keeps them all.
  // Equal scores (relu makes exact zeros common) go to the earlier key: a
  // stable sort, so the choice never depends on the row's padding or the
  // batch (top-k breaks ties as its kernel happens to).
  const at::Tensor ranked = scores.masked_fill(visible.logical_not(), -std::numeric_limits<float>::infinity());
  const at::Tensor best = std::get<1>(at::sort(ranked, /*stable=*/true, -1, /*descending=*/true)).narrow(-1, 0, topk);
  return at::zeros_like(visible).scatter_(-1, best, true).logical_and_(visible);
}

namespace {

// Query rows a block so that a block's [rows, width, L] fp32 intermediate
// stays near 256 MiB (at least one row): a long sequence's scores are never
// all held at once.
int64_t RowsPerBlock(int64_t width, int64_t L) {
  return std::max<int64_t>(1, (int64_t{64} << 20) / std::max<int64_t>(1, width * L));
}

}  // namespace

at::Tensor DsaCausalChoice(const DsaIndex& queries, const at::Tensor& ik, int64_t topk, int64_t rows_per_block) {
  const int64_t n = queries.q.size(0), L = ik.size(0);
  if (L <= topk) return {};
  c10::NoGradGuard no_grad;
  const auto longs = at::TensorOptions().dtype(at::kLong).device(ik.device());
  const at::Tensor j = at::arange(L, longs).unsqueeze(0);
  const int64_t block = rows_per_block > 0 ? rows_per_block : RowsPerBlock(queries.q.size(1), L);
  std::vector<at::Tensor> parts;
  for (int64_t s0 = 0; s0 < n; s0 += block) {
    const int64_t m = std::min(block, n - s0);
    const at::Tensor i = (at::arange(s0, s0 + m, longs) + (L - n)).unsqueeze(1);
    parts.push_back(DsaChoose(DsaScores(queries.q.narrow(0, s0, m), queries.w.narrow(0, s0, m), ik), j <= i, topk));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

at::Tensor DsaAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep,
                        AttentionKernel kernel, int64_t rows_per_block) {
  if (!keep.defined()) return PrefixCausalAttention(q, k, v, kernel);
  const int64_t n = q.size(0), L = k.size(0);
  // Without gradients (the sampler's prefill) in query blocks, each over
  // the keys up to its last query: the same values, a block's scores at a
  // time. With them, autograd keeps every block's anyway.
  const int64_t block = c10::GradMode::is_enabled() ? n
                        : rows_per_block > 0         ? rows_per_block
                                                     : RowsPerBlock(q.size(1), L);
  std::vector<at::Tensor> parts;
  for (int64_t s0 = 0; s0 < n; s0 += block) {
    const int64_t m = std::min(block, n - s0), keys = L - n + s0 + m;
    AttentionVariant chosen;
    chosen.keep = keep.narrow(0, s0, m).narrow(1, 0, keys);
    parts.push_back(PrefixCausalAttention(q.narrow(0, s0, m), k.narrow(0, 0, keys), v.narrow(0, 0, keys), kernel, &chosen));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

at::Tensor DsaPackedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::vector<int64_t>& seq_begin, AttentionKernel kernel,
                              const PaddedLayout* padded, const DsaIndexerWeights& w, const DsaIndex* index,
                              size_t layer, std::vector<std::vector<at::Tensor>>& choices) {
  const size_t S = seq_begin.size() - 1;
  if (index) {
    std::vector<at::Tensor>& mine = choices.at(layer);
    mine.assign(S, at::Tensor());
    for (size_t i = 0; i < S; ++i) {
      const int64_t begin = seq_begin[i], n = seq_begin[i + 1] - begin;
      if (n > w.topk) mine[i] = DsaCausalChoice(index->Rows(begin, n), index->k.narrow(0, begin, n), w.topk);
    }
  }
  const std::vector<at::Tensor>& keep = choices.at(index ? layer : static_cast<size_t>(w.source));
  bool any = false;
  for (const at::Tensor& t : keep) any = any || t.defined();
  if (!any) return PackedCausalAttention(q, k, v, seq_begin, kernel, padded);
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < S; ++i) {
    const int64_t begin = seq_begin[i], n = seq_begin[i + 1] - begin;
    if (n == 0) continue;
    outs.push_back(DsaAttention(q.narrow(0, begin, n), k.narrow(0, begin, n), v.narrow(0, begin, n),
                                i < keep.size() ? keep[i] : at::Tensor(), kernel));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

}  // namespace loom::engine
