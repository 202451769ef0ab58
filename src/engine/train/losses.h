// Losses: the per-token loss of Tinker's five losses as differentiable
// functions of the learner's target logprobs (spec tinker-wire.md §9), and
// the packing of datums' loss inputs into tensors along the token axis.
//
// Every loss is summed over tokens and datums, never averaged; these
// functions return the per-token terms and the caller sums them.
// Pure functions: any thread, but tensors follow the engine's device rules.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "engine/api.h"
#include "engine/train/loss_spec.h"

namespace loom::engine::train {

// Loss inputs of consecutive datums on one token axis of length T.
struct LossInputs {
  at::Tensor weights;           // cross_entropy: fp32, the shape of the logprobs ([T] or [T, K])
  at::Tensor sampler_logprobs;  // RL losses: fp32 [T], the `logprobs` input q_t
  at::Tensor advantages;        // RL losses: fp32 [T]
};

// Element j of a loss input as fp32 (int64 arrays are widened).
float ValueAt(const Array& a, size_t j);

// Target tokens of validated datums as int64 [T] (k_cols == 0) or [T, k_cols]
// (k_cols >= every datum's K; a 1-D datum fills column 0; padding is token 0).
at::Tensor PackTargets(const std::vector<const Datum*>& data, int64_t k_cols);

// The loss inputs of validated datums, laid out like PackTargets(data, k_cols)
// for cross_entropy (missing weights = 1, padding = 0) and as [T] for the RL
// losses. On the given device.
LossInputs PackLossInputs(const LossSpec& spec, const std::vector<const Datum*>& data, int64_t k_cols,
                          at::Device device);

// Per-token loss L_t with the shape of logprobs (lp), differentiable in lp:
//   cross_entropy        −lp·w
//   importance_sampling  −r·A                         r = exp(lp − q)
//   ppo                  −min(r·A, clip(r, lo, hi)·A)
//   cispo                −sg[clip(r, lo, hi)]·lp·A
//   dro                  −(lp·A − ½·β·(lp − q)²)
// For the RL losses lp must be [T].
at::Tensor ElementwiseLoss(const LossSpec& spec, const at::Tensor& logprobs, const LossInputs& inputs);

}  // namespace loom::engine::train
