#include "cli/slot_plan.h"

#include <fmt/format.h>

namespace loom::cli {

std::string DescribeSlotPlan(const engine::ModelInfo& info) {
  constexpr double kMiB = 1024.0 * 1024.0;
  const double all = static_cast<double>(info.slot_bytes) * info.max_slots;
  std::string line = fmt::format("slot plan: {} slots{} at max_rank {}{}, {:.1f} MiB each on the {}{}, {:.1f} MiB in all",
                                 info.max_slots, info.auto_slots ? " (auto)" : "", info.max_rank,
                                 info.auto_rank ? " (auto)" : "", static_cast<double>(info.slot_bytes) / kMiB,
                                 info.device, info.moments_on_host ? " (AdamW moments on the host)" : "", all / kMiB);
  if (info.slot_room_bytes > 0)
    line += fmt::format("; {:.0f} MiB may hold slots, {:.0f} MiB of it left", info.slot_room_bytes / kMiB,
                        (static_cast<double>(info.slot_room_bytes) - all) / kMiB);
  return line;
}

}  // namespace loom::cli
