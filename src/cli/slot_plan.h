// SlotPlan: the adapter slots `loom serve` opens and their rank, decided
// before the engine allocates them (Engine::Open sizes the SlotBank once).
//
// Flags given (--max-adapters N, --max-rank R): as given; Engine::Open still
// refuses slots that do not fit. Left out, from the model and the memory:
//  - max rank: kDenseRank for dense models (the cookbook's distillation
//    recipes use 128), kMoeRank for mixture-of-experts models, whose slots
//    grow with the experts (docs/architecture.md, expert LoRA layout);
//  - slots: as many slots at that rank as fit in kAutoShare of the memory
//    (half of what Engine::Open allows them, so passes, the sampler's KV
//    cache and its adapters keep the rest), at least 1, at most kAutoCap.
//    The memory is the host's RAM on the CPU. On a GPU engine/api.h does not
//    report the device's memory, so the count is kNoMemoryFallback there
//    until it does (the report of this change asks for it).
// The model's numbers come from a probe engine opened first with one slot at
// rank 1 and no calibration: dense or MoE (active vs base parameters) and a
// slot's bytes per unit of rank (a LoRA factor's size is linear in its rank).
//
// Threading: call from the main thread before the service starts.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"
#include "engine/api.h"

namespace loom::cli {

struct SlotPlan {
  int slots = 0;
  int max_rank = 0;
  int64_t slot_bytes = 0;   // one slot at max_rank (0 = not probed: both flags given)
  int64_t room_bytes = 0;   // the memory the auto count was taken from (0 = none)
  bool auto_slots = false;  // --max-adapters was left out
  bool auto_rank = false;   // --max-rank was left out
  // One line for the log: slots, bytes each, what they take and what is left.
  std::string Describe() const;
};

inline constexpr int kDenseRank = 128;
inline constexpr int kMoeRank = 32;
inline constexpr double kAutoShare = 0.4;
inline constexpr int kAutoCap = 32;
inline constexpr int kNoMemoryFallback = 8;

// max_adapters / max_rank: the flags, 0 = left out. `options` is what the
// real engine will be opened with (its max_slots and max_rank are ignored).
Result<SlotPlan> PlanSlots(const engine::EngineOptions& options, int max_adapters, int max_rank);

}  // namespace loom::cli
