#include "engine/model/lean_ops.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>

#include "engine/model/cuda/lean_kernels.h"
#include "engine/sample/cuda/rmsnorm.h"
#include "engine/sample/cuda/silu.h"
#endif

namespace loom::engine {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#if LOOM_CUDA_KERNELS
// Whether the fused backward kernels (model/cuda/lean_kernels.h) take x: a
// CUDA tensor in bf16 or fp32, with the other tensors in its dtype.
bool FusedOn(const at::Tensor& x, std::initializer_list<at::Tensor> same) {
  if (!x.is_cuda() || (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat)) return false;
  for (const at::Tensor& t : same)
    if (!t.defined() || t.scalar_type() != x.scalar_type() || t.device() != x.device()) return false;
  return true;
}
cudaStream_t Stream(const at::Tensor& x) { return at::cuda::getCurrentCUDAStream(x.device().index()).stream(); }
#endif

#if LOOM_CUDA_KERNELS
// A custom node's inputs must all be defined: an absent optional one enters
// as an empty tensor (numel 0), which the node reads back as absent.
at::Tensor Present(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t : at::empty({0}, like.options());
}
at::Tensor Given(const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); }

// The decode RmsNorm kernel over contiguous rows: {x + (o + delta) (undefined
// without o), the normed rows, 1/rms [.., 1] fp32}; o and delta may be undefined.
std::vector<at::Tensor> NormKernel(const at::Tensor& x, const at::Tensor& o, const at::Tensor& delta,
                                   const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1);
  const at::Tensor sum = o.defined() ? at::empty_like(x) : at::Tensor(), y = at::empty_like(x);
  std::vector<int64_t> inv_shape = x.sizes().vec();
  inv_shape.back() = 1;
  at::Tensor inv = at::empty(inv_shape, x.options().dtype(at::kFloat));
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  cuda::RmsNorm(x.scalar_type() == at::kBFloat16, x.data_ptr(), ptr(o), ptr(delta), ptr(sum), weight.data_ptr(),
                y.data_ptr(), x.numel() / n, n, static_cast<float>(eps), Stream(x), inv.data_ptr<float>());
  return {sum, y, inv};
}
#endif

// The fused forward kernels' RMSNorm: y and 1/rms [.., 1] fp32 for
// contiguous rows in the weight's dtype; false where it does not apply.
bool FusedRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y, at::Tensor& inv) {
#if LOOM_CUDA_KERNELS
  if (!FusedOn(x, {weight}) || !x.is_contiguous() || x.size(-1) > cuda::kMaxNormWidth || x.numel() == 0) return false;
  const std::vector<at::Tensor> r = NormKernel(x, at::Tensor(), at::Tensor(), weight, eps);
  y = r[1];
  inv = r[2];
  return true;
#else
  (void)x, (void)weight, (void)eps, (void)y, (void)inv;
  return false;
#endif
}

// The fused SwiGLU forward over contiguous gate_up rows; undefined where it does not apply.
at::Tensor FusedSwiGlu(const at::Tensor& gate_up) {
#if LOOM_CUDA_KERNELS
  if (!FusedOn(gate_up, {}) || !gate_up.is_contiguous() || gate_up.numel() == 0) return at::Tensor();
  const int64_t inter = gate_up.size(-1) / 2;
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gate_up.options());
  cuda::SiluMul(gate_up.scalar_type() == at::kBFloat16, gate_up.data_ptr(), nullptr, out.data_ptr(),
                gate_up.numel() / (2 * inter), inter, Stream(gate_up));
  return out;
#else
  (void)gate_up;
  return at::Tensor();
#endif
}

// 1/rms of each row, fp32 [.., 1]: the factor RmsNormPlain multiplies by.
at::Tensor InverseRms(const at::Tensor& xf, double eps) { return at::rsqrt(xf.pow(2).mean(-1, true) + eps); }

// The scaled output of normed fp32 rows n in dtype: a weight in the model
// dtype scales the cast rows (Llama/Qwen); an fp32 weight of a lower-precision
// model (gpt_oss keeps its norms fp32) scales in fp32, then casts (GptOssRMSNorm).
// Either way the backward's dn = (g * weight) in fp32 is the same formula.
at::Tensor ScaleNormed(const at::Tensor& weight, const at::Tensor& n, at::ScalarType dtype) {
  if (weight.scalar_type() == at::kFloat && dtype != at::kFloat) return (weight * n).to(dtype);
  return weight * n.to(dtype);
}

class RmsNormNode : public torch::autograd::Function<RmsNormNode> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    c10::NoGradGuard no_grad;
    at::Tensor y, inv;
    if (FusedRmsNorm(x, weight, eps, y, inv)) {
      ctx->save_for_backward({x, weight, inv});
      return y;
    }
    const at::Tensor xf = x.to(at::kFloat);
    inv = InverseRms(xf, eps);
    ctx->save_for_backward({x, weight, inv});
    return ScaleNormed(weight, xf * inv, x.scalar_type());
  }

  // y = w * cast(n), n = x * inv, inv = (mean(x^2) + eps)^-1/2:
  // dn = cast_back(g * w); dx = inv * (dn - n * mean(dn * n)).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &inv = saved[2];
#if LOOM_CUDA_KERNELS
    if (FusedOn(x, {grads[0], weight}) && x.size(-1) <= cuda::kMaxNormGradWidth) {
      const int64_t n = x.size(-1);
      const at::Tensor g = grads[0].contiguous(), xc = x.contiguous(), w = weight.contiguous(), r = inv.contiguous();
      at::Tensor dx = at::empty_like(xc);
      cuda::RmsNormGrad(x.scalar_type() == at::kBFloat16, g.data_ptr(), xc.data_ptr(), w.data_ptr(),
                        r.data_ptr<float>(), dx.data_ptr(), xc.numel() / n, n, Stream(x));
      return {dx, at::Tensor(), at::Tensor()};
    }
#endif
    const at::Tensor dn = (grads[0] * weight).to(at::kFloat);
    const at::Tensor n = x.to(at::kFloat) * inv;
    const at::Tensor dx = inv * (dn - n * (dn * n).mean(-1, true));
    return {dx.to(x.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

class SwiGluNode : public torch::autograd::Function<SwiGluNode> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    c10::NoGradGuard no_grad;
    ctx->save_for_backward({gate_up});
    at::Tensor out = FusedSwiGlu(gate_up);
    return out.defined() ? out : SwiGluPlain(gate_up);
  }

  // y = silu(g) * u: du = dy * silu(g); dg = dy * u * s * (1 + g (1 - s)),
  // s = sigmoid(g); in fp32, rounded once to the input dtype.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor gate_up = ctx->get_saved_variables()[0];
    const int64_t inter = gate_up.size(-1) / 2;
#if LOOM_CUDA_KERNELS
    if (FusedOn(gate_up, {grads[0]})) {
      const at::Tensor gu = gate_up.contiguous(), dy = grads[0].contiguous();
      at::Tensor out = at::empty_like(gu);
      cuda::SwiGluGrad(gu.scalar_type() == at::kBFloat16, gu.data_ptr(), dy.data_ptr(), out.data_ptr(),
                       gu.numel() / (2 * inter), inter, Stream(gu));
      return {out};
    }
#endif
    const at::Tensor g = gate_up.narrow(-1, 0, inter).to(at::kFloat);
    const at::Tensor u = gate_up.narrow(-1, inter, inter).to(at::kFloat);
    const at::Tensor dy = grads[0].to(at::kFloat);
    const at::Tensor s = at::sigmoid(g);
    const at::Tensor dg = dy * u * s * (1.0 + g * (1.0 - s));
    const at::Tensor du = dy * (g * s);
    return {at::cat({dg, du}, -1).to(gate_up.scalar_type())};
  }
};

// rotate_half and its transpose (rotate_half^T = -rotate_half):
// [x1, x2] -> [-x2, x1] and [y1, y2] -> [y2, -y1].
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}
at::Tensor RotateHalfT(const at::Tensor& y) {
  const int64_t half = y.size(-1) / 2;
  return at::cat({y.narrow(-1, half, half), -y.narrow(-1, 0, half)}, -1);
}

class RopeNode : public torch::autograd::Function<RopeNode> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    c10::NoGradGuard no_grad;
    ctx->save_for_backward({cos, sin});
    return RopePlain(x, cos, sin);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = grads[0];
    return {g * saved[0] + RotateHalfT(g * saved[1]), at::Tensor(), at::Tensor()};
  }
};

std::vector<at::Tensor> Columns(const at::Tensor& x, const std::vector<int64_t>& widths) {
  std::vector<at::Tensor> out;
  int64_t at = 0;
  for (int64_t w : widths) {
    out.push_back(x.narrow(1, at, w));
    at += w;
  }
  return out;
}

class SplitNode : public torch::autograd::Function<SplitNode> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::vector<int64_t>& widths) {
    ctx->saved_data["widths"] = widths;
    ctx->saved_data["rows"] = x.size(0);
    return Columns(x, widths);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto widths = ctx->saved_data["widths"].toIntVector();
    const int64_t rows = ctx->saved_data["rows"].toInt();
    at::Tensor any;
    for (const at::Tensor& g : grads)
      if (g.defined()) any = g;
    if (!any.defined()) return {at::Tensor(), at::Tensor()};
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < widths.size(); ++i)
      parts.push_back(grads[i].defined() ? grads[i] : at::zeros({rows, widths[i]}, any.options()));
    return {at::cat(parts, 1), at::Tensor()};
  }
};


// The q/k/v tail as one node (QkvTailLean): the CUDA kernels of
// model/cuda/lean_kernels.h forward and backward. Keeps v = qkv + delta
// (qkv itself when there is no delta) where a norm needs it, 1/rms per head,
// and the RoPE tables.
struct QkvShape {
  int64_t heads, kv_heads, head_dim;
};

#if LOOM_CUDA_KERNELS
bool FusedQkvOn(const at::Tensor& qkv, const at::Tensor& delta, const at::Tensor& q_norm, const at::Tensor& k_norm,
                const at::Tensor& cos, const at::Tensor& sin, const QkvShape& s) {
  if (!FusedOn(qkv, {cos, sin}) || !qkv.is_contiguous() || qkv.dim() != 2 || qkv.size(0) == 0) return false;
  if (delta.defined() && (!FusedOn(delta, {qkv}) || !delta.is_contiguous() || delta.sizes() != qkv.sizes()))
    return false;
  if (q_norm.defined() != k_norm.defined() || (q_norm.defined() && !FusedOn(qkv, {q_norm, k_norm}))) return false;
  if (!cuda::QkvHeadDimSupported(s.head_dim) || !cos.is_contiguous() || !sin.is_contiguous()) return false;
  return cos.numel() == qkv.size(0) * s.head_dim && sin.numel() == cos.numel();
}

QkvHeads QkvTailFused(const at::Tensor& qkv, const at::Tensor& delta, const at::Tensor& q_norm,
                      const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin, const QkvShape& s,
                      double eps, at::Tensor* sum, at::Tensor* inv) {
  const int64_t T = qkv.size(0);
  QkvHeads out{at::empty({T, s.heads, s.head_dim}, qkv.options()), at::empty({T, s.kv_heads, s.head_dim}, qkv.options()),
               at::empty({T, s.kv_heads, s.head_dim}, qkv.options())};
  const bool norm = q_norm.defined();
  if (norm && delta.defined() && sum) *sum = at::empty_like(qkv);
  if (norm && inv) *inv = at::empty({T, s.heads + s.kv_heads}, qkv.options().dtype(at::kFloat));
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  cuda::QkvNormRope(qkv.scalar_type() == at::kBFloat16, qkv.data_ptr(), ptr(delta), ptr(q_norm), ptr(k_norm),
                    cos.data_ptr(), sin.data_ptr(), sum ? ptr(*sum) : nullptr,
                    inv && inv->defined() ? inv->data_ptr<float>() : nullptr, out.q.data_ptr(), out.k.data_ptr(),
                    out.v.data_ptr(), T, s.heads, s.kv_heads, s.head_dim, static_cast<float>(eps), Stream(qkv));
  return out;
}

class QkvTailNode : public torch::autograd::Function<QkvTailNode> {
 public:
  // delta, q_norm and k_norm: empty (numel 0) when absent.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& delta_in,
                               const at::Tensor& q_norm_in, const at::Tensor& k_norm_in, const at::Tensor& cos,
                               const at::Tensor& sin, const std::vector<int64_t>& shape, double eps) {
    c10::NoGradGuard no_grad;
    const at::Tensor delta = Given(delta_in), q_norm = Given(q_norm_in), k_norm = Given(k_norm_in);
    const QkvShape s{shape[0], shape[1], shape[2]};
    at::Tensor sum, inv;
    QkvHeads out = QkvTailFused(qkv, delta, q_norm, k_norm, cos, sin, s, eps, &sum, &inv);
    const at::Tensor kept = q_norm.defined() ? (delta.defined() ? sum : qkv) : at::Tensor();
    ctx->save_for_backward({kept, q_norm, k_norm, inv, cos, sin});
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["delta"] = delta.defined();
    return {out.q, out.k, out.v};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const at::Tensor &kept = saved[0], &q_norm = saved[1], &k_norm = saved[2], &inv = saved[3], &cos = saved[4],
                     &sin = saved[5];
    at::Tensor any;
    for (const at::Tensor& g : grads)
      if (g.defined()) any = g;
    variable_list out(8);
    if (!any.defined()) return out;
    const int64_t T = any.size(0), width = (shape[0] + 2 * shape[1]) * shape[2];
    const at::Tensor dq = grads[0].defined() ? grads[0].contiguous() : at::Tensor();
    const at::Tensor dk = grads[1].defined() ? grads[1].contiguous() : at::Tensor();
    const at::Tensor dv = grads[2].defined() ? grads[2].contiguous() : at::Tensor();
    at::Tensor d_qkv = at::empty({T, width}, any.options());
    auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
    cuda::QkvNormRopeGrad(any.scalar_type() == at::kBFloat16, ptr(kept), ptr(q_norm), ptr(k_norm),
                          inv.defined() ? inv.data_ptr<float>() : nullptr, cos.data_ptr(), sin.data_ptr(), ptr(dq),
                          ptr(dk), ptr(dv), d_qkv.data_ptr(), T, shape[0], shape[1], shape[2], Stream(any));
    out[0] = d_qkv;
    if (ctx->saved_data["delta"].toBool()) out[1] = d_qkv;
    return out;
  }
};
#endif

#if LOOM_CUDA_KERNELS
// x + (o + delta) and its RMSNorm as one node (AddRmsNormLean): the decode
// RmsNorm kernel forward (it takes the residual add and the delta), and the
// RMSNorm backward kernel with the residual stream's own gradient added.
class AddRmsNormNode : public torch::autograd::Function<AddRmsNormNode> {
 public:
  // delta: empty (numel 0) when absent.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& o,
                               const at::Tensor& delta, const at::Tensor& weight, double eps) {
    c10::NoGradGuard no_grad;
    const std::vector<at::Tensor> r = NormKernel(x, o, Given(delta), weight, eps);
    const at::Tensor &sum = r[0], &y = r[1], &inv = r[2];
    ctx->save_for_backward({sum, weight, inv});
    ctx->saved_data["delta"] = delta.numel() > 0;
    return {sum, y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &sum = saved[0], &weight = saved[1], &inv = saved[2];
    variable_list out(5);
    at::Tensor d;
    if (!grads[1].defined()) {
      d = grads[0];
    } else {
      const int64_t n = sum.size(-1);
      const at::Tensor g = grads[1].contiguous();
      const at::Tensor add = grads[0].defined() ? grads[0].contiguous() : at::Tensor();
      d = at::empty_like(sum);
      cuda::RmsNormGrad(sum.scalar_type() == at::kBFloat16, g.data_ptr(), sum.data_ptr(), weight.data_ptr(),
                        inv.data_ptr<float>(), d.data_ptr(), sum.numel() / n, n, Stream(sum),
                        add.defined() ? add.data_ptr() : nullptr);
    }
    if (!d.defined()) return out;
    out[0] = d;
    out[1] = d;
    if (ctx->saved_data["delta"].toBool()) out[2] = d;
    return out;
  }
};

bool FusedAddNormOn(const at::Tensor& x, const at::Tensor& o, const at::Tensor& delta, const at::Tensor& weight) {
  if (!FusedOn(x, {o, weight}) || x.numel() == 0 || x.size(-1) > cuda::kMaxNormWidth) return false;
  if (!x.is_contiguous() || !o.is_contiguous() || o.sizes() != x.sizes()) return false;
  return !delta.defined() || (FusedOn(delta, {x}) && delta.is_contiguous() && delta.sizes() == x.sizes());
}
#endif

}  // namespace

at::Tensor RopePlain(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + RotateHalf(x) * sin;
}

at::Tensor RopeLean(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rd = cos.size(-1), hd = x.size(-1);
  if (rd < hd)  // partial RoPE (glm4_moe): the first rd dims turn, the rest pass through
    return at::cat({RopeLean(x.narrow(-1, 0, rd), cos, sin), x.narrow(-1, rd, hd - rd)}, -1);
  if (!c10::GradMode::is_enabled() || !x.requires_grad()) return RopePlain(x, cos, sin);
  return RopeNode::apply(x, cos, sin);
}

std::vector<at::Tensor> SplitLean(const at::Tensor& x, const std::vector<int64_t>& widths) {
  if (!c10::GradMode::is_enabled() || !x.requires_grad()) return Columns(x, widths);
  return SplitNode::apply(x, widths);
}

at::Tensor RmsNormPlain(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  return ScaleNormed(weight, xf * InverseRms(xf, eps), x.scalar_type());
}

at::Tensor RmsNormLean(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!c10::GradMode::is_enabled() || !x.requires_grad()) {
    at::Tensor y, inv;
    return FusedRmsNorm(x, weight, eps, y, inv) ? y : RmsNormPlain(x, weight, eps);
  }
  return RmsNormNode::apply(x, weight, eps);
}

at::Tensor SwiGluPlain(const at::Tensor& gate_up) {
  const int64_t inter = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, inter)) * gate_up.narrow(-1, inter, inter);
}

at::Tensor SwiGluLean(const at::Tensor& gate_up) {
  if (!c10::GradMode::is_enabled() || !gate_up.requires_grad()) {
    at::Tensor out = FusedSwiGlu(gate_up);
    return out.defined() ? out : SwiGluPlain(gate_up);
  }
  return SwiGluNode::apply(gate_up);
}

QkvHeads QkvTailLean(const at::Tensor& qkv, const at::Tensor& delta, const at::Tensor& q_norm,
                      const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, double eps, int64_t v_dim) {
  const QkvShape s{heads, kv_heads, head_dim};
  if (v_dim <= 0) v_dim = head_dim;
#if LOOM_CUDA_KERNELS
  if (v_dim == head_dim && FusedQkvOn(qkv, delta, q_norm, k_norm, cos, sin, s)) {
    const bool grad = c10::GradMode::is_enabled() && (qkv.requires_grad() || (delta.defined() && delta.requires_grad()));
    if (!grad) return QkvTailFused(qkv, delta, q_norm, k_norm, cos, sin, s, eps, nullptr, nullptr);
    const variable_list out =
        QkvTailNode::apply(qkv, Present(delta, qkv), Present(q_norm, qkv), Present(k_norm, qkv), cos, sin,
                           std::vector<int64_t>{heads, kv_heads, head_dim}, eps);
    return QkvHeads{out[0], out[1], out[2]};
  }
#endif
  const int64_t T = qkv.size(0), qn = heads * head_dim, kvn = kv_heads * head_dim;
  const std::vector<at::Tensor> split = SplitLean(delta.defined() ? qkv + delta : qkv, {qn, kvn, kv_heads * v_dim});
  at::Tensor q = split[0].reshape({T, heads, head_dim});
  at::Tensor k = split[1].reshape({T, kv_heads, head_dim});
  at::Tensor v = split[2].reshape({T, kv_heads, v_dim});
  if (q_norm.defined()) {
    q = RmsNormLean(q, q_norm, eps);
    k = RmsNormLean(k, k_norm, eps);
  }
  return QkvHeads{RopeLean(q, cos, sin), RopeLean(k, cos, sin), v};
}

std::pair<at::Tensor, at::Tensor> AddRmsNormLean(const at::Tensor& x, const at::Tensor& o, const at::Tensor& delta,
                                                 const at::Tensor& weight, double eps) {
#if LOOM_CUDA_KERNELS
  if (FusedAddNormOn(x, o, delta, weight)) {
    const bool grad = c10::GradMode::is_enabled() &&
                      (x.requires_grad() || o.requires_grad() || (delta.defined() && delta.requires_grad()));
    if (!grad) {
      const std::vector<at::Tensor> out = NormKernel(x, o, delta, weight, eps);
      return {out[0], out[1]};
    }
    const variable_list out = AddRmsNormNode::apply(x, o, Present(delta, x), weight, eps);
    return {out[0], out[1]};
  }
#endif
  const at::Tensor sum = x + (delta.defined() ? o + delta : o);
  return {sum, RmsNormLean(sum, weight, eps)};
}

}  // namespace loom::engine
