#include "cli/slot_plan.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>

namespace loom::cli {

namespace {
constexpr double kMiB = 1024.0 * 1024.0;
}  // namespace

std::string SlotPlan::Describe() const {
  std::string line = fmt::format("slot plan: {} slots{} at max_rank {}{}", slots, auto_slots ? " (auto)" : "",
                                 max_rank, auto_rank ? " (auto)" : "");
  if (slot_bytes > 0) {
    line += fmt::format(", {:.1f} MiB each on the device, {:.1f} MiB in all",
                        slot_bytes / kMiB, slot_bytes * static_cast<double>(slots) / kMiB);
  }
  if (room_bytes > 0) {
    line += fmt::format("; {:.0f} MiB may hold slots ({:.0f}% of host RAM), {:.0f} MiB of it left", room_bytes / kMiB,
                        kAutoShare * 100, (room_bytes - slot_bytes * static_cast<double>(slots)) / kMiB);
  } else if (auto_slots) {
    line += fmt::format("; engine/api.h reports no device memory, so {} slots (set --max-adapters)", slots);
  }
  return line;
}

Result<SlotPlan> PlanSlots(const engine::EngineOptions& options, int max_adapters, int max_rank) {
  SlotPlan plan;
  plan.slots = max_adapters;
  plan.max_rank = max_rank;
  plan.auto_slots = max_adapters <= 0;
  plan.auto_rank = max_rank <= 0;
  if (!plan.auto_slots && !plan.auto_rank) return plan;
  engine::EngineOptions probe = options;
  probe.max_slots = 1;
  probe.max_rank = 1;
  probe.recompute_layers = 0;  // no calibration passes
  probe.graph_max_tokens = 0;
  int64_t bytes_per_rank = 0;
  bool dense = true;
  std::string device;
  {
    auto engine = engine::Engine::Open(probe);
    if (!engine.ok()) return engine.status();
    const engine::ModelInfo& info = (*engine)->info();
    bytes_per_rank = info.slot_bytes;
    dense = info.active_parameters == info.base_parameters;
    device = info.device;
  }  // the probe's memory is given back before the real engine opens
  if (plan.auto_rank) plan.max_rank = dense ? kDenseRank : kMoeRank;
  plan.slot_bytes = bytes_per_rank * plan.max_rank;
  if (!plan.auto_slots) return plan;
  if (device != "cpu") {
    plan.slots = kNoMemoryFallback;
    return plan;
  }
  const double ram = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  plan.room_bytes = static_cast<int64_t>(kAutoShare * ram);
  const int64_t fit = plan.slot_bytes > 0 ? plan.room_bytes / plan.slot_bytes : kAutoCap;
  plan.slots = static_cast<int>(std::clamp<int64_t>(fit, 1, kAutoCap));
  return plan;
}

}  // namespace loom::cli
