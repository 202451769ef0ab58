// The sampler's step limits (engine::SamplerOptions: prefill chunk size and
// the caps on a tenant over its share while tenants contend) as flags,
// shared by `loom serve` and `loom bench sample`. Out-of-range values fail
// the command line at start-up with the flag's name and its range.
#pragma once
#include <CLI/CLI.hpp>

#include <string>

#include "engine/sample_api.h"

namespace loom::cli {

class StepFlags {
 public:
  // Adds --max-prefill-tokens, --contended-prefill-tokens, --contended-decode-rows, --mixed-steps,
  // --contended-prefill-riders and --device-turn-ms to app.
  explicit StepFlags(CLI::App& app);
  // Sets the options the parsed flags stand for (call after app.parse).
  void Apply(engine::SamplerOptions* o) const;

 private:
  engine::SamplerOptions values_;  // only the step limits are read
  std::string mixed_ = values_.mixed_steps ? "on" : "off";
  std::string riders_ = values_.contended_prefill_riders ? "on" : "off";
  int64_t turn_ms_ = values_.device_turn.count();
};

}  // namespace loom::cli
