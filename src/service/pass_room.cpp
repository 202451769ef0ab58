#include "service/pass_room.h"

#include <fmt/format.h>

#include <algorithm>

namespace loom::service {

Status CheckPassRoom(const engine::Engine& engine, int64_t models, const std::string& name) {
  const int64_t free_limit = engine.MaxPassTokens();
  const int64_t share = free_limit / std::max<int64_t>(1, models);
  if (free_limit <= 0 || share >= kMinPassTokens) return Status::Ok();
  const std::string who =
      models > 1 ? fmt::format("the {} models together leave", models) : std::string("the slots and the sampler leave");
  return Status::Invalid(fmt::format(
      "{} room for {} tokens per training pass of '{}' ({}), fewer than {}; {}lower --max-adapters, "
      "--kv-budget-tokens or --sampler-adapters",
      who, share, name, engine.MemoryPlanReport(), kMinPassTokens, models > 1 ? "serve fewer models or " : ""));
}

int64_t TokenBudget(const engine::Engine& engine, int64_t models, int64_t asked) {
  if (asked > 0) return asked;
  const int64_t share = engine.MaxPassTokens() / std::max<int64_t>(1, models);
  return share > 0 ? share : kDefaultTokenBudget;
}

int64_t PassRoomTokens(int64_t kept, int64_t most, const ServiceOptions& options) {
  if (most <= 0) return 0;
  if (options.pass_sizing == ServiceOptions::PassSizing::kMost || kept <= 0) return most;
  return std::min(most, std::max(kept, options.min_kept_pass_tokens));
}

}  // namespace loom::service
