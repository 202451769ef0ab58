// CheckPassRoom: whether a served model's device memory, after its adapter
// slots and every sampler's KV cache are allocated, leaves room to train. A
// server whose slots and sampler leave no room would refuse every
// forward_backward; `loom serve` and the benches' in-process service refuse
// to start instead, naming the flags that free memory.
//
// Threading: call before the service starts.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"
#include "engine/api.h"
#include "service/options.h"

namespace loom::service {

// The fewest tokens per training pass that a model's share of the device
// memory must hold.
constexpr int64_t kMinPassTokens = 512;

// Invalid when engine's room for activations (Engine::MaxPassTokens, with
// every layer recomputed), split over `models` models served at once, holds
// fewer than kMinPassTokens tokens; Ok where memory sets no limit (the CPU,
// MaxPassTokens 0). name: the model's, for the message.
Status CheckPassRoom(const engine::Engine& engine, int64_t models, const std::string& name);

// Tokens per packed pass where no --token-budget is given on a device whose
// memory sets no limit the engine knows of (the CPU).
constexpr int64_t kDefaultTokenBudget = 8192;

// The token budget of a model's passes: `asked` when > 0 (--token-budget),
// else its share of the room for activations (MaxPassTokens / models), else
// kDefaultTokenBudget. `loom serve` and the benches' in-process service
// (cli/service_driver.h) both size their passes by it.
int64_t TokenBudget(const engine::Engine& engine, int64_t models, int64_t asked);

// The tokens the next pass may hold: from the room free now with every layer
// kept (`kept`) and with every layer recomputed (`most`, Engine's
// KeptPassTokens and MaxPassTokens over the models sharing the device), as
// options.pass_sizing says. 0 where no limit is known (most <= 0); never
// above most.
int64_t PassRoomTokens(int64_t kept, int64_t most, const ServiceOptions& options);

// --pass-tokens' value ("kept" or "most", as the flag checks) as a PassSizing.
inline ServiceOptions::PassSizing ParsePassSizing(const std::string& flag) {
  return flag == "kept" ? ServiceOptions::PassSizing::kKept : ServiceOptions::PassSizing::kMost;
}

}  // namespace loom::service
