// slot_rows: the two row copies between the slot bank's fp32 rows and a
// pass's per-slot buffers (SlotBank::PassGroup and the gradient flush,
// lora_nodes.h). On CUDA each is one kernel over all the slots
// (lora/cuda/slot_rows_kernels.h); elsewhere the ATen ops, with the same
// bits (one cast, one fp32 add an element).
//
// Threading: pure functions of their arguments; any thread.
#pragma once
#include <ATen/ATen.h>

namespace loom::engine {

// cols [N, len] fp32, unit column stride (a column block of the bank's
// flat rows), slots [U] int64 on cols' device: [U, len] in ct, row u being
// cols[slots[u]] cast once. Without a graph.
at::Tensor GatherSlotRows(const at::Tensor& cols, const at::Tensor& slots, at::ScalarType ct);

// into [N, len] fp32 (likewise) += rows [U, len] (any float type) at rows
// slots: into[slots[u]] += float(rows[u]), a repeated slot's rows added in
// turn (index_add_'s sum, to its order). Without a graph.
void AddSlotRows(const at::Tensor& into, const at::Tensor& slots, const at::Tensor& rows);

}  // namespace loom::engine
