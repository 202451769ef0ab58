// Gradient marks: what a slot's accumulated gradient was at one moment, so a
// forward_backward can take effect whole or not at all (a pass that throws
// half-way through its backward, a request split over several passes whose
// later piece fails).
//
// A mark of a slot whose gradient is known to be zero (SlotState::grad_dirty
// false: nothing accumulated since the last step, zeroing or release) holds
// no tensors, and restoring it zeroes the slot's gradient rows; only a slot
// that accumulates over several calls before its step pays a copy of its
// gradient row: one copy of its row of the bank's flat gradient, which every
// target's .grad is a view of (SlotBank::flat_grad). Threading: engine thread only.
#pragma once
#include <ATen/ATen.h>

#include "engine/lora/slot_bank.h"

namespace loom::engine::train {

struct GradMark {
  int slot = -1;
  bool zero = true;  // the gradient was zero: restore by zeroing
  at::Tensor row;    // else a copy of the slot's row of the bank's flat gradient (every target's A and B)
};

GradMark TakeGradMark(const SlotBank& bank, int slot);
void RestoreGradMark(SlotBank& bank, const GradMark& mark);

}  // namespace loom::engine::train
