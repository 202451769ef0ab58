// lora_nodes: the segment and grouped LoRA deltas (slot_bank.h) as single
// autograd nodes with written-out backwards that add each used slot's
// gradient into the factors' .grad in place, in that slot's rows only.
//
// Why: through ATen's op-by-op graph every use of a slot's slice of A or B
// (select, narrow, index_select, a dtype cast) has a backward that first
// materialises a dense zero [N, R, d] gradient and then adds all of it into
// .grad: per target per pass, memory traffic that grows with the number of
// slots N, and ~10 autograd nodes a target that dominate a small step's host
// time. Here the node's backward writes gradients of shape [r, d] straight
// into A.grad[s, :r] and B.grad[s, :, :r] and returns none for A and B.
//
// The forward values are those of the plain ops (the same calls, run without
// a graph); the gradients are those the graph would give, to rounding
// (tests/engine/slot_bank_test.cpp compares them). A and B are inputs of the
// node only so that it is part of every backward that reaches the factors
// (RecomputedLayer's too); their autograd gradient stays undefined.
//
// Threading: the engine thread, and the autograd engine's thread for the
// device inside the caller's backward(); one backward at a time per bank.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "engine/lora/slot_bank.h"

namespace loom::engine {

// A run of rows [begin, begin + len) that use one slot (slot < 0: no LoRA,
// zero rows), at the slot's rank and alpha / r.
struct LoraRun {
  int64_t begin = 0, len = 0;
  int64_t slot = -1, rank = 0;
  double scale = 0;
};

// sum over runs of scale * (x_run a^T) b^T, a = A[slot, :rank], b =
// B[slot, :, :rank], in dtype ct; rows outside every run are zero. x [T, d_in].
at::Tensor SegmentLoraDelta(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                            const std::vector<LoraRun>& runs, at::ScalarType ct, int64_t d_out);

// The .grad of a bank factor (A or B), created zero on first use as
// AccumulateGrad would: the nodes that write a slot's gradient in place
// (these, and the unembed's) add into it.
at::Tensor& FactorGrad(const at::Tensor& factor);

// GroupedDelta's value (slot_bank.h) in dtype ct. cast, when given, holds
// the grouped slots' factors already gathered and cast to ct (a [U, R, d_in],
// b [U, d_out, R]: views of SlotBank::PassGroup's) and, where defined, the
// views their gradients are written to (ga, gb), with token the pass's
// flush token (PassFactors); else the factors are gathered from A and B here
// and their gradients added into A.grad and B.grad.
at::Tensor GroupedLoraDelta(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const LoraGroups& routing,
                            at::ScalarType ct, int64_t d_out, const JointTarget* cast = nullptr,
                            const at::Tensor& token = {});

// The flush token of a pass's gradient buffer (PassFactors): a [1] tensor
// whose node, run by autograd after every node that takes the token as an
// input, adds grad [U, len] (in the compute type) into flat_grad_cols' rows
// `slots` in fp32 (repeated slots add up). anchor: a bank leaf that requires
// grad (no gradient reaches it).
at::Tensor GradientFlushToken(const at::Tensor& anchor, const at::Tensor& grad, const at::Tensor& flat_grad_cols,
                              const at::Tensor& slots);

// The grouped deltas of several targets that share the input x, side by
// side: at::cat of GroupedLoraDelta's for each, as one node that writes
// each target's output into its columns of one [T, sum d_out] tensor and
// returns one input gradient (the targets' sum, accumulated in the GEMMs)
// instead of one per target. Ragged rows (LoraGroups::ragged) run as they
// are, through grouped GEMMs of each group's own length; other rows not in
// padded order (routing not an identity) are gathered into it once and read
// back once, for all targets. GroupedLoraDelta with cast factors takes this
// node too where the rows are ragged.
at::Tensor JointGroupedLoraDelta(const at::Tensor& x, const std::vector<JointTarget>& targets,
                                 const LoraGroups& routing, at::ScalarType ct, const at::Tensor& token = {});

// The same with the frozen base projection inside the node: at::linear(x,
// weight, bias) plus the targets' deltas (each accumulated into its columns
// by its GEMM, one rounding), and in the backward x's gradient g weight plus
// the targets', accumulated in the GEMMs: no delta tensor and no add either
// way (ragged rows: each delta added to its columns). weight [sum d_out,
// d_in] and x in the factors' compute type (the model dtype); rows in padded
// order or ragged, every row in a group; a recorded node only (the factors
// require grad).
at::Tensor ProjectedJointLora(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                              const std::vector<JointTarget>& targets, const LoraGroups& routing,
                              const at::Tensor& token = {});

}  // namespace loom::engine
