// LossSpec: which of Tinker's five losses a forward_backward call asks for,
// with its loss_fn_config resolved against the documented defaults, plus the
// tensor-free checks of a call's data (spec tinker-wire.md §8.2, §9).
//
// Invariant: a LossSpec returned by Parse() has finite parameters within the
// loss's domain. Pure functions: any thread may call them (the gateway uses
// ValidateCallData on I/O threads, before anything reaches the engine).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/api.h"

namespace loom::engine::train {

enum class LossKind { kCrossEntropy, kImportanceSampling, kPpo, kCispo, kDro };

struct LossSpec {
  LossKind kind = LossKind::kCrossEntropy;
  std::string name = "cross_entropy";
  double clip_low = 0.0;   // ppo: 0.8, cispo: 0.0 (absolute ratio bounds)
  double clip_high = 0.0;  // ppo: 1.2, cispo: 4.0
  double beta = 0.0;       // dro: 0.05

  // Unknown loss name, unknown config key, non-finite value, clip_low >
  // clip_high or a negative bound/beta → Invalid naming the key.
  static Result<LossSpec> Parse(const std::string& loss_fn, const std::map<std::string, double>& config);

  // Inputs this loss reads: required and optional loss_fn_inputs keys.
  std::vector<std::string> RequiredInputs() const;
  std::vector<std::string> OptionalInputs() const;
  // cross_entropy accepts (N,) or (N,K) target_tokens; the RL losses (N,) only.
  bool AllowsTopK() const { return kind == LossKind::kCrossEntropy; }
  // Same loss and parameters (passes of equal specs can share a graph).
  bool operator==(const LossSpec&) const = default;
};

// Checks datum `index` of a call: non-empty, no longer than context_window
// (0 = unlimited), every input token and target token in [0, vocab_size),
// exactly the loss's input keys, each with the right dtype, a data length
// that matches its shape, leading dimension tokens.size(), and finite values.
// The message names the datum index and the field.
Status ValidateDatum(const LossSpec& spec, const Datum& datum, size_t index, int64_t vocab_size,
                     int64_t context_window);

// Parse + ValidateDatum for every datum of the call.
Status ValidateCallData(const ForwardBackwardCall& call, int64_t vocab_size, int64_t context_window);

// K of a validated datum's target_tokens: 0 for (N,), K for (N,K).
int64_t TopK(const Datum& datum);

}  // namespace loom::engine::train
