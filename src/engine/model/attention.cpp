#include "engine/model/attention.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>

#include "engine/model/compat.h"

namespace loom::engine {
namespace {

// Values narrower than the queries (MLA: v_head_dim < qk_nope + qk_rope):
// every path below takes one head width, so the values get zero columns up
// to it (their outputs are zero) and the output is narrowed back, as HF does
// for its flash kernels. v [.., H, dv] -> [.., H, hd]; out [T, H * hd] -> [T, H * dv].
at::Tensor PadValues(const at::Tensor& v, int64_t hd) {
  std::vector<int64_t> shape = v.sizes().vec();
  shape.back() = hd - v.size(-1);
  return at::cat({v, at::zeros(shape, v.options())}, -1);
}
at::Tensor NarrowHeads(const at::Tensor& out, int64_t heads, int64_t hd, int64_t dv) {
  return out.view({out.size(0), heads, hd}).narrow(-1, 0, dv).reshape({out.size(0), heads * dv});
}

// One sequence, math path. q [H, n, hd] (the last n positions), k/v [KVH,
// L, hd]. Grouped-query attention by viewing the H query heads as [KVH,
// group] and broadcasting the matmul over the group, so K and V are never
// copied per query head.
at::Tensor MathCausal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t heads = q.size(0), len = q.size(1), hd = q.size(2), kv_heads = k.size(0), keys = k.size(1);
  const int64_t group = heads / kv_heads;
  const at::Tensor qg = q.reshape({kv_heads, group, len, hd});
  at::Tensor scores = at::matmul(qg, k.unsqueeze(1).transpose(-1, -2)) * (1.0 / std::sqrt(double(hd)));
  const at::Tensor future = at::ones({len, keys}, q.options().dtype(at::kBool)).triu(keys - len + 1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, v.unsqueeze(1)).reshape({heads, len, hd});  // [H, L, hd]
}

// The same over a batch of right-padded sequences: q [S, H, L, hd],
// k/v [S, KVH, L, hd]. A real query at position i sees keys 0..i of its own
// row, all real, so the padding never reaches a real output.
at::Tensor MathCausalBatched(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t S = q.size(0), heads = q.size(1), len = q.size(2), hd = q.size(3), kv_heads = k.size(1);
  const int64_t group = heads / kv_heads;
  const at::Tensor qg = q.reshape({S, kv_heads, group, len, hd});
  at::Tensor scores = at::matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * (1.0 / std::sqrt(double(hd)));
  const at::Tensor future = at::ones({len, len}, q.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, v.unsqueeze(2)).reshape({S, heads, len, hd});
}

// One sequence with a non-plain variant: q [n, H, hd] are the last n
// positions of k, v [L, KVH, hd]; explicit causal (and window, and keep) mask, sinks.
at::Tensor VariantCausal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionVariant& var) {
  const int64_t n = q.size(0), heads = q.size(1), hd = q.size(2), L = k.size(0), kv_heads = k.size(1);
  const int64_t group = heads / kv_heads;
  const at::Tensor qg = q.transpose(0, 1).reshape({kv_heads, group, n, hd});
  const at::Tensor kt = k.permute({1, 2, 0}).unsqueeze(1);  // [KVH, 1, hd, L]
  at::Tensor scores = at::matmul(qg, kt) * (1.0 / std::sqrt(double(hd)));  // [KVH, G, n, L]
  const auto longs = at::TensorOptions().dtype(at::kLong).device(q.device());
  const at::Tensor i = (at::arange(n, longs) + (L - n)).unsqueeze(1), j = at::arange(L, longs).unsqueeze(0);
  at::Tensor hidden = j > i;
  if (var.window > 0) hidden = hidden.logical_or(j <= i - var.window);
  if (var.keep.defined()) hidden = hidden.logical_or(var.keep.logical_not());
  scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  at::Tensor probs;
  if (var.sinks.defined())
    probs = SinkSoftmax(scores, var.sinks.to(scores.scalar_type()).view({kv_heads, group, 1, 1}));
  else
    probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  const at::Tensor o = at::matmul(probs, v.transpose(0, 1).unsqueeze(1));  // [KVH, G, n, hd]
  return o.reshape({heads, n, hd}).transpose(0, 1).reshape({n, heads * hd});
}

#if LOOM_TORCH_AT_LEAST(2, 5)
// Causal attention over the whole packed batch at once through the varlen
// flash kernel, on CUDA in bf16/fp16: plain (a training pass of a shape new
// to cuDNN, TrainOnVarlenFlash), or a sinks-and-window variant (gpt_oss);
// the math path stays the reference. The window is flash's left window (window - 1 keys
// before the query). The sinks ride on the kernel's log-sum-exp: a query
// row's probabilities with the sink column are the kernel's times
// sigma(lse - s_h) (the sink's exp joins the denominator), so the output is
// o' = o sigma(lse - s_h). Backward: with s = sigma(lse - s_h), the kernel's
// backward given grad_out = s dO' and out = o' yields exactly the gradients
// of o' into q, k and v (its row term rowsum(grad_out o') = s^2 rowsum(dO' o)
// is the one the sink's share of the denominator needs). The sinks are
// frozen base weights: no gradient for them.
struct SinkFlash {
  at::Tensor sinks;     // [H], frozen (no gradient), or undefined: plain attention. Not an input of
                        // SinkFlashNode: an undefined tensor cannot be one.
  at::Tensor cu;        // [S + 1] int32 on the device: the non-empty sequences' offsets
  int64_t max_len = 0;
  at::Tensor cu_k;      // the keys' offsets where they differ (shared prefixes), else undefined
  int64_t max_len_k = 0;
  int64_t window = 0;   // 0 = every earlier key
  const at::Tensor& KeyOffsets() const { return cu_k.defined() ? cu_k : cu; }
  int64_t KeyMax() const { return cu_k.defined() ? max_len_k : max_len; }
  std::optional<int64_t> Left() const { return window > 0 ? std::optional<int64_t>(window - 1) : std::nullopt; }
  std::optional<int64_t> Right() const { return window > 0 ? std::optional<int64_t>(0) : std::nullopt; }
};

struct SinkFlashOut {
  at::Tensor out;          // [T, H, hd]: o'
  at::Tensor lse;          // [H, T] fp32
  at::Tensor share;        // [T, H, 1] fp32: sigma(lse - s_h)
  at::Tensor rng, unused;  // the kernel's, for its backward
};

// Without sinks (undefined): the kernel's output as it is, share undefined.
SinkFlashOut SinkFlashForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SinkFlash& f) {
  auto [out, lse, rng, unused, debug] = at::_flash_attention_forward(
      q, k, v, f.cu, f.KeyOffsets(), f.max_len, f.KeyMax(), 0.0, /*is_causal=*/true, /*return_debug_mask=*/false, std::nullopt,
      f.Left(), f.Right());
  (void)debug;
  const int64_t T = q.size(0), H = q.size(1);
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == H && lse.size(1) == T,
              "the varlen flash kernel's log-sum-exp is not [heads, tokens]: ", lse.sizes());
  SinkFlashOut r;
  r.lse = lse;
  if (f.sinks.defined()) {
    r.share = at::sigmoid(lse - f.sinks.to(at::kFloat).unsqueeze(1)).t().unsqueeze(-1);
    r.out = (out.to(at::kFloat) * r.share).to(q.scalar_type());
  } else {
    r.out = out;
  }
  r.rng = rng;
  r.unused = unused;
  return r;
}

struct SinkFlashNode : torch::autograd::Function<SinkFlashNode> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const SinkFlash& f) {
    at::NoGradGuard no_grad;
    SinkFlashOut r = SinkFlashForward(q, k, v, f);
    ctx->save_for_backward({q, k, v, r.out, r.lse, r.share, r.rng, r.unused, f.cu, f.cu_k});
    ctx->saved_data["max_len"] = f.max_len;
    ctx->saved_data["max_len_k"] = f.max_len_k;
    ctx->saved_data["window"] = f.window;
    return r.out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4], &share = saved[5];
    SinkFlash f{at::Tensor(), saved[8], ctx->saved_data["max_len"].toInt(), saved[9],
                ctx->saved_data["max_len_k"].toInt(), ctx->saved_data["window"].toInt()};
    const at::Tensor g =
        share.defined() ? (grads[0].to(at::kFloat) * share).to(q.scalar_type()).contiguous() : grads[0].contiguous();
    auto [dq, dk, dv] = at::_flash_attention_backward(g, q, k, v, out, lse, f.cu, f.KeyOffsets(), f.max_len, f.KeyMax(), 0.0,
                                                      /*is_causal=*/true, saved[6], saved[7], std::nullopt, f.Left(),
                                                      f.Right());
    return {dq, dk, dv, at::Tensor()};
  }
};
#endif

// Causal attention over the packed batch through the varlen flash kernel
// (SinkFlash), with the variant's sinks and window where given (plain
// otherwise), where it applies (a CUDA bf16/fp16 batch, no per-query keep,
// head dims a multiple of 8 up to 256, libtorch 2.5+); else undefined (the
// caller takes another path). q [T, H, hd], k/v [T, KVH, hd]; [T, H * hd].
// The offsets are the layout's where given (PaddedLayout::SetVarlen), else
// copied to the device here. A shared layout's keys are k and v as gathered
// by its key_rows (the kernel's causal rule then aligns each sequence's
// queries with the last of its keys).
at::Tensor FlashVarlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::vector<int64_t>& seq_begin, const AttentionVariant& var,
                       const PaddedLayout* layout = nullptr) {
#if LOOM_TORCH_AT_LEAST(2, 5)
  const auto t = q.scalar_type();
  const int64_t T = q.size(0), H = q.size(1), hd = q.size(2);
  if (!q.is_cuda() || (t != at::kBFloat16 && t != at::kHalf) || var.keep.defined() || hd % 8 != 0 || hd > 256 ||
      v.size(-1) != hd || H % k.size(1) != 0 || T == 0)
    return {};
  SinkFlash f;
  f.sinks = var.sinks;
  f.window = var.window;
  if (layout && layout->cu.defined()) {
    f.cu = layout->cu;
    f.max_len = layout->cu_max_len;
    if (layout->shared()) {
      f.cu_k = layout->cu_k;
      f.max_len_k = layout->cu_k_max_len;
    }
  } else if (layout && layout->shared()) {
    return {};
  } else {
    PaddedLayout l;
    l.SetVarlen(seq_begin, q.device());
    f.cu = l.cu;
    f.max_len = l.cu_max_len;
  }
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor o;
  if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad()))
    o = SinkFlashNode::apply(qc, kc, vc, f);
  else
    o = SinkFlashForward(qc, kc, vc, f).out;
  return o.reshape({T, H * hd});
#else
  (void)q;
  (void)k;
  (void)v;
  (void)seq_begin;
  (void)var;
  (void)layout;
  return {};
#endif
}

// A packed batch's non-empty sequences and the longest of them.
struct SeqCount {
  int64_t seqs = 0, longest = 0;
};
SeqCount CountSeqs(const std::vector<int64_t>& seq_begin) {
  SeqCount c;
  for (size_t i = 0; i + 1 < seq_begin.size(); ++i) {
    const int64_t len = seq_begin[i + 1] - seq_begin[i];
    c.seqs += len > 0;
    c.longest = std::max(c.longest, len);
  }
  return c;
}

// PackedCausalAttention over a shared layout: each sequence's queries over
// its keys as gathered by key_rows (its prefix's rows, then its own), the
// last rows of one longer sequence. Through autograd the gather sends each
// continuation's key and value gradients back to the prefix's rows, summed.
at::Tensor SharedPrefixAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::vector<int64_t>& seq_begin, AttentionKernel kernel,
                                 const PaddedLayout& layout, const AttentionVariant* variant) {
  const at::Tensor ke = k.index_select(0, layout.key_rows), ve = v.index_select(0, layout.key_rows);
  if (layout.varlen && kernel == AttentionKernel::kSdpa && (!variant || !variant->keep.defined()))
    if (at::Tensor o = FlashVarlen(q, ke, ve, seq_begin, variant ? *variant : AttentionVariant{}, &layout);
        o.defined())
      return o;
  std::vector<at::Tensor> outs;
  outs.reserve(seq_begin.size());
  for (size_t i = 0; i + 1 < seq_begin.size(); ++i) {
    const int64_t begin = seq_begin[i], len = seq_begin[i + 1] - begin;
    if (len == 0) continue;
    const int64_t kb = layout.key_begin[i], kn = layout.key_begin[i + 1] - kb;
    const at::Tensor qs = q.narrow(0, begin, len), ks = ke.narrow(0, kb, kn), vs = ve.narrow(0, kb, kn);
    outs.push_back(variant ? VariantCausal(qs, ks, vs, *variant) : PrefixCausalAttention(qs, ks, vs, kernel));
  }
  if (outs.empty()) return at::zeros({q.size(0), q.size(1) * q.size(2)}, q.options());
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

}  // namespace

at::Tensor SinkSoftmax(const at::Tensor& scores, const at::Tensor& sinks) {
  std::vector<int64_t> shape = scores.sizes().vec();
  shape.back() = 1;
  const at::Tensor logits = at::cat({scores, sinks.expand(shape)}, -1);
  return at::softmax(logits, -1, logits.scalar_type()).narrow(-1, 0, scores.size(-1));
}

bool VariantFlashAvailable() { return LOOM_TORCH_AT_LEAST(2, 5); }

bool ShapeRecurrence::Count(const std::vector<int64_t>& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seen_.find(key);
  if (it == seen_.end()) {
    if (seen_.size() >= max_shapes_) return false;  // full: a new shape stays new
    it = seen_.emplace(key, 0).first;
  }
  return it->second++ >= after_;
}

bool TrainOnVarlenFlash(const std::vector<int64_t>& seq_begin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                        at::Device device, at::ScalarType dtype) {
  if (!VariantFlashAvailable() || !device.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf) ||
      head_dim % 8 != 0 || head_dim > 256 || kv_heads <= 0 || heads % kv_heads != 0)
    return false;
  const SeqCount c = CountSeqs(seq_begin);
  static ShapeRecurrence shapes(kCudnnAfterPasses, 4096);
  const int64_t rows = seq_begin.empty() ? 0 : seq_begin.back();
  return !shapes.Count({c.seqs, c.longest, rows, heads, kv_heads, head_dim, static_cast<int64_t>(dtype)});
}

AttentionKernel DefaultAttentionKernel() {
  return compat::kHasFusedSdpa ? AttentionKernel::kSdpa : AttentionKernel::kMath;
}

PaddedLayout PaddedLayout::Make(const std::vector<int64_t>& seq_begin, at::Device device) {
  PaddedLayout l;
  const SeqCount c = CountSeqs(seq_begin);
  l.seqs = c.seqs;
  l.max_len = c.longest;
  const int64_t T = seq_begin.empty() ? 0 : seq_begin.back();
  l.uniform = l.seqs > 0 && l.seqs * l.max_len == T;  // no empty sequence is counted, so all are full
  if (l.uniform) return l;
  at::Tensor gather = at::empty({l.seqs * l.max_len}, at::TensorOptions().dtype(at::kLong));
  at::Tensor scatter = at::empty({T}, at::TensorOptions().dtype(at::kLong));
  int64_t* g = gather.data_ptr<int64_t>();
  int64_t* sc = scatter.data_ptr<int64_t>();
  int64_t s = 0;
  for (size_t i = 0; i + 1 < seq_begin.size(); ++i) {
    const int64_t begin = seq_begin[i], len = seq_begin[i + 1] - begin;
    if (len == 0) continue;
    for (int64_t j = 0; j < l.max_len; ++j) g[s * l.max_len + j] = begin + (j < len ? j : 0);
    for (int64_t j = 0; j < len; ++j) sc[begin + j] = s * l.max_len + j;
    ++s;
  }
  l.gather = gather.to(device);
  l.scatter = scatter.to(device);
  return l;
}

void PaddedLayout::SetVarlen(const std::vector<int64_t>& seq_begin, at::Device device) {
  varlen = true;
  std::vector<int32_t> offsets{0};
  for (size_t i = 0; i + 1 < seq_begin.size(); ++i)
    if (seq_begin[i + 1] > seq_begin[i]) offsets.push_back(static_cast<int32_t>(seq_begin[i + 1]));
  cu_max_len = CountSeqs(seq_begin).longest;
  cu = at::tensor(offsets, at::TensorOptions().dtype(at::kInt)).to(device);
}

PaddedLayout PaddedLayout::Shared(const std::vector<int64_t>& seq_begin, const std::vector<int>& seq_prefix,
                                  at::Device device, bool varlen) {
  PaddedLayout l;
  const size_t S = seq_begin.empty() ? 0 : seq_begin.size() - 1;
  TORCH_CHECK(seq_prefix.size() == S, "shared layout: ", seq_prefix.size(), " prefixes for ", S, " sequences");
  std::vector<int64_t> rows;
  std::vector<int32_t> cu_k{0};
  l.key_begin.assign(1, 0);
  for (size_t i = 0; i < S; ++i) {
    const int p = seq_prefix[i];
    TORCH_CHECK(p < static_cast<int>(i) && (p < 0 || seq_prefix[static_cast<size_t>(p)] < 0),
                "shared layout: sequence ", i, " continues ", p, ", which is not an earlier sequence without a prefix");
    const int64_t begin = seq_begin[i], len = seq_begin[i + 1] - begin;
    int64_t keys = 0;
    if (len > 0) {
      if (p >= 0)
        for (int64_t r = seq_begin[static_cast<size_t>(p)]; r < seq_begin[static_cast<size_t>(p) + 1]; ++r, ++keys)
          rows.push_back(r);
      for (int64_t r = begin; r < begin + len; ++r, ++keys) rows.push_back(r);
      cu_k.push_back(cu_k.back() + static_cast<int32_t>(keys));
      l.cu_k_max_len = std::max(l.cu_k_max_len, keys);
    }
    l.key_begin.push_back(l.key_begin.back() + keys);
  }
  l.key_rows = at::tensor(rows, at::TensorOptions().dtype(at::kLong)).to(device);
  if (varlen) {
    l.SetVarlen(seq_begin, device);
    l.cu_k = at::tensor(cu_k, at::TensorOptions().dtype(at::kInt)).to(device);
  }
  return l;
}

bool PaddedLayout::Prefer(const std::vector<int64_t>& seq_begin, at::Device device) {
  const auto [seqs, max_len] = CountSeqs(seq_begin);
  const int64_t T = seq_begin.empty() ? 0 : seq_begin.back();
  // On the GPU the per-sequence loop costs launches, so padding up to 4x the
  // work still wins; on the CPU every padded token is real arithmetic (and
  // attention grows with the square of the padded length), so only batches of
  // near-equal lengths go padded.
  const int64_t waste_limit_x4 = device.is_cuda() ? 16 : 5;  // 4x or 1.25x, in quarters
  return seqs > 1 && 4 * seqs * max_len <= waste_limit_x4 * T;
}

at::Tensor PaddedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const PaddedLayout& layout, AttentionKernel kernel) {
  const int64_t heads = q.size(1), hd = q.size(2);
  const int64_t S = layout.seqs, L = layout.max_len;
  if (S == 0) return at::zeros({q.size(0), heads * hd}, q.options());
  // [T, H, hd] -> [S, Lmax, H, hd] -> [S, H, Lmax, hd]
  const auto padded = [&](const at::Tensor& t) {
    return (layout.uniform ? t : t.index_select(0, layout.gather)).view({S, L, t.size(1), hd}).transpose(1, 2);
  };
  const at::Tensor qp = padded(q), kp = padded(k), vp = padded(v);
  const at::Tensor o = kernel == AttentionKernel::kMath ? MathCausalBatched(qp, kp, vp)
                                                       : compat::CausalSdpa(qp, kp, vp);  // [S, H, Lmax, hd]
  const at::Tensor rows = o.transpose(1, 2).reshape({S * L, heads * hd});
  return layout.uniform ? rows : rows.index_select(0, layout.scatter);
}

at::Tensor PackedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::vector<int64_t>& seq_begin, AttentionKernel kernel,
                                 const PaddedLayout* padded, const AttentionVariant* variant) {
  if (v.size(-1) != q.size(-1))
    return NarrowHeads(PackedCausalAttention(q, k, PadValues(v, q.size(-1)), seq_begin, kernel, padded, variant),
                       q.size(1), q.size(-1), v.size(-1));
  if (variant && variant->plain()) variant = nullptr;
  if (padded && padded->shared()) return SharedPrefixAttention(q, k, v, seq_begin, kernel, *padded, variant);
  if (padded && padded->varlen && !variant && kernel == AttentionKernel::kSdpa)
    if (at::Tensor o = FlashVarlen(q, k, v, seq_begin, AttentionVariant{}, padded); o.defined()) return o;
  if (padded && padded->seqs > 0 && !variant) return PaddedCausalAttention(q, k, v, *padded, kernel);
  if (variant && kernel == AttentionKernel::kSdpa && variant->sinks.defined())
    if (at::Tensor o = FlashVarlen(q, k, v, seq_begin, *variant, padded); o.defined()) return o;
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
    if (variant) {
      outs.push_back(VariantCausal(q.narrow(0, begin, len), k.narrow(0, begin, len), v.narrow(0, begin, len), *variant));
      continue;
    }
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

at::Tensor PrefixCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 AttentionKernel kernel, const AttentionVariant* variant) {
  if (v.size(-1) != q.size(-1))
    return NarrowHeads(PrefixCausalAttention(q, k, PadValues(v, q.size(-1)), kernel, variant), q.size(1), q.size(-1),
                       v.size(-1));
  if (variant && !variant->plain()) return VariantCausal(q, k, v, *variant);
  const int64_t n = q.size(0), heads = q.size(1), hd = q.size(2);
  // [n, H, hd] -> [H, n, hd]; [L, KVH, hd] -> [KVH, L, hd]
  const at::Tensor qs = q.transpose(0, 1), ks = k.transpose(0, 1), vs = v.transpose(0, 1);
  at::Tensor o;
  (void)kernel;  // math only before libtorch 2.0
#if LOOM_TORCH_AT_LEAST(2, 0)
  if (kernel == AttentionKernel::kSdpa) o = compat::FlashCausalInference(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0));
  if (o.defined()) {
    o = o.squeeze(0);
  } else if (kernel == AttentionKernel::kSdpa) {
    const int64_t L = k.size(0), group = heads / k.size(1);
    const at::Tensor visible = at::ones({n, L}, q.options().dtype(at::kBool)).tril(L - n);  // true = attend
    const at::Tensor kk = group == 1 ? ks : ks.repeat_interleave(group, 0);
    const at::Tensor vv = group == 1 ? vs : vs.repeat_interleave(group, 0);
    o = at::scaled_dot_product_attention(qs.unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0), visible).squeeze(0);
  }
#endif
  if (!o.defined()) o = MathCausal(qs, ks, vs);
  return o.transpose(0, 1).reshape({n, heads * hd});
}

}  // namespace loom::engine
