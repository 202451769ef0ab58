#include "engine/train/split_state.h"

#include <c10/core/GradMode.h>

namespace loom::engine::train {

namespace {

// Each (part, whole) pair of slot s's tensors: A, B, and their two moments.
template <typename F>
void EachFactor(const SlotBank& bank, const SlotOptimizer& optimizer, int s, const WholeSlot& whole, F&& f) {
  const auto& mine = bank.targets();
  const auto& all = whole.bank->targets();
  for (size_t k = 0; k < mine.size(); ++k) {
    for (bool a : {true, false}) {
      const FactorShard& shard = a ? mine[k].a_shard : mine[k].b_shard;
      const SlotOptimizer::Moments& m = a ? optimizer.a(k) : optimizer.b(k);
      const SlotOptimizer::Moments& wm = a ? whole.optimizer->a(k) : whole.optimizer->b(k);
      f(shard, (a ? mine[k].A : mine[k].B).select(0, s), (a ? all[k].A : all[k].B).select(0, 0));
      f(shard, m.exp_avg.select(0, s), wm.exp_avg.select(0, 0));
      f(shard, m.exp_avg_sq.select(0, s), wm.exp_avg_sq.select(0, 0));
    }
  }
}

}  // namespace

WholeSlot MakeWholeSlot(const SlotBank& bank, const std::vector<LoraTargetSpec>& whole) {
  WholeSlot w;
  const at::Device device = bank.flat().device();
  w.bank = std::make_unique<SlotBank>(1, bank.max_rank(), device, whole);
  w.optimizer = std::make_unique<SlotOptimizer>(*w.bank);
  return w;
}

WholeSlot GatherSlot(const SlotBank& bank, const SlotOptimizer& optimizer, int s,
                     const std::vector<LoraTargetSpec>& whole, Collective& group) {
  WholeSlot w = MakeWholeSlot(bank, whole);
  const SlotState& st = bank.slot(s);
  if (Status bound = w.bank->Bind(0, st.config); !bound.ok()) throw std::runtime_error(bound.message());
  w.bank->slot(0).step = st.step;
  c10::NoGradGuard no_grad;
  EachFactor(bank, optimizer, s, w, [&](const FactorShard& shard, const at::Tensor& part, const at::Tensor& out) {
    if (shard.kind != ShardKind::kSplit) {
      out.copy_(part);
      return;
    }
    const std::vector<at::Tensor> parts = group.AllGather(part.contiguous());
    out.copy_(at::cat(parts, shard.dim));
  });
  return w;
}

void ScatterSlot(const WholeSlot& whole, SlotBank& bank, SlotOptimizer& optimizer, int s) {
  c10::NoGradGuard no_grad;
  EachFactor(bank, optimizer, s, whole, [&](const FactorShard& shard, const at::Tensor& part, const at::Tensor& in) {
    part.copy_(shard.kind == ShardKind::kSplit ? in.narrow(shard.dim, shard.offset, part.size(shard.dim)) : in);
  });
  bank.slot(s).step = whole.bank->slot(0).step;
  bank.ZeroGrad(s);
}

}  // namespace loom::engine::train
