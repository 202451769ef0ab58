#include "engine/model/lean_ops.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>

#include "engine/model/cuda/lean_grads.h"
#endif

namespace loom::engine {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#if LOOM_CUDA_KERNELS
// Whether the fused backward kernels (model/cuda/lean_grads.h) take x: a
// CUDA tensor in bf16 or fp32, with the other tensors in its dtype.
bool FusedOn(const at::Tensor& x, std::initializer_list<at::Tensor> same) {
  if (!x.is_cuda() || (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat)) return false;
  for (const at::Tensor& t : same)
    if (!t.defined() || t.scalar_type() != x.scalar_type() || t.device() != x.device()) return false;
  return true;
}
cudaStream_t Stream(const at::Tensor& x) { return at::cuda::getCurrentCUDAStream(x.device().index()).stream(); }
#endif

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
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor inv = InverseRms(xf, eps);
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
    return SwiGluPlain(gate_up);
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

}  // namespace

at::Tensor RopePlain(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + RotateHalf(x) * sin;
}

at::Tensor RopeLean(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
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
  if (!c10::GradMode::is_enabled() || !x.requires_grad()) return RmsNormPlain(x, weight, eps);
  return RmsNormNode::apply(x, weight, eps);
}

at::Tensor SwiGluPlain(const at::Tensor& gate_up) {
  const int64_t inter = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, inter)) * gate_up.narrow(-1, inter, inter);
}

at::Tensor SwiGluLean(const at::Tensor& gate_up) {
  if (!c10::GradMode::is_enabled() || !gate_up.requires_grad()) return SwiGluPlain(gate_up);
  return SwiGluNode::apply(gate_up);
}

}  // namespace loom::engine
