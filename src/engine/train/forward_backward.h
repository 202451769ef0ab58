// ForwardBackward: Tinker's forward / forward_backward for many calls (many
// tenants) as ONE packed forward over all their sequences, per-call losses,
// and ONE backward of the sum of the calls' losses.
//
// Why one backward is exact per tenant: a call's loss depends only on its own
// sequences (block-diagonal attention, per-sequence LoRA routing), so the
// gradient of the sum with respect to slot s's A and B is the sum of the
// gradients of the calls on slot s. Gradients accumulate (add) into the
// bank's .grad until the optimizer consumes them.
//
// Failure isolation: a call whose slot or data is invalid gets its error and
// is left out; a call whose loss is not finite is left out of the backward
// (its non-finite values could otherwise leak into other sequences' gradients
// through 0·inf terms) and fails; the other calls complete.
//
// Threading: engine thread only.
#pragma once
#include <vector>

#include "engine/api.h"
#include "engine/lora/slot_bank.h"
#include "engine/model/transformer.h"

namespace loom::engine::train {

class PassGraphs;  // pass_graphs.h

// One result per call, in order. Calls may mix losses and forward_only; the
// forward runs without autograd when every call is forward_only. With
// graphs, a pass of one loss whose calls all want gradients (1-D targets,
// nothing recomputed) runs through graphs->Run() when it fits there: the
// uniform layout, replayed as CUDA graphs on the GPU (pass_graphs.h); the
// same values to float rounding. share_min_rows > 0: a call's datums that
// begin with at least that many of the same rows train them once
// (shared_prefix.h; not in the uniform layout); 0: every datum whole.
std::vector<Result<ForwardBackwardOutput>> ForwardBackward(const Transformer& model, SlotBank& bank,
                                                           const std::vector<ForwardBackwardCall>& calls,
                                                           int64_t vocab_size, int64_t context_window,
                                                           int64_t recompute_layers = 0,
                                                           PassGraphs* graphs = nullptr,
                                                           int64_t share_min_rows = 0);

}  // namespace loom::engine::train
