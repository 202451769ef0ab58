#include "engine/train/grad_marks.h"

#include <c10/core/GradMode.h>

namespace loom::engine::train {

GradMark TakeGradMark(const SlotBank& bank, int slot) {
  GradMark m;
  m.slot = slot;
  m.zero = !bank.slot(slot).grad_dirty;
  if (m.zero) return m;
  c10::NoGradGuard no_grad;
  m.row = bank.flat_grad().select(0, slot).clone();
  return m;
}

void RestoreGradMark(SlotBank& bank, const GradMark& mark) {
  if (mark.zero) {
    bank.ZeroGrad(mark.slot);  // also marks the slot clean
    return;
  }
  c10::NoGradGuard no_grad;
  bank.flat_grad().select(0, mark.slot).copy_(mark.row);
  bank.slot(mark.slot).grad_dirty = true;
}

}  // namespace loom::engine::train
