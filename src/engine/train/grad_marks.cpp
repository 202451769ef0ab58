#include "engine/train/grad_marks.h"

#include <c10/core/GradMode.h>

namespace loom::engine::train {

GradMark TakeGradMark(const SlotBank& bank, int slot) {
  GradMark m;
  m.slot = slot;
  m.zero = !bank.slot(slot).grad_dirty;
  if (m.zero) return m;
  c10::NoGradGuard no_grad;
  for (const LoraTarget& t : bank.targets()) {
    m.a.push_back(t.A.grad().defined() ? t.A.grad().select(0, slot).clone() : at::Tensor());
    m.b.push_back(t.B.grad().defined() ? t.B.grad().select(0, slot).clone() : at::Tensor());
  }
  return m;
}

void RestoreGradMark(SlotBank& bank, const GradMark& mark) {
  if (mark.zero) {
    bank.ZeroGrad(mark.slot);  // also marks the slot clean
    return;
  }
  c10::NoGradGuard no_grad;
  auto& targets = bank.targets();
  for (size_t i = 0; i < targets.size(); ++i) {
    for (auto [param, saved] : {std::pair{&targets[i].A, &mark.a[i]}, std::pair{&targets[i].B, &mark.b[i]}}) {
      if (!param->grad().defined()) continue;
      at::Tensor rows = param->mutable_grad().select(0, mark.slot);
      if (saved->defined()) rows.copy_(*saved);
      else rows.zero_();
    }
  }
  bank.slot(mark.slot).grad_dirty = true;
}

}  // namespace loom::engine::train
