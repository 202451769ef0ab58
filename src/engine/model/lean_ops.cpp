#include "engine/model/lean_ops.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

namespace loom::engine {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// 1/rms of each row, fp32 [.., 1]: the factor RmsNormPlain multiplies by.
at::Tensor InverseRms(const at::Tensor& xf, double eps) { return at::rsqrt(xf.pow(2).mean(-1, true) + eps); }

class RmsNormNode : public torch::autograd::Function<RmsNormNode> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    c10::NoGradGuard no_grad;
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor inv = InverseRms(xf, eps);
    ctx->save_for_backward({x, weight, inv});
    return weight * (xf * inv).to(x.scalar_type());
  }

  // y = w * cast(n), n = x * inv, inv = (mean(x^2) + eps)^-1/2:
  // dn = cast_back(g * w); dx = inv * (dn - n * mean(dn * n)).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &inv = saved[2];
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
    const at::Tensor g = gate_up.narrow(-1, 0, inter).to(at::kFloat);
    const at::Tensor u = gate_up.narrow(-1, inter, inter).to(at::kFloat);
    const at::Tensor dy = grads[0].to(at::kFloat);
    const at::Tensor s = at::sigmoid(g);
    const at::Tensor dg = dy * u * s * (1.0 + g * (1.0 - s));
    const at::Tensor du = dy * (g * s);
    return {at::cat({dg, du}, -1).to(gate_up.scalar_type())};
  }
};

}  // namespace

at::Tensor RmsNormPlain(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  return weight * (xf * InverseRms(xf, eps)).to(x.scalar_type());
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
