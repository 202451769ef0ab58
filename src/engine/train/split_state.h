// A slot of a bank split over tensor-parallel ranks (engine/model/parallel.h)
// as the whole adapter one process would hold: gathered for checkpoints
// and sampler snapshots, so that what is written is the same full adapter
// at any split (saved at TP 2, a state loads at TP 1 and TP 4, and the PEFT
// snapshot is the whole adapter); and a whole slot scattered back into this
// rank's parts (a load).
//
// Threading: the engine thread. GatherSlot is a collective: every rank
// calls it for the same slot in the same order.
#pragma once
#include <memory>
#include <vector>

#include "engine/lora/slot_bank.h"
#include "engine/model/parallel.h"
#include "engine/train/adamw.h"

namespace loom::engine::train {

// One slot, whole: a bank of one slot over the whole targets, and its moments.
struct WholeSlot {
  std::unique_ptr<SlotBank> bank;
  std::unique_ptr<SlotOptimizer> optimizer;
};

// An unbound whole slot at the bank's max rank over `whole` (the same
// targets as bank's, in the same order, unsplit).
WholeSlot MakeWholeSlot(const SlotBank& bank, const std::vector<LoraTargetSpec>& whole);

// Slot s of this rank's bank (bound) as the whole adapter: its config,
// step, factors and moments, split factors gathered from every rank.
WholeSlot GatherSlot(const SlotBank& bank, const SlotOptimizer& optimizer, int s,
                     const std::vector<LoraTargetSpec>& whole, Collective& group);

// This rank's parts of whole slot 0 into slot s (bound with the same
// config): factors, moments and step; s's gradients are zeroed.
void ScatterSlot(const WholeSlot& whole, SlotBank& bank, SlotOptimizer& optimizer, int s);

}  // namespace loom::engine::train
