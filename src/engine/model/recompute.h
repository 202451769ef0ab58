// recompute: activation recomputation of one decoder layer (checkpointing).
// The forward runs the layer without keeping its graph and keeps only its
// input; the backward runs the layer again on that input, with a graph, and
// differentiates it. Memory for the layer is then one [T, hidden] row set
// instead of all its intermediates, for one more forward of the layer.
//
// Invariant: the layer function is deterministic and depends on nothing but
// its input and `params` that can change between the forward and the
// backward (the LoRA factors do not change inside one forward_backward), so
// the recomputed graph is the one the forward would have kept: values and
// gradients are those of the plain layer, bit for bit on the same device.
//
// Threading: the engine thread (the backward runs on the autograd engine's
// thread for the device, inside the caller's backward()).
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <vector>

namespace loom::engine {

using LayerFn = std::function<at::Tensor(const at::Tensor&)>;

// fn(x) with recomputation. params: the leaves fn's graph reaches whose
// gradients are wanted (each defined and requiring grad); they receive their
// gradients as if fn had run with a graph. fn is kept alive until the
// backward (or the graph) is gone.
at::Tensor RecomputedLayer(std::shared_ptr<const LayerFn> fn, const at::Tensor& x,
                           const std::vector<at::Tensor>& params);

}  // namespace loom::engine
