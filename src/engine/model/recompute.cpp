#include "engine/model/recompute.h"

#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace loom::engine {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The layer function, held by the node between the forward and the backward.
struct Held : torch::CustomClassHolder {
  explicit Held(std::shared_ptr<const LayerFn> f) : fn(std::move(f)) {}
  std::shared_ptr<const LayerFn> fn;
};

class RecomputeNode : public torch::autograd::Function<RecomputeNode> {
 public:
  // inputs = [x, params...]
  static at::Tensor forward(AutogradContext* ctx, at::TensorList inputs, const c10::intrusive_ptr<Held>& held) {
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["fn"] = c10::IValue::make_capsule(held);
    c10::NoGradGuard no_grad;
    return (*held->fn)(inputs[0]);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const auto held = c10::static_intrusive_pointer_cast<Held>(ctx->saved_data["fn"].toCapsule());
    variable_list out(saved.size() + 1);  // one per input tensor, then the holder's (none)
    if (!grads[0].defined()) return out;
    variable_list wrt;
    wrt.reserve(saved.size());
    at::Tensor x;
    {
      c10::NoGradGuard no_grad;
      x = saved[0].detach();
    }
    x.requires_grad_(true);
    wrt.push_back(x);
    for (size_t i = 1; i < saved.size(); ++i) wrt.push_back(saved[i]);
    at::Tensor y;
    {
      c10::AutoGradMode enable(true);
      y = (*held->fn)(x);
    }
    if (!y.requires_grad()) return out;
    const variable_list g = torch::autograd::grad({y}, wrt, {grads[0]}, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t i = 0; i < g.size(); ++i) out[i] = g[i];
    return out;
  }
};

}  // namespace

at::Tensor RecomputedLayer(std::shared_ptr<const LayerFn> fn, const at::Tensor& x,
                           const std::vector<at::Tensor>& params) {
  if (!c10::GradMode::is_enabled()) return (*fn)(x);
  std::vector<at::Tensor> inputs;
  inputs.reserve(params.size() + 1);
  inputs.push_back(x);
  inputs.insert(inputs.end(), params.begin(), params.end());
  return RecomputeNode::apply(at::TensorList(inputs), c10::make_intrusive<Held>(std::move(fn)));
}

}  // namespace loom::engine
