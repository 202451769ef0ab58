#include "engine/model/attention.h"

#include <cmath>
#include <limits>

#include "engine/model/compat.h"

namespace loom::engine {
namespace {

// One sequence, math path. q [H, L, hd], k/v [KVH, L, hd]. Grouped-query
// attention by viewing the H query heads as [KVH, group] and broadcasting the
// matmul over the group, so K and V are never copied per query head.
at::Tensor MathCausal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t heads = q.size(0), len = q.size(1), hd = q.size(2), kv_heads = k.size(0);
  const int64_t group = heads / kv_heads;
  const at::Tensor qg = q.reshape({kv_heads, group, len, hd});
  at::Tensor scores = at::matmul(qg, k.unsqueeze(1).transpose(-1, -2)) * (1.0 / std::sqrt(double(hd)));
  const at::Tensor future = at::ones({len, len}, q.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, v.unsqueeze(1)).reshape({heads, len, hd});  // [H, L, hd]
}

}  // namespace

AttentionKernel DefaultAttentionKernel() {
  return compat::kHasFusedSdpa ? AttentionKernel::kSdpa : AttentionKernel::kMath;
}

at::Tensor PackedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::vector<int64_t>& seq_begin, AttentionKernel kernel) {
  const int64_t heads = q.size(1), hd = q.size(2);
  std::vector<at::Tensor> outs;
  outs.reserve(seq_begin.size());
  for (size_t i = 0; i + 1 < seq_begin.size(); ++i) {
    const int64_t begin = seq_begin[i], len = seq_begin[i + 1] - begin;
    if (len == 0) continue;
    // [L, H, hd] -> [H, L, hd]
    const at::Tensor qs = q.narrow(0, begin, len).transpose(0, 1);
    const at::Tensor ks = k.narrow(0, begin, len).transpose(0, 1);
    const at::Tensor vs = v.narrow(0, begin, len).transpose(0, 1);
    at::Tensor o;
    if (kernel == AttentionKernel::kMath) {
      o = MathCausal(qs, ks, vs);
    } else {
      o = compat::CausalSdpa(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0)).squeeze(0);
    }
    outs.push_back(o.transpose(0, 1).reshape({len, heads * hd}));
  }
  if (outs.empty()) return at::zeros({q.size(0), heads * hd}, q.options());
  if (outs.size() == 1) return outs[0];
  return at::cat(outs, 0);
}

}  // namespace loom::engine
