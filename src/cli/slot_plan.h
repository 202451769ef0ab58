// SlotPlan: the adapter slots `loom serve` opened and their rank, as one log
// line. Engine::Open plans them (engine/api.h, kAutoSlot*) when --max-adapters
// or --max-rank is left out (0), from the model and the device's memory, and
// still refuses given values that do not fit.
//
// Threading: call from the main thread before the service starts.
#pragma once
#include <string>

#include "engine/api.h"

namespace loom::cli {

// One line for the log: slots, bytes each, what they take of the memory
// admitted for slots and what is left, and which values were planned.
std::string DescribeSlotPlan(const engine::ModelInfo& info);

}  // namespace loom::cli
